"""--tree as a user gives it to generate and chat: a tree setting, its stats, its errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specmlx.settings import MAX_TREE


def specmlx(*args: str, home, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "SPECMLX_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "specmlx", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("specmlx-home")


@pytest.fixture(scope="module")
def pair(model_dirs) -> list[str]:
    return ["--model", str(model_dirs["target"]), "--draft", str(model_dirs["perturbed"])]


def test_a_fixed_tree_drafts_trees_and_says_so_in_the_json(pair, home):
    args = ["generate", *pair, "-p", "hello", "-n", "16", "-g", "3", "--tree", "6", "--json"]
    run = specmlx(*args, "--draft-mode", "model", home=home)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    stats = out["stats"]
    assert out["settings"]["tree"] == 6 and stats["tree"] == 6
    assert stats["tree_rounds"] > 0 and stats["tree_nodes"] <= 6 * stats["tree_rounds"]
    assert sum(stats["rounds_by_shape"].values()) == stats["tree_rounds"]
    assert sum(stats["rounds_by_accepted"].values()) >= stats["tree_rounds"]


def test_verbose_round_notes_name_the_trees_shape(pair, home):
    args = ["generate", *pair, "-p", "hello", "-n", "8", "-g", "3", "--tree", "6", "-v"]
    run = specmlx(*args, "--draft-mode", "model", home=home)
    assert run.returncode == 0, run.stderr
    assert "tree 3+2+1 = 6 nodes (model) · accepted" in run.stderr
    assert "trees in" in run.stderr  # the stats line


def test_off_drafts_chains(pair, home):
    args = ["generate", *pair, "-p", "hello", "-n", "8", "-g", "3", "--tree", "off", "--json"]
    stats = json.loads(specmlx(*args, home=home).stdout)["stats"]
    assert stats["tree_rounds"] == 0 and stats["drafted"] > 0


@pytest.mark.parametrize("value", ["1", str(MAX_TREE + 1), "wide"])
def test_a_bad_tree_is_one_line_and_exit_2(value, home):
    run = specmlx("generate", "--model", "tiny", "-p", "hi", "--tree", value, home=home)
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1 and "tree must be auto, off or a number" in run.stderr


def test_chat_sets_the_tree_and_refuses_a_bad_one(pair, home):
    script = ["/set tree 6", "/set gamma 3", "hello", "/set tree 99", "/set", "/exit"]
    run = specmlx("chat", *pair, "-n", "8", "-v", stdin="\n".join(script) + "\n", home=home)
    assert run.returncode == 0, run.stderr
    err = run.stderr
    assert "tree = 6" in err and "tree=6" in err  # set, and kept through the refusal
    refused = [line for line in err.splitlines() if line.startswith("error:")]
    assert refused == [
        f"error: tree must be auto, off or a number of nodes from 2 to {MAX_TREE}, got 99"
    ]
