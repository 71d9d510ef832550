"""Timing and statistics every benchmark here shares: medians, interleaved runs, steal,
the machine's line and writing what was found.

Not a benchmark itself (`python -m bench` does not list it). Nothing here imports mlx at
module level: server_overhead's client and cold_start's parent process stay light.

    median, geomean         of any iterable; median of nothing is None
    seconds, timed          perf_counter around a call: its seconds, or (result, seconds)
    eval_seconds            seconds of building and evaluating an MLX graph (mx.eval)
    median_seconds          median seconds of repeated calls, after warm-up calls
    orders, interleave      the order of variants in each repeat (reversed every other
                            repeat, or rotated by one), and the calls made in that order,
                            so that a busy minute on a shared machine lands on all alike
    interleaved_seconds     interleave + seconds: every variant's timings, per repeat
    steal_during            a call and the share of the CPUs' time the hypervisor took
    cpu_name                the CPU model, its CPU count and the ISA flags that matter here
    portable                a path as a committed result should hold it ($SPECMLX_HOME/…)
    write_atomic            a file written whole or not at all
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

# The instruction sets the native kernel picks between, as /proc/cpuinfo names them.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")


def median(values: Iterable[float]) -> float | None:
    """The median, or None where there are no values."""
    values = list(values)
    return statistics.median(values) if values else None


def geomean(values: Iterable[float]) -> float | None:
    """The geometric mean (of ratios), or None where there are no values."""
    values = list(values)
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else None


def seconds(fn: Callable[[], object]) -> float:
    """Wall seconds of one call (perf_counter)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """(the call's result, its wall seconds)."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def eval_seconds(build: Callable[[], object]) -> float:
    """Wall seconds of building the graph `build()` returns and evaluating it (mx.eval)."""
    import mlx.core as mx

    return seconds(lambda: mx.eval(build()))


def median_seconds(fn: Callable[[], object], repeat: int, warmup: int = 1) -> float:
    """Median wall seconds of `repeat` calls, after `warmup` untimed ones (first calls
    pay one-time work: kernels, allocations, page faults)."""
    for _ in range(warmup):
        fn()
    return statistics.median(seconds(fn) for _ in range(repeat))


def orders(names: Iterable[T], repeat: int, how: str = "reverse") -> Iterable[tuple[int, list[T]]]:
    """(repeat index, the variants' order in it) for each repeat: "reverse" runs them
    as given, then reversed, in turn (AB, BA, ...); "rotate" moves the first to the end
    each repeat (ABC, BCA, CAB, ...). Either way no variant always runs first or last."""
    names = list(names)
    if how not in ("reverse", "rotate"):
        raise ValueError(f"how must be 'reverse' or 'rotate', got {how!r}")
    for r in range(repeat):
        if how == "reverse":
            yield r, names if r % 2 == 0 else names[::-1]
        else:
            shift = r % len(names) if names else 0
            yield r, names[shift:] + names[:shift]


def interleave(
    runs: dict[str, Callable[[int], T]], repeat: int, how: str = "reverse"
) -> dict[str, list[T]]:
    """Call every variant once per repeat, in the order `orders` gives (each with the
    repeat's index), and collect each one's results in repeat order."""
    out: dict[str, list[T]] = {name: [] for name in runs}
    for r, order in orders(runs, repeat, how):
        for name in order:
            out[name].append(runs[name](r))
    return out


def interleaved_seconds(
    fns: dict[str, Callable[[], object]], repeat: int, how: str = "reverse", warmup: int = 1
) -> dict[str, list[float]]:
    """Wall seconds of every variant, interleaved repeat by repeat, after `warmup`
    untimed calls of each."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    return interleave({name: (lambda r, f=fn: seconds(f)) for name, fn in fns.items()}, repeat, how)


def steal_during(fn: Callable[[], T]) -> tuple[T, float | None]:
    """(the call's result, the share of all CPUs' time the hypervisor stole meanwhile;
    None where /proc/stat is missing). specmlx bench retimes a block above 2%."""
    from specmlx.bench.machine import cpu_times, steal_share

    before = cpu_times()
    result = fn()
    return result, steal_share(before, cpu_times())


def cpu_name() -> str:
    """'MODEL (N CPUs; isa flags)': what a figure cannot be read without."""
    name, flags = "", []
    info = Path("/proc/cpuinfo")
    for line in info.read_text().splitlines() if info.exists() else []:
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not name:
            name = value.strip()
        elif key == "flags" and not flags:
            flags = value.split()
    name = name or platform.processor() or platform.machine()
    isa = " ".join(f for f in ISA_FLAGS if f in flags)
    return f"{name} ({os.cpu_count()} CPUs{'; ' + isa if isa else ''})"


def portable(path: str | os.PathLike) -> str:
    """`path` as a committed result should hold it: under $SPECMLX_HOME as
    `$SPECMLX_HOME/…`, under the working directory relative to it, under the user's home
    as `~/…`; anything else as given."""
    from specmlx.paths import home

    text = str(path)
    absolute = os.path.abspath(os.path.expanduser(text))
    for root, shown in ((str(home()), "$SPECMLX_HOME"), (os.getcwd(), "."), ("~", "~")):
        root = os.path.expanduser(root)
        if absolute == root:
            return shown
        if absolute.startswith(root.rstrip(os.sep) + os.sep):
            rest = absolute[len(root.rstrip(os.sep)) + 1 :]
            return rest if shown == "." else f"{shown}/{rest}"
    return text


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` whole: to a sibling first, then renamed over it, so that a
    crash or an interrupt never leaves half a result."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)
