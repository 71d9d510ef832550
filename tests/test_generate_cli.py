"""`specmlx generate` as a user runs it: a subprocess, its JSON, its errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest


def specmlx(*args: str, tmp_home, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "SPECMLX_HOME": str(tmp_home)}
    return subprocess.run(
        [sys.executable, "-m", "specmlx", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("specmlx-home")


@pytest.fixture(scope="module")
def pair(model_dirs) -> list[str]:
    return ["--model", str(model_dirs["target"]), "--draft", str(model_dirs["perturbed"])]


@pytest.fixture(scope="module")
def other_tokenizer_draft(model_dirs, tmp_path_factory):
    """A copy of the draft whose tokenizer gives two tokens each other's ids."""
    path = tmp_path_factory.mktemp("other-tokenizer") / "draft"
    shutil.copytree(model_dirs["perturbed"], path)
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = "a", "b"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    return path


def test_json_schema_and_same_seed_same_output(pair, home):
    # A fixed γ: auto γ follows timings, so it repeats the distribution, not the sample.
    args = ["generate", *pair, "-p", "hello", "-n", "8", "-t", "0.8", "-s", "3", "-g", "3"]
    first = specmlx(*args, "--json", tmp_home=home)
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    assert set(out) >= {"text", "tokens", "model", "draft", "settings", "stats", "timings"}
    assert set(out["settings"]) >= {"max_tokens", "temperature", "top_p", "top_k", "gamma", "seed"}
    assert set(out["stats"]) >= {"tokens", "prompt_tokens", "prefill_tokens", "acceptance", "ttft"}
    cold = ["cold_start_s", "interpreter_s", "import_s", "tokenizer_s", "weights_s"]
    timings = out["timings"]
    assert set(timings) >= {"load_s", "ttft_s", "first_forward_s", "first_token_s", *cold}
    assert all(timings[k] >= 0 for k in cold)
    assert timings["cold_start_s"] >= timings["import_s"] + timings["weights_s"]
    assert timings["first_token_s"] >= timings["cold_start_s"]
    assert out["memory"]["peak_mlx_bytes"] > 0 and out["memory"]["max_rss_bytes"] > 0
    assert 1 <= len(out["tokens"]) <= 8 or out["stats"]["finish_reason"] == "eos"

    again = json.loads(specmlx(*args, "--json", tmp_home=home).stdout)
    assert again["tokens"] == out["tokens"] and again["text"] == out["text"]


def test_text_mode_reports_cold_start_and_stats(pair, home):
    run = specmlx("generate", *pair, "-p", "hi", "-n", "4", "--gamma", "auto", tmp_home=home)
    assert run.returncode == 0, run.stderr
    assert "ready in" in run.stderr and "imports" in run.stderr
    assert "tok/s" in run.stderr and "TTFT" in run.stderr and "peak memory" in run.stderr


def test_the_stats_line_shows_autos_usual_gamma_and_the_rounds_cut_short():
    from specmlx.cli.report import stats_line
    from specmlx.engine import Stats

    stats = Stats(tokens=10, target_passes=5, drafted=6, accepted=4, gamma="auto")
    stats.rounds_by_gamma, stats.cut_short = {0: 1, 3: 2, 1: 1}, 1
    assert "γ auto→3 (3 of 4 rounds drafted, 1 cut short)" in stats_line(stats)


def test_a_stats_line_of_one_token_says_token_not_tokens():
    from specmlx.cli.report import stats_line
    from specmlx.engine import Stats

    line = stats_line(Stats(tokens=1, prompt_tokens=1, prefill_tokens=1))
    assert line.startswith("1 token · ") and "prefill 1 new of 1 prompt token · " in line


def test_the_memory_line_names_what_each_peak_counts(monkeypatch):
    # 513.5 KiB beside 2.5 GiB is no contradiction once each says what it measures.
    from specmlx.cli import report

    peaks = {"peak_mlx_bytes": 525_824, "max_rss_bytes": 5 * 2**29}
    monkeypatch.setattr(report, "memory", lambda: peaks)
    assert report.memory_line() == (
        "peak memory: MLX arrays 513.5 KiB (what MLX allocated; mapped weights are not) · "
        "process 2.5 GiB (max RSS: all resident memory, mapped weights included)"
    )


def test_the_prompt_may_be_a_plain_argument(pair, home):
    args = [*pair, "-n", "4", "-g", "2", "--json"]
    as_flag = specmlx("generate", "-p", "def f(x):", *args, tmp_home=home)
    as_argument = specmlx("generate", "def f(x):", *args, tmp_home=home)
    assert as_argument.returncode == 0, as_argument.stderr
    assert json.loads(as_argument.stdout)["tokens"] == json.loads(as_flag.stdout)["tokens"]


@pytest.mark.parametrize(
    "prompts, says",
    [([], "no prompt"), (["hi", "-p", "hi"], "give the prompt once")],
)
def test_no_prompt_or_two_prompts_is_one_line_and_fails(prompts, says, pair, home):
    run = specmlx("generate", *pair, *prompts, tmp_home=home)
    assert run.returncode != 0
    assert run.stderr.startswith(f"error: {says}") and run.stderr.count("\n") == 1, run.stderr


