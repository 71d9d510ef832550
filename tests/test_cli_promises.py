"""What the CLI promises a user: Ctrl-C, bad input and the help each answered in one line."""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import time

import pytest


def env(home) -> dict:
    return {**os.environ, "SPECMLX_HOME": str(home)}


def specmlx(*args: str, home, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specmlx", *args],
        capture_output=True,
        env=env(home),
        timeout=timeout,
        **{"text": True, **kwargs},
    )


def one_error_line(run: subprocess.CompletedProcess, says: str) -> None:
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith(f"error: {says}"), run.stderr
    assert run.stderr.count("\n") == 1 and "internal error" not in run.stderr, run.stderr


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("specmlx-home")


def interrupt_once_started(args: list[str], home, started: str) -> tuple[int, str]:
    """Run specmlx, send SIGINT once `started` shows on stdout or stderr; (rc, stderr)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "specmlx", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env(home),
        # SIGINT handled as at a terminal, even where this run was started in the
        # background: a shell starts those with SIGINT ignored, and children inherit it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    stdout, stderr = proc.stdout.fileno(), proc.stderr.fileno()
    seen = {stdout: b"", stderr: b""}
    deadline = time.monotonic() + 120
    try:
        while started.encode() not in b"".join(seen.values()):
            assert proc.poll() is None, f"exited {proc.returncode} before {started!r}: {seen}"
            assert time.monotonic() < deadline, f"no {started!r} in 120 s: {seen}"
            ready, _, _ = select.select(list(seen), [], [], 1.0)
            for fd in ready:
                seen[fd] += os.read(fd, 65536)
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, (seen[stderr] + rest).decode()


def test_ctrl_c_in_generate_says_interrupted_and_exits_130(endless_target, home):
    args = ["generate", "--model", str(endless_target), "--no-draft", "-p", "hi", "-n", "100000"]
    # the last line of the start-up report: the reply streams right after it
    rc, stderr = interrupt_once_started(args, home, "peak memory")
    assert rc == 130, stderr
    assert stderr.endswith("interrupted\n") and "Traceback" not in stderr, stderr


def test_ctrl_c_in_generate_says_the_stats_of_what_it_generated_then_interrupted(
    endless_target, home
):
    args = ["generate", "--model", str(endless_target), "--no-draft", "-p", "hi", "-n", "100000"]
    # --verbose notes each round as its tokens stream: once one is noted, tokens were made
    rc, stderr = interrupt_once_started([*args, "--verbose"], home, "round 1:")
    assert rc == 130, stderr
    *_, stats, memory, last = stderr.splitlines()
    assert re.match(r"\d+ tokens? · [\d.]+ tok/s · TTFT [\d.]+ s · prefill ", stats), stderr
    assert memory.startswith("peak memory: ") and last == "interrupted", stderr
    assert "Traceback" not in stderr


def test_ctrl_c_in_bench_says_interrupted_and_exits_130(endless_target, model_dirs, home):
    args = ["bench", "--model", str(endless_target), "--draft", str(model_dirs["perturbed"])]
    args += ["--no-mlx-lm", "--no-warmup", "-g", "2", "-t", "0", "-n", "100000"]
    rc, stderr = interrupt_once_started(args, home, " runs of ")
    assert rc == 130, stderr
    assert stderr.endswith("interrupted\n") and "Traceback" not in stderr, stderr


NOT_UTF8 = b"caf\xe9 au lait"  # Latin-1, as an old file or terminal would give it


@pytest.mark.parametrize("how", ["argument", "--prompt", "--system"])
def test_a_non_utf8_argument_is_one_line(how, home):
    # A str with the surrogate Python decodes byte 0xe9 to: subprocess passes on the byte.
    text = NOT_UTF8.decode("utf-8", "surrogateescape")
    given = {
        "argument": [text],
        "--prompt": ["-p", text],
        "--system": ["-p", "hi", "--system", text],
    }
    run = specmlx("generate", "--model", "tiny", *given[how], "-n", "2", home=home)
    source = "--system" if how == "--system" else "the prompt"
    one_error_line(run, f"{source} is not UTF-8 text: byte 0xe9 at offset 3")


def test_a_non_utf8_system_prompt_in_chat_is_one_line(home):
    text = NOT_UTF8.decode("utf-8", "surrogateescape")
    run = specmlx("chat", "--model", "tiny", "--system", text, home=home)
    one_error_line(run, "--system is not UTF-8 text: byte 0xe9 at offset 3")


def test_a_non_utf8_prompt_file_is_one_line(home, tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(NOT_UTF8)
    run = specmlx("generate", "--model", "tiny", "-f", str(path), "-n", "2", home=home)
    one_error_line(run, f"prompt file {path} is not UTF-8 text: byte 0xe9 at offset 3")


def test_a_directory_given_as_the_prompt_file_is_one_line_saying_so(home, tmp_path):
    run = specmlx("generate", "--model", "tiny", "-f", str(tmp_path), "-n", "2", home=home)
    one_error_line(run, f"prompt file {tmp_path} is a directory; give -f a file (- for stdin)")


def test_a_non_utf8_prompt_on_stdin_is_one_line(home):
    run = specmlx(
        "generate", "--model", "tiny", "-f", "-", "-n", "2", home=home, input=NOT_UTF8, text=False
    )
    run.stderr = run.stderr.decode()
    one_error_line(run, "the prompt on stdin is not UTF-8 text: byte 0xe9 at offset 3")


def test_a_utf8_prompt_on_stdin_is_read(home):
    run = specmlx(
        "generate",
        "--model",
        "tiny",
        "-f",
        "-",
        "-n",
        "2",
        "--json",
        home=home,
        input="café au lait",
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["stats"]["prompt_tokens"] > 0


@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_a_seed_out_of_range_is_one_line(seed, home):
    run = specmlx("generate", "--model", "tiny", "-p", "hi", "--seed", seed, home=home)
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("error: Invalid value for '--seed'"), run.stderr
    assert "seed must be an integer >= 0" in run.stderr and run.stderr.count("\n") == 1, run.stderr


@pytest.mark.parametrize(
    "command",
    [["generate", "-p", "hi"], ["chat"], ["serve"], ["bench", "--quick"]],
    ids=lambda c: c[0],
)
def test_a_gamma_above_the_maximum_is_one_line(command, home):
    # bench takes a list: one value above the maximum is enough to refuse it
    gamma = "2,9" if command[0] == "bench" else "9"
    run = specmlx(*command, "--model", "tiny", "--gamma", gamma, home=home, input="")
    one_error_line(run, "gamma (-g) 9 is above the maximum, 8")


def test_the_largest_gamma_is_accepted(home):
    run = specmlx(
        "generate", "--model", "tiny", "-p", "hi", "-g", "8", "-n", "3", "--json", home=home
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["settings"]["gamma"] == 8


def test_brackets_in_the_start_up_log_come_out_intact(monkeypatch, capsys):
    from specmlx.cli import main, report

    # The advice the BLAS line gives where no fast BLAS is found (not on every machine).
    advice = "no fast BLAS: pip install 'specmlx[cpu-fast]'"
    startup_lines = report.startup_lines
    monkeypatch.setattr(report, "startup_lines", lambda *args: [*startup_lines(*args), advice])
    main(["generate", "--model", "tiny", "-p", "hi", "-n", "2"])
    assert advice in capsys.readouterr().err


def test_brackets_in_the_quantize_report_come_out_intact(model_dirs, home, tmp_path):
    out = tmp_path / "q[int4]"
    run = specmlx("quantize", str(model_dirs["target"]), "-o", str(out), home=home)
    assert run.returncode == 0, run.stderr
    assert f"wrote {out} (" in run.stderr, run.stderr


def test_quantize_refuses_an_existing_out_before_reading_the_source(home, tmp_path):
    out = tmp_path / "existing"
    out.mkdir()
    # A source that does not exist: had it been read first, its error would come first.
    run = specmlx("quantize", str(tmp_path / "no-such-model"), "-o", str(out), home=home)
    one_error_line(run, f"{out} already exists; pass --force to replace it")


@pytest.mark.parametrize("bits", [3, 4])
def test_the_quantize_report_names_the_bits_written(bits, model_dirs, home, tmp_path):
    out = tmp_path / "q"
    run = specmlx("quantize", str(model_dirs["target"]), "-o", str(out), "-b", str(bits), home=home)
    assert run.returncode == 0, run.stderr
    assert f"wrote {out} (INT{bits} g64, embedding and head INT6" in run.stderr, run.stderr
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == bits
    assert ("native INT4 kernel" in run.stderr) == (bits == 4), run.stderr


@pytest.mark.parametrize("command", [[], ["generate"], ["chat"], ["quantize"], ["bench"]])
def test_help_shows_flags_as_flags(command, home):
    run = specmlx(*command, "--help", home=home)
    assert run.returncode == 0, run.stderr
    assert "<bool>" not in run.stdout and "--help " in run.stdout, run.stdout
    if command == ["generate"]:
        assert "[[" not in run.stdout  # the optional PROMPT bracketed once
        assert re.search(r"^ +--no-draft +Plain decoding", run.stdout, re.MULTILINE), run.stdout


def test_serve_help_says_its_default_temperature_differs_from_generates(home):
    run = specmlx("serve", "--help", home=home)
    assert run.returncode == 0, run.stderr
    said = " ".join(run.stdout.split())  # the help is wrapped to the terminal's width
    assert "A request that gives no temperature samples at 1.0, OpenAI's default, where " in said
    assert 'decode greedily (their -t defaults to 0): send "temperature": 0 for theirs.' in said


def test_version_prints_the_installed_version_and_exits_0(home):
    from importlib.metadata import version

    run = specmlx("--version", home=home)
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"specmlx {version('specmlx')}\n" and run.stderr == ""


def test_version_falls_back_on_the_packages_own(monkeypatch):
    import importlib.metadata

    import specmlx
    from specmlx.cli import version

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert version() == specmlx.__version__


@pytest.mark.parametrize("template", [[], ["--raw"]])
def test_generate_refuses_a_prompt_longer_than_the_context(template, home):
    # 3000 "~" are 3000 tokens or more; the tiny model's max_position_embeddings is 2048
    run = specmlx("generate", "--model", "tiny", *template, "-p", "~" * 3000, "--json", home=home)
    one_error_line(run, "the prompt is ")
    assert "tokens and target takes 2048" in run.stderr, run.stderr


def test_generate_stops_at_the_end_of_the_context(home):
    args = ["--model", "tiny", "--no-draft", "--raw", "-p", "~" * 2045, "-n", "50", "--json"]
    run = specmlx("generate", *args, home=home)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["stats"]["prompt_tokens"] == 2045 and out["stats"]["tokens"] <= 3


def test_interpreter_start_up_leaves_out_a_shell_that_ran_before_exec(home):
    # /proc's start time is the fork, which exec keeps: a shell that waited before `exec
    # python` would count as interpreter start-up. The shell stamps the time, waits, then
    # execs; the start the CLI's timings count from (interpreter_s, cold_start_s) must
    # fall after that stamp, where the fork lies before it. An order, not a speed: it
    # holds unless the shell's own CPU time (milliseconds) outlasts its wait.
    python = shlex.quote(sys.executable)
    stamp = "import time; print(repr(time.time()))"
    start = "from specmlx.cli.report import process_start; print(repr(process_start()))"
    command = f"{python} -c {shlex.quote(stamp)}; sleep 1; exec {python} -c {shlex.quote(start)}"
    run = subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, env=env(home), timeout=120
    )
    assert run.returncode == 0, run.stderr
    before_wait, started = map(float, run.stdout.split())
    assert started > before_wait, (before_wait, started)


# Output that says what happened (the stats line, /stats, the CPU tag, /set's limits).


def test_the_stats_line_says_prefill_in_words():
    from specmlx.cli.report import stats_line
    from specmlx.engine import Stats

    line = stats_line(Stats(tokens=3, prompt_tokens=41, prefill_tokens=40))
    assert "prefill 40 new of 41 prompt tokens" in line and "40/41" not in line


def test_auto_gamma_shows_the_gamma_its_drafting_rounds_used_not_0():
    from specmlx.cli.report import stats_line
    from specmlx.engine import Stats

    stats = Stats(tokens=30, target_passes=25, drafted=10, accepted=5, gamma="auto")
    stats.rounds_by_gamma = {0: 20, 2: 5}
    line = stats_line(stats)
    assert "γ auto→2 (5 of 25 rounds drafted)" in line and "auto→0" not in line


def test_tau_counts_the_pass_that_sampled_the_eos():
    from specmlx.cli.report import stats_line
    from specmlx.engine import Stats

    # 10 passes: one draft rejected, 8 plain tokens, then a pass whose token was the EOS.
    stats = Stats(tokens=9, target_passes=10, drafted=1, accepted=0, finish_reason="eos", eos=1)
    assert stats.tokens_per_pass == 1.0 and "τ 1.00" in stats_line(stats)


def test_a_draft_auto_kept_idle_is_said_with_its_measured_cost():
    from specmlx.cli.report import plain_note, stats_line
    from specmlx.engine import Stats

    stats = Stats(tokens=5, target_passes=5, gamma="auto", draft_ratio=0.45, forecast_alpha=0.3)
    stats.drafters = ["lookup", "model"]
    line = stats_line(stats, plain_note(stats, has_draft=True))
    assert "draft idle: auto kept plain decoding: a draft pass costs 0.45 of a target pass" in line
    assert "no draft" not in line


def test_generate_says_why_a_loaded_draft_drafted_nothing(model_dirs, home):
    # Three tokens: too few for auto to time the passes, so it keeps plain decoding.
    pair = ["--model", str(model_dirs["target"]), "--draft", str(model_dirs["perturbed"])]
    run = specmlx("generate", *pair, "-p", "hi", "-n", "3", home=home)
    assert run.returncode == 0, run.stderr
    assert "draft idle: auto kept plain decoding" in run.stderr, run.stderr
    assert "no draft" not in run.stderr.splitlines()[-2], run.stderr
    plain = specmlx(
        "generate", "--model", str(model_dirs["target"]), "-p", "hi", "-n", "3", home=home
    )
    assert plain.returncode == 0 and "plain decoding (no draft)" in plain.stderr, plain.stderr


def test_the_cpu_tag_names_the_kernel_that_runs_int4():
    from types import SimpleNamespace

    from specmlx.cli.report import cpu_tag
    from specmlx.cpu import native

    tag = cpu_tag(SimpleNamespace(weights="int4"))
    assert "reference" not in tag
    assert ("native kernel" if native.available() else "mx.quantized_matmul") in tag


def test_chat_stats_after_reset_keep_the_conversation_apart_and_gamma_has_a_maximum(
    model_dirs, home
):
    script = ["hello", "/reset", "again", "/stats", "/set gamma 99", "/set", "/exit"]
    pair = ["--model", str(model_dirs["target"]), "--draft", str(model_dirs["perturbed"])]
    run = specmlx("chat", *pair, "-n", "4", input="\n".join(script) + "\n", home=home)
    assert run.returncode == 0, run.stderr
    err = run.stderr
    assert "this conversation: 1 reply\n" in err and "since chat started: 2 replies\n" in err
    # The only error line (a speed like "994.9 tok/s" holds "99" too)
    refused = [line for line in err.splitlines() if line.startswith("error:")]
    assert refused == ["error: gamma (-g) 99 is above the maximum, 8"], err
    assert "gamma=auto" in err  # the setting stayed as it was


def test_the_servers_num_draft_field_has_the_same_maximum():
    from specmlx.server.fields import APIError, Defaults, parse

    body = {"model": "m", "prompt": "hi", "num_draft": 9}
    with pytest.raises(APIError, match=r"gamma \(-g\) 9 is above the maximum, 8"):
        parse(body, chat=False, defaults=Defaults())


@pytest.mark.parametrize("port", ["65536", "-1"])
def test_serve_refuses_a_port_out_of_range_in_one_line(port, home):
    run = specmlx("serve", "--model", "tiny", "--port", port, home=home)
    one_error_line(run, f"--port must be from 0 to 65535 (0: any free one), got {port}")
