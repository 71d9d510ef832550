"""`specmlx models` (the listing, --json, rm) and `--draft auto`, run as a user runs them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from specmlx.tiny import build_tiny_model


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A specmlx home with three models: a target, a smaller model with its tokenizer, and
    a copy of that one whose tokenizer gives two tokens each other's ids (smaller still:
    its tokenizer.json is written without indentation), so only the tokenizer rules it out.
    Also a hub cache holding one more model with the target's tokenizer, the largest."""
    root = tmp_path_factory.mktemp("specmlx-home")
    models = root / "models"
    build_tiny_model(models / "big", seed=0, hidden=128)
    small = build_tiny_model(models / "small", seed=1)
    other = models / "other"
    shutil.copytree(small, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    hub_repo = root / "hub" / "models--someone--tiny"
    build_tiny_model(hub_repo / "snapshots" / "0123abcd", seed=2, hidden=256)
    (hub_repo / "refs").mkdir()
    (hub_repo / "refs" / "main").write_text("0123abcd")
    return root


def specmlx(*args: str, home, input: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "SPECMLX_HOME": str(home), "HF_HUB_CACHE": str(home / "hub")}
    return subprocess.run(
        [sys.executable, "-m", "specmlx", *args],
        capture_output=True,
        text=True,
        env=env,
        input=input,
        timeout=120,
    )


def listing(home) -> dict[str, dict]:
    run = specmlx("models", "--json", home=home)
    assert run.returncode == 0, run.stderr
    return {entry["name"]: entry for entry in json.loads(run.stdout)}


def test_the_listing_groups_models_by_tokenizer(home):
    models = listing(home)
    assert set(models) >= {"big", "small", "other", "someone/tiny"}
    assert models["big"]["tokenizer"] == models["small"]["tokenizer"]
    assert models["someone/tiny"]["tokenizer"] == models["big"]["tokenizer"]
    assert models["other"]["tokenizer"] != models["big"]["tokenizer"]
    assert models["someone/tiny"]["where"] == "hub" and models["big"]["where"] == "specmlx"
    assert {m["model_type"] for m in models.values()} == {"qwen2"}
    assert {m["quantization"] for m in models.values()} == {"dense"}
    assert models["small"]["size_bytes"] < models["big"]["size_bytes"]


def test_the_table_shows_every_model(home):
    run = specmlx("models", home=home)
    assert run.returncode == 0, run.stderr
    for word in ("big", "small", "other", "someone/tiny", "specmlx", "hub", "dense"):
        assert word in run.stdout


def test_the_table_into_a_pipe_keeps_each_model_on_one_line(tmp_path):
    # At a terminal the names fold to its width; a pipe has none, and a script reading the
    # listing must get each name whole.
    name = "a-model-whose-name-is-wider-than-a-terminal-" + "x" * 80
    build_tiny_model(tmp_path / "models" / name, seed=1)
    run = specmlx("models", home=tmp_path)
    assert run.returncode == 0, run.stderr
    header, *rows = run.stdout.splitlines()
    assert len(rows) == 1 and rows[0].split()[:3] == [name, "specmlx", "qwen2"], run.stdout


@pytest.mark.parametrize("name", ["../small", "..", "models/small", "someone/tiny", "absent"])
def test_rm_refuses_anything_but_a_model_directory_in_one_line(name, home):
    run = specmlx("models", "rm", name, "--yes", home=home)
    assert run.returncode == 2
    assert run.stderr.startswith("error:") and run.stderr.count("\n") == 1, run.stderr
    assert (home / "models" / "small").is_dir()


def test_rm_asks_first_and_yes_removes(home):
    doomed = home / "models" / "doomed"
    shutil.copytree(home / "models" / "small", doomed)
    declined = specmlx("models", "rm", "doomed", home=home, input="n\n")
    assert declined.returncode == 1 and "remove" in declined.stderr, declined.stderr
    assert doomed.is_dir()
    removed = specmlx("models", "rm", "doomed", "--yes", home=home)
    assert removed.returncode == 0, removed.stderr
    assert not doomed.exists()


def test_draft_auto_picks_the_smallest_model_with_the_targets_tokenizer(home):
    target = home / "models" / "big"
    run = specmlx("generate", "hi", "-n", "4", "--model", str(target), "--draft", "auto", home=home)
    assert run.returncode == 0, run.stderr
    said = [line for line in run.stderr.splitlines() if line.startswith("draft auto:")]
    assert len(said) == 1 and said[0].startswith("draft auto: picked small ("), run.stderr


def test_draft_auto_with_no_match_says_so_and_runs_the_target_alone(home):
    target = home / "models" / "other"
    args = ["generate", "hi", "-n", "4", "--model", str(target), "--draft", "auto"]
    run = specmlx(*args, home=home)
    assert run.returncode == 0, run.stderr
    said = [line for line in run.stderr.splitlines() if line.startswith("draft auto:")]
    assert said == [
        "draft auto: no local model has the target's tokenizer; running the target alone"
    ], run.stderr
    assert run.stdout.strip()
    scripted = json.loads(specmlx(*args, "--json", home=home).stdout)
    assert scripted["draft"] is None and scripted["tokens"], scripted


def test_heads_are_listed_beside_models_with_the_target_each_drafts_for(tmp_path):
    import specmlx as lib
    from specmlx.heads.feature import new_head
    from specmlx.heads.store import save_head

    target_path = build_tiny_model(tmp_path / "models" / "target", seed=0)
    target = lib.load(target_path)
    save_head(new_head(target), target, tmp_path / "models" / "target-head", {"steps": 0})
    models = listing(tmp_path)
    assert models["target-head"]["model_type"] == "head"
    assert models["target-head"]["head_for"] == "target"
    assert models["target"]["head_for"] is None
    table = specmlx("models", home=tmp_path).stdout
    assert "head for" in table
