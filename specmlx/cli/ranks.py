"""The CLI on several ranks (specmlx.distributed): rank 0 reads and prints, the others follow.

`start(shard)` is each command's first step: alone it only checks `--shard`; as one of
several ranks it silences this process's stdout and stderr unless it is rank 0 (their
errors still come out, each line tagged with the rank), and filters MLX's ring backend's
own lines about a lost socket out of stderr, so that a rank that dies leaves the others'
one line (`lost_line`) rather than a dozen.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import SpecmlxError

_state: dict[str, Any] = {"world": None, "silenced": False, "ending": False, "stderr": 2}


def start(shard: str = "auto") -> Any | None:
    """The world this command runs in (None alone), set up as above."""
    from .. import distributed

    if shard not in distributed.SHARDS:
        raise SpecmlxError(f"--shard must be one of {', '.join(distributed.SHARDS)}, got {shard!r}")
    world = distributed.group()
    if world is None:
        if shard != "auto":
            raise SpecmlxError(
                f"--shard {shard} splits the target over several ranks, and this process is "
                "alone: start it with mlx.launch (README: More than one machine)"
            )
        return None
    _state["world"] = world
    if not os.environ.get("MLX_RING_VERBOSE"):
        _filter_ring_lines()
    distributed.watch(_lost)
    if world.rank() != 0:
        sys.stdout.flush()
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115  (for the process's life)
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115
        _state["silenced"] = True
    return world


def world() -> Any | None:
    return _state["world"]


def say(line: str) -> None:
    """A line on stderr that every rank shows (the CLI's errors), tagged on ranks but 0.
    It is the process's last: the other ranks may end now without it being lost."""
    _state["ending"] = True
    if _state["silenced"]:
        print(f"rank {_state['world'].rank()}: {line}", file=sys.__stderr__, flush=True)
    else:
        print(line, file=sys.stderr, flush=True)


def shared_input(ask: Callable[[str], str], world: Any | None) -> Callable[[str], str]:
    """`ask` on rank 0 alone, each line (and its end: EOF, a Ctrl-C) sent to every rank, so
    that all of them run the same turns."""
    if world is None:
        return ask
    from ..distributed import broadcast_bytes, broadcast_ints

    def shared(prompt: str) -> str:
        kind, line = 0, None
        if world.rank() == 0:
            try:
                line = ask(prompt)
            except EOFError:
                kind = 1
            except KeyboardInterrupt:
                kind = 2
        kind = broadcast_ints([kind], world)[0]
        if kind == 1:
            raise EOFError
        if kind == 2:
            raise KeyboardInterrupt
        data = None if line is None else line.encode("utf-8", "surrogateescape")
        return broadcast_bytes(data, world).decode("utf-8", "surrogateescape")

    return shared


def release() -> None:
    """The ranks have agreed that they end (serve's shutdown, sent by rank 0): each may
    exit as it is, with no wait for the others at the end."""
    _state["ending"] = _state["released"] = True


def finish() -> None:
    """A command's end on every rank: none exits before all are done (a rank whose link
    closed early would take it for one that died)."""
    world = _state["world"]
    _state["ending"] = True
    if world is not None and not _state.get("released"):
        from ..distributed import broadcast_ints

        broadcast_ints([0], world)


def _lost(why: str) -> None:
    """The watchdog's word (specmlx.distributed.watch), from its thread: one line and out,
    whatever the main thread waits on. At a command's end, a rank that left first is no
    news: this one ends too, quietly, unless it does so itself first."""
    if _state["ending"]:
        time.sleep(2.0)
        os._exit(0)
    from ..distributed import lost_line

    world = _state["world"]
    tag = f"rank {world.rank()}: " if _state["silenced"] else ""
    line = f"{tag}error: {lost_line(why, world)}\n"
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os.write(_state["stderr"], line.encode())
    os._exit(1)


def lost_line(error: BaseException) -> str | None:
    """The one line for a collective that failed because another rank stopped, else None."""
    from .. import distributed

    if _state["world"] is None or not distributed.lost_peer(error):
        return None
    return f"error: {distributed.lost_line(str(error), _state['world'])}"


def _filter_ring_lines() -> None:
    """Route fd 2 through a thread that drops the ring backend's '[ring] ...' lines (a
    socket closed, too many errors): what a lost rank means, lost_line says once. Only
    where stderr is not a terminal (under mlx.launch it never is): a pipe in its place
    would turn a terminal's colours and progress bar off."""
    if sys.stderr.isatty():
        return
    sys.stderr.flush()
    read, write = os.pipe()
    real = os.dup(2)
    _state["stderr"] = real
    os.dup2(write, 2)
    os.close(write)

    def pump() -> None:
        with os.fdopen(read, "rb") as pipe:
            for line in pipe:
                if not line.startswith(b"[ring] "):
                    os.write(real, line)

    thread = threading.Thread(target=pump, name="ring-lines", daemon=True)
    thread.start()

    def restore() -> None:  # the pipe's last writer closed: the thread sends the rest
        for stream in (sys.stdout, sys.stderr, sys.__stderr__):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os.dup2(real, 2)
        thread.join(2.0)

    atexit.register(restore)