@pytest.mark.parametrize(
    "flags",
    [
        ["--gamma", "-1"],
        ["--gamma", "many"],
        ["--temperature", "-0.5"],
        ["--top-p", "0"],
        ["--top-p", "1.5"],
        ["--top-p", "1e-46"],
        ["--max-tokens", "0"],
    ],
)
def test_bad_flag_is_one_line_and_fails(flags, pair, home):
    run = specmlx("generate", *pair, "-p", "hi", *flags, tmp_home=home)
    assert run.returncode != 0
    assert run.stderr.startswith("error: ") and run.stderr.count("\n") == 1, run.stderr


def test_missing_model_path(home, tmp_path):
    run = specmlx("generate", "--model", str(tmp_path / "nope"), "-p", "hi", tmp_home=home)
    assert run.returncode != 0
    assert run.stderr.startswith("error: model not found") and run.stderr.count("\n") == 1


def test_draft_with_other_tokenizer(model_dirs, other_tokenizer_draft, home):
    run = specmlx(
        "generate",
        *["--model", str(model_dirs["target"]), "--draft", str(other_tokenizer_draft)],
        *["-p", "hi"],
        tmp_home=home,
    )
    assert run.returncode != 0
    assert "different tokenizer" in run.stderr and run.stderr.count("\n") == 1, run.stderr


def json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines()]


def test_jsonl_streams_one_object_per_token_then_the_stats(pair, home):
    run = specmlx("generate", *pair, "-p", "hello", "-n", "16", "-g", "2", "--jsonl", tmp_home=home)
    assert run.returncode == 0, run.stderr
    *steps, last = json_lines(run.stdout)
    assert last["done"] is True and {"text", "tokens", "stats", "timings"} <= set(last)
    assert all(set(step) == {"token", "text", "from_draft"} for step in steps)
    assert "".join(step["text"] for step in steps) == last["text"]
    assert [s["token"] for s in steps if s["token"] is not None] == last["tokens"]
    assert sum(step["from_draft"] for step in steps) == last["stats"]["accepted"]
    assert run.stderr == ""  # nothing for a script to filter out
    assert "--jsonl" in specmlx("generate", "--help", tmp_home=home).stdout
    both = specmlx("generate", *pair, "-p", "hi", "--json", "--jsonl", tmp_home=home)
    assert both.returncode == 2 and both.stderr == "error: give --json or --jsonl, not both\n"


def test_stop_ends_the_text_exactly_before_the_first_stop_string(pair, home):
    args = ["generate", *pair, "-p", "hello", "-n", "40", "-g", "2"]
    reference = json.loads(specmlx(*args, "--json", tmp_home=home).stdout)["text"]
    middle = len(reference) // 2
    stop = reference[middle : middle + 3]  # likely across tokens: held back while streaming
    later = reference[-3:]  # a second stop: the first of the two found wins
    want = reference[: min(reference.find(stop), reference.find(later))]
    stops = ["--stop", later, "--stop", stop]

    run = specmlx(*args, *stops, "--json", tmp_home=home)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["text"] == want and out["finish_reason"] == "stop"

    streamed = specmlx(*args, *stops, "--jsonl", tmp_home=home)
    *steps, last = json_lines(streamed.stdout)
    assert "".join(step["text"] for step in steps) == want == last["text"]
    assert not any(stop in step["text"] for step in steps)

    text = specmlx(*args, *stops, tmp_home=home)
    assert text.returncode == 0 and stop not in text.stdout, text.stdout
    assert "stopped at --stop" in text.stderr
    empty = specmlx(*args, "--stop", "", tmp_home=home)
    assert empty.returncode == 2 and empty.stderr == "error: --stop needs a non-empty string\n"


def test_quiet_says_nothing_on_stderr_and_verbose_notes_every_round(pair, home):
    quiet = specmlx("generate", *pair, "-p", "hello", "-n", "8", "--quiet", tmp_home=home)
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout.strip(), quiet.stderr

    run = specmlx(
        "generate", *pair, "-p", "hello", "-n", "12", "-g", "2", "-v", "--json", tmp_home=home
    )
    assert run.returncode == 0, run.stderr
    stats = json.loads(run.stdout)["stats"]
    notes = re.findall(
        r"^rounds? (\d+)(?:-(\d+))?: γ [\d/]+ \(\S+\) · accepted (\d+)/(\d+)", run.stderr, re.M
    )
    assert notes, run.stderr
    assert int(notes[-1][1] or notes[-1][0]) == stats["target_passes"]
    assert sum(int(n[2]) for n in notes) == stats["accepted"]
    assert sum(int(n[3]) for n in notes) == stats["drafted"]

    both = specmlx("generate", *pair, "-p", "hi", "-q", "-v", tmp_home=home)
    assert both.returncode == 2 and both.stderr == "error: give --quiet or --verbose, not both\n"
