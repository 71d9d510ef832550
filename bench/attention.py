"""specmlx's native attention against MLX's on the CPU, at decode and verify shapes.

The decode (Lq = 1) and verify (Lq = 4, 8, causal) shapes of the project's two Qwen2.5
models, or (--windows) of Gemma 3 270M's sliding-window layers.

    python -m bench attention                        # the table, printed
    python -m bench attention --out bench/results/attention.md
    python -m bench attention --windows --out bench/results/attention_windows.md

A cell is one model's worth of layers: every layer's attention over its own KV cache
(so a layer's K and V are not still in cache from the layer before, as in a real pass),
each cache a `[..., :L, :]` view of a buffer 256 positions longer, as mlx-lm's KVCache
passes them. Both sides are the functions a model calls: mlx-lm's
`scaled_dot_product_attention` (mx.fast's op) and specmlx.cpu.attention's, which runs the
native op where it applies (each asserted to). All the layers are one `mx.eval`, MLX's
per-op dispatch included. The two implementations alternate within every repeat, so that
load from other processes hits both alike; the figures are medians.

--windows: each layer's cache is mlx-lm's RotatingKVCache of the model's window, filled
to L positions by a prompt chunk and 7 decode steps (so a wrapped ring's newest key sits
mid-buffer), then one more update of Lq tokens; both sides get what that update handed
attention (the ring rotated and no mask for one token, time order and the window mask
for several), through specmlx's patched function and mlx-lm's.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

from bench.timing import cpu_name, interleaved_seconds, median, write_atomic
from specmlx.cpu import attention, native

# name: (layers, query heads, KV heads, head size)
MODELS = {
    "Qwen2.5-1.5B": (28, 12, 2, 128),
    "Qwen2.5-0.5B": (24, 14, 2, 64),
}
# name: (sliding-window layers, query heads, KV heads, head size, window)
WINDOW_MODELS = {"Gemma3-270M": (15, 4, 1, 256, 512)}
LENGTHS = (64, 256, 1024, 2048)
WINDOW_LENGTHS = (256, 1024, 4096)  # before the window fills, and after it wrapped
QUERY_ROWS = (1, 4, 8)
SPARE = 256  # buffer positions past L: the cache grows in steps of 256


def alternate(
    mlx_layers: Callable[[], list[mx.array]], native_layers: Callable[[], list[mx.array]], reps: int
) -> tuple[float, float, float]:
    """(MLX ms, native ms, worst relative difference), the two alternating per repeat."""
    want, got = mlx_layers(), native_layers()
    diff = max(
        (mx.abs(a - b).max() / mx.abs(a).max()).item() for a, b in zip(want, got, strict=True)
    )
    evaluated = {"mlx": mlx_layers, "native": native_layers}
    evaluated = {name: (lambda f=f: mx.eval(f())) for name, f in evaluated.items()}
    ms = interleaved_seconds(evaluated, reps)  # one warm-up call each first
    return median(ms["mlx"]) * 1e3, median(ms["native"]) * 1e3, diff


def window_cell(model: str, length: int, rows: int, reps: int) -> tuple[float, float, float]:
    """(mlx-lm ms, native ms, worst relative difference) for one model's window layers."""
    layers, hq, hkv, d, window = WINDOW_MODELS[model]
    mx.random.seed(length * 16 + rows)
    calls = []
    for _ in range(layers):
        cache = RotatingKVCache(max_size=window)
        for n in [length - 7] + [1] * 7 + [rows]:
            mask = cache.make_mask(n, window_size=window)
            kv = cache.update_and_fetch(
                mx.random.normal((1, hkv, n, d)), mx.random.normal((1, hkv, n, d))
            )
            mx.eval(kv)
        calls.append((mx.random.normal((1, hq, rows, d)), *kv, cache, mask))
    mx.eval([c[0] for c in calls])
    scale = d**-0.5

    def run(fn: Callable) -> Callable[[], list[mx.array]]:
        return lambda: [fn(q, k, v, cache=c, scale=scale, mask=m) for q, k, v, c, m in calls]

    assert all(attention.supports(q, k, v, c, m) for q, k, v, c, m in calls)
    return alternate(
        run(attention.mlx_attention), run(attention.scaled_dot_product_attention), reps
    )


def cell(model: str, length: int, rows: int, reps: int) -> tuple[float, float, float]:
    """(MLX ms, native ms, worst relative difference) for one model's layers."""
    layers, hq, hkv, d = MODELS[model]
    mx.random.seed(length * 16 + rows)
    qs = [mx.random.normal((1, hq, rows, d)) for _ in range(layers)]
    buffers = [
        (
            mx.random.normal((1, hkv, length + SPARE, d)),
            mx.random.normal((1, hkv, length + SPARE, d)),
        )
        for _ in range(layers)
    ]
    mx.eval(qs, buffers)
    caches = [(k[..., :length, :], v[..., :length, :]) for k, v in buffers]
    mask = "causal" if rows > 1 else None
    scale = d**-0.5
    assert all(
        attention.supports(q, k, v, None, mask) for q, (k, v) in zip(qs, caches, strict=True)
    )

    def run(fn: Callable) -> Callable[[], list[mx.array]]:
        return lambda: [
            fn(q, k, v, cache=None, scale=scale, mask=mask)
            for q, (k, v) in zip(qs, caches, strict=True)
        ]

    return alternate(
        run(attention.mlx_attention), run(attention.scaled_dot_product_attention), reps
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", help="also write the table to this markdown file")
    parser.add_argument(
        "--windows", action="store_true", help="Gemma 3 270M's sliding-window layers instead"
    )
    args = parser.parse_args(argv)
    if not attention.available():
        print(f"native attention unavailable: {native.reason() or 'build without it'}")
        return 1
    attention.set_mode("native")  # whatever SPECMLX_ATTENTION says: the native side is timed
    load = os.getloadavg()[0]
    lines = [
        f"cpu: {cpu_name()}; kernel: {native.describe()}; load average {load:.1f} at the start",
        "",
        "| model | L | Lq | mask | mlx ms | native ms | speedup | max rel diff |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    models, lengths, measure = MODELS, LENGTHS, cell
    if args.windows:
        models, lengths, measure = WINDOW_MODELS, WINDOW_LENGTHS, window_cell
    for model in models:
        for length in lengths:
            for rows in QUERY_ROWS:
                theirs, ours, diff = measure(model, length, rows, args.reps)
                if args.windows:
                    window = models[model][4]  # mlx-lm's mask: "causal" until it binds
                    mask = "none" if rows == 1 else "causal"
                    mask = f"window {window}" if rows > 1 and length + rows > window else mask
                    kind = "window layers"
                else:
                    mask, kind = "causal" if rows > 1 else "none", "layers"
                line = (
                    f"| {model} ({models[model][0]} {kind}) | {length} | {rows} | {mask} | "
                    f"{theirs:.2f} | {ours:.2f} | {theirs / ours:.1f}x | {diff:.1e} |"
                )
                lines.append(line)
                print(line, flush=True)
    lines += ["", f"load average {os.getloadavg()[0]:.1f} at the end"]
    print(lines[-1])
    if args.out:
        write_atomic(args.out, " ".join(sys.argv) + "\n\n" + "\n".join(lines) + "\n")
    return 0
