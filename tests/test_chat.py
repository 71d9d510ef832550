"""`specmlx chat` driven as a user drives it: through a pipe, and at a terminal (a pty)."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

STATS = re.compile(
    r"(\d+) tokens? · [\d.]+ tok/s · TTFT [\d.]+ s · prefill (\d+) new of (\d+) prompt tokens?(.*)"
)


def env(tmp_path) -> dict:
    return {**os.environ, "SPECMLX_HOME": str(tmp_path), "TERM": "xterm-256color"}


def turns(stderr: str) -> list[dict]:
    """The stats line of each reply: tokens, prefill (processed), prompt tokens, the rest."""
    return [
        {"tokens": int(m[1]), "prefill": int(m[2]), "prompt": int(m[3]), "rest": m[4]}
        for m in STATS.finditer(stderr)
    ]


def test_piped_conversation_and_slash_commands(model_dirs, tmp_path):
    script = [
        "hello there",
        "how are you",  # turn 2: only its own tokens are prefilled
        "/stats",
        "/set",
        "/set temperature 0.5",
        "/set top_p 0.9",
        "/set top_k 5",
        "/set gamma 2",
        "/set max_tokens 4",
        "/set system be terse",
        "/set top_p 3",  # refused, and the settings stay valid
        "/draft off",
        '"""',  # turn 3: multi-line, no draft
        "line one",
        'line two"""',
        "/draft on",
        "~" * 3000,  # more tokens than the model's 2048 context: refused, not a crash
        "/help",
        "/reset",
        "after the reset",  # turn 4: everything is prefilled again
        "/bogus",
        "/exit",
        "never read",
    ]
    run = subprocess.run(
        [sys.executable, "-m", "specmlx", "chat", "--model", str(model_dirs["target"])]
        + ["--draft", str(model_dirs["perturbed"]), "--max-tokens", "6"],
        input="\n".join(script) + "\n",
        capture_output=True,
        text=True,
        env=env(tmp_path),
        timeout=120,
    )
    err = run.stderr
    assert run.returncode == 0, err
    assert "ready in" in err and "peak memory" in err and "target" in err and "draft" in err
    first, second, third, fourth = turns(err)  # exactly four replies: /exit stopped the rest

    # The second prompt holds the first prompt and reply; only what follows is prefilled.
    new_tokens = second["prompt"] - first["prompt"] - first["tokens"]
    assert 0 < second["prefill"] <= new_tokens + 1 < second["prompt"]
    assert "replies" in err and "prefill" in err and "context" in err  # /stats
    assert "temperature=0.0" in err and "top_p=1.0" in err  # /set with no argument
    assert "top-p must be in (0, 1]" in err
    assert "plain decoding (draft off)" in third["rest"] and third["tokens"] <= 4
    assert "context full" in err and "/reset" in err
    assert "/draft on|off" in err  # /help
    assert "conversation cleared" in err
    assert fourth["prefill"] == fourth["prompt"] - 1  # the caches were emptied by /reset
    assert "γ 2" in fourth["rest"] and fourth["tokens"] <= 4
    assert "unknown command /bogus" in err


class Terminal:
    """A child process on a pty, read until an expected string shows up."""

    def __init__(self, argv: list[str], environment: dict):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: become the program
            # Ctrl-C as a terminal delivers it, even where this run was started in the
            # background: a shell starts those with SIGINT ignored, and children inherit it.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execve(argv[0], argv, environment)
        self.seen = b""

    def send(self, data: str) -> None:
        os.write(self.fd, data.encode())

    def read_until(self, done, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            chunk = b""
            if ready:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:  # EIO: the child closed the terminal
                    pass
            if not chunk:
                raise AssertionError(
                    f"no {what} within {timeout} s ({self.state()}); got {self.seen[-1500:]!r}"
                )
            self.seen += chunk

    def state(self) -> str:
        """Whether the child still runs, for a failure's message (it is left unreaped)."""
        info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is None:
            return "the child still runs"
        how = "killed by signal" if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else "exited"
        return f"the child {how} {info.si_status}"

    def expect(self, text: str, timeout: float = 60) -> bytes:
        """Read until `text` appears; return everything before it and consume it."""
        want = text.encode()
        self.read_until(lambda: want in self.seen, repr(text), timeout)
        before, _, self.seen = self.seen.partition(want)
        return before

    def wait(self, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        os.kill(self.pid, 9)
        raise AssertionError("the chat did not exit")


def test_terminal_ctrl_c_stops_a_reply_and_the_session_goes_on(
    endless_target, model_dirs, tmp_path
):
    argv = [sys.executable, "-m", "specmlx", "chat", "--model", str(endless_target)]
    argv += ["--draft", str(model_dirs["perturbed"]), "--max-tokens", "100000"]
    term = Terminal(argv, env(tmp_path))
    try:
        term.expect("ready in")
        term.expect(">>> ")
        term.send("hello\r")
        term.expect("hello\r\n")  # the terminal's echo
        term.read_until(lambda: len(term.seen) > 64, "a streaming reply")
        term.send("\x03")
        term.expect("[interrupted]")
        term.expect("tokens · ")  # the stats line of the stopped reply
        term.expect(">>> ")

        term.send("/set max_tokens 3\r")
        term.expect("max_tokens = 3")
        term.send('"""\rfirst line\rsecond line"""\r')  # multi-line, on the same session
        assert re.search(rb"(?<!\d)3 tokens \xc2\xb7 [\d.]+$", term.expect(" tok/s"))
        term.expect(">>> ")

        # At the prompt: a hint, not an exit. A Ctrl-C that lands while readline is still
        # switching the terminal over can be dropped by the tty, so a person may press twice.
        for attempt in range(3):
            term.send("\x03")
            try:
                term.expect("Ctrl-D or /exit", timeout=10)
                break
            except AssertionError:
                if attempt == 2:
                    raise
        term.expect(">>> ")  # typed before readline is back, ^D would be lost in the switch
        term.send("\x04")  # Ctrl-D on an empty line quits
        assert term.wait() == 0
    finally:
        try:
            os.kill(term.pid, 9)
            os.waitpid(term.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(term.fd)


def test_chat_stop_quiet_and_verbose(model_dirs, tmp_path):
    base = [sys.executable, "-m", "specmlx", "chat", "--model", str(model_dirs["target"])]
    base += ["--draft", str(model_dirs["perturbed"]), "--max-tokens", "30", "-g", "2"]

    def chat(*flags: str) -> subprocess.CompletedProcess:
        run = subprocess.run(
            base + list(flags),
            input="hello there\n",
            capture_output=True,
            text=True,
            env=env(tmp_path),
            timeout=120,
        )
        assert run.returncode == 0, run.stderr
        return run

    reference = chat().stdout
    stop = reference[len(reference) // 2 :][:3]
    cut = chat("--stop", stop)
    assert cut.stdout == reference[: reference.find(stop)] + "\n"
    assert "stopped at --stop" in cut.stderr

    quiet = chat("--quiet")
    assert quiet.stdout == reference and "tokens ·" not in quiet.stderr
    assert "ready in" not in quiet.stderr
    verbose = chat("--verbose")
    assert re.search(r"^round 1: γ \d+ \(\w+\) · accepted \d+/\d+", verbose.stderr, re.M)
