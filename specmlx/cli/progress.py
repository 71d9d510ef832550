"""Progress on stderr for the waits a user would otherwise sit through in silence: a long
prefill (generate, chat) and the first use's GGUF → INT4 conversion.

A bar is drawn only where stderr is an interactive terminal (rich's `is_interactive`:
a tty, and TERM not dumb), and erased once done: the line that follows says what it
took. Piped stderr gets nothing from here, so logs hold no control characters.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def conversion_bar(console: Console) -> Progress:
    """What `specmlx quantize` shows while it converts (and the first use, building the
    offline pair): bytes of source tensors done, tensors done, time left."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        DownloadColumn(binary_units=True),  # MiB, GiB: as every size specmlx prints
        TextColumn("{task.fields[tensors]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )


@contextmanager
def conversion(
    console: Console, label: str = "quantizing", show: bool = True
) -> Iterator[Callable | None]:
    """An `on_progress` for specmlx.convert.quantize that draws `conversion_bar` on a
    terminal, started on the first tensor (so that input errors print one clean line)
    and erased after the last one, so that what follows (the report; on a first use, the
    next model's download) prints on a clear line; None where nothing would be drawn
    (not `show`, no terminal). One callback serves several conversions in turn."""
    if not show or not console.is_interactive:
        yield None
        return
    bar = conversion_bar(console)
    task = None

    def on_progress(p) -> None:
        nonlocal task
        if task is None:
            bar.start()
            task = bar.add_task(label, total=p.bytes_total, tensors="")
        tensors = f"{p.tensors_done}/{p.tensors_total} tensors"
        bar.update(task, total=p.bytes_total, completed=p.bytes_done, tensors=tensors)
        if p.tensors_done == p.tensors_total:
            bar.stop()
            bar.remove_task(task)
            task = None

    try:
        yield on_progress
    finally:
        bar.stop()  # nothing to erase where it never started


# A prefill of one chunk reports nothing in between: its bar is drawn only if the pass
# is still running this long after it began (one forward pass of a 1.5B model over a
# chunk takes seconds on a CPU, of a tiny one milliseconds: no flash of a bar for those).
ONE_CHUNK_AFTER_S = 1.0


@contextmanager
def prefill(
    console: Console | None, show: bool = True, one_chunk_after_s: float = ONE_CHUNK_AFTER_S
) -> Iterator[Callable[[int, int], None] | None]:
    """An `on_prefill` for specmlx.generate: a bar of prompt tokens taken, on `console`
    where it is a terminal; None where nothing would be drawn (no console, not `show`,
    not a terminal).

    A prefill of several chunks (caches.PREFILL_STEP tokens each) is drawn at once and
    advances chunk by chunk; one of a single chunk, only once it has run for
    `one_chunk_after_s` (a timer thread draws it: the engine calls back between chunks
    only), where it shows the time elapsed. The bar is erased when the last chunk is in
    (before the reply streams on stdout, which may be the same terminal) or when the call
    is left early (Ctrl-C, an error).
    """
    if console is None or not show or not console.is_interactive:
        yield None
        return
    from ..caches import PREFILL_STEP

    bar = Progress(
        TextColumn("prefill"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("prompt tokens"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )
    lock = threading.Lock()  # the timer's thread and the engine's both draw
    # The task is added when the prefill begins, so that its elapsed time counts from
    # there; the bar is shown (started) on its first draw.
    state = {"task": None, "shown": False, "timer": None, "over": False}

    def draw(done: int) -> None:
        if state["over"]:
            return
        if not state["shown"]:
            bar.start()
            state["shown"] = True
        bar.update(state["task"], completed=done, refresh=True)  # now, not at the next tick

    def late() -> None:
        with lock:
            draw(0)

    def on_prefill(done: int, total: int) -> None:
        with lock:
            if state["task"] is None:
                state["task"] = bar.add_task("prefill", total=total)
            if done >= total:
                if state["shown"]:
                    draw(done)  # the full bar, then erased
                end()
            elif done == 0 and total <= PREFILL_STEP:
                state["timer"] = threading.Timer(one_chunk_after_s, late)
                state["timer"].daemon = True
                state["timer"].start()
            else:
                draw(done)

    def end() -> None:
        state["over"] = True
        if state["timer"] is not None:
            state["timer"].cancel()
        if state["shown"]:
            bar.stop()

    try:
        yield on_prefill
    finally:
        with lock:
            end()
