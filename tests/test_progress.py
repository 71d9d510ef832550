"""Progress a user sees on stderr during a long wait (a long prefill, a conversion), and
never elsewhere: drawn where stderr is a terminal (a pty here, or a rich Console forced to
be one), absent from a pipe, stdout and --quiet. Whether a one-chunk prefill lasts long
enough to be drawn is a matter of time, so that rule is tested with the delay as given."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys

import pytest

# The bar's count, e.g. "1024/1799 prompt tokens" (the stats line says "1799 new of 1800").
BAR = re.compile(rb"(\d+)/(\d+)\x1b\[0m prompt tokens")
LONG = "~" * 1800  # ~1800 tokens of the tiny model (context 2048): four prefill chunks


def env(home) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("FORCE_COLOR", "TTY_"))}
    return {**clean, "SPECMLX_HOME": str(home), "TERM": "xterm-256color", "COLUMNS": "100"}


def run_with_stderr_on_a_terminal(args: list[str], home, stdin: str = "") -> tuple:
    """(exit code, stdout, stderr) of specmlx with stderr on a pty, stdin and stdout piped."""
    master, slave = os.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "specmlx", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=slave,
        env=env(home),
    )
    os.close(slave)
    proc.stdin.write(stdin.encode())
    proc.stdin.close()
    err = b""
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 120)
            assert ready, f"no output in 120 s: {err[-1500:]!r}"
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            err += chunk
        out = proc.stdout.read()
        return proc.wait(timeout=60), out, err
    finally:
        proc.kill()
        os.close(master)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("specmlx-home")


GENERATE = ["generate", "--model", "tiny", "--no-draft", "--raw", "-n", "3", "-p"]


def test_a_long_prefill_shows_its_progress_on_a_terminal(home):
    rc, out, err = run_with_stderr_on_a_terminal([*GENERATE, LONG], home)
    assert rc == 0, err
    counts = [(int(done), int(total)) for done, total in BAR.findall(err)]
    done = sorted({d for d, _ in counts})
    total = counts[-1][1]
    assert {t for _, t in counts} == {total} and total > 1536, counts
    assert done == [0, 512, 1024, 1536, total], counts  # drawn at the start, after each chunk
    assert b"prompt tokens" not in out and b"\x1b" not in out  # the bar never on stdout


def test_quiet_draws_no_bar(home):
    rc, _, err = run_with_stderr_on_a_terminal([*GENERATE, LONG, "--quiet"], home)
    assert rc == 0, err
    assert err == b"", err[-1500:]


def test_a_long_prefill_into_a_pipe_writes_no_control_characters(home):
    run = subprocess.run(
        [sys.executable, "-m", "specmlx", *GENERATE, LONG],
        capture_output=True,
        env=env(home),
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert b"prompt tokens" in run.stderr  # the stats line, which says what prefill took
    assert not re.search(rb"[\x00-\x09\x0b-\x1f\x7f]", run.stderr), run.stderr


def test_chat_shows_a_long_messages_prefill_on_a_terminal(home):
    args = ["chat", "--model", "tiny", "--no-draft", "-n", "2"]
    rc, out, err = run_with_stderr_on_a_terminal(args, home, stdin=LONG + "\n/exit\n")
    assert rc == 0, err
    assert BAR.search(err), err[-1500:]
    assert b"prompt tokens" not in out and b"\x1b" not in out


def test_quantize_shows_its_progress_on_a_terminal_and_nothing_into_a_pipe(
    model_dirs, home, tmp_path
):
    args = ["quantize", str(model_dirs["target"]), "-o"]
    rc, _, err = run_with_stderr_on_a_terminal([*args, str(tmp_path / "a")], home)
    assert rc == 0, err
    assert re.search(rb"\d+/\d+ tensors", err) and b"wrote " in err, err[-1500:]
    piped = subprocess.run(
        [sys.executable, "-m", "specmlx", *args, str(tmp_path / "b")],
        capture_output=True,
        env=env(home),
        timeout=120,
    )
    assert piped.returncode == 0, piped.stderr
    assert piped.stderr.startswith(b"wrote ") and piped.stderr.count(b"\n") == 1, piped.stderr


def drawn_on(console_file) -> list[tuple[int, int]]:
    return [(int(d), int(t)) for d, t in BAR.findall(console_file.getvalue().encode())]


def terminal_console():
    import io

    from rich.console import Console

    out = io.StringIO()
    return out, Console(file=out, force_terminal=True, force_interactive=True, width=100)


def test_the_conversion_bar_counts_bytes_in_binary_units():
    from specmlx.cli import progress

    out, console = terminal_console()
    bar = progress.conversion_bar(console)
    bar.add_task("quantizing", total=3 * 2**20, completed=3 * 2**19, tensors="")
    console.print(bar.make_tasks_table(bar.tasks))
    assert "1.5/3.0 MiB" in out.getvalue(), out.getvalue()


def test_a_prefill_of_one_chunk_still_running_after_a_while_is_drawn():
    import time

    from specmlx.cli import progress

    out, console = terminal_console()
    with progress.prefill(console, one_chunk_after_s=0.0) as on_prefill:
        on_prefill(0, 100)  # the pass over the one chunk begins; the timer's thread draws
        deadline = time.monotonic() + 60
        while not drawn_on(out) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert set(drawn_on(out)) == {(0, 100)}
        on_prefill(100, 100)
    assert drawn_on(out)[-1] == (100, 100)  # full, then erased


def test_a_prefill_of_one_chunk_that_ends_first_is_never_drawn():
    from specmlx.cli import progress

    out, console = terminal_console()
    with progress.prefill(console, one_chunk_after_s=3600.0) as on_prefill:
        on_prefill(0, 100)
        on_prefill(100, 100)
    assert out.getvalue() == ""
