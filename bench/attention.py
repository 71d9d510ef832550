"""Microbenchmark: specmlx's native attention vs mx.fast.scaled_dot_product_attention on
the CPU, at the decode (Lq = 1) and verify (Lq = 4, 8, causal) shapes of the project's two
Qwen2.5 models, or (--windows) of Gemma 3 270M's sliding-window layers.

    python bench/attention.py                        # the table, printed
    python bench/attention.py --out bench/results/attention.md
    python bench/attention.py --windows --out bench/results/attention_windows.md

A cell is one model's worth of layers: every layer's attention over its own KV cache
(so a layer's K and V are not still in cache from the layer before, as in a real pass),
each cache a `[..., :L, :]` view of a buffer 256 positions longer, as mlx-lm's KVCache
passes them. All the layers are one `mx.eval`, MLX's per-op dispatch included. The two
implementations alternate within every repeat, so that load from other processes hits
both alike; the figures are medians.

--windows: each layer's cache is mlx-lm's RotatingKVCache of the model's window, filled
to L positions by a prompt chunk and 7 decode steps (so a wrapped ring's newest key sits
mid-buffer), then one more update of Lq tokens; both sides get what that update handed
attention (the ring rotated and no mask for one token, time order and the window mask
for several), through specmlx's patched function and mlx-lm's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

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


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return f"{fields.get('Model name', '?').strip()}, {os.cpu_count()} CPUs"


def timed(fn: Callable[[], list[mx.array]]) -> float:
    start = time.perf_counter()
    mx.eval(fn())
    return (time.perf_counter() - start) * 1e3


def alternate(
    mlx_layers: Callable[[], list[mx.array]], native_layers: Callable[[], list[mx.array]], reps: int
) -> tuple[float, float, float]:
    """(MLX ms, native ms, worst relative difference), the two alternating per repeat."""
    want, got = mlx_layers(), native_layers()
    diff = max(
        (mx.abs(a - b).max() / mx.abs(a).max()).item() for a, b in zip(want, got, strict=True)
    )
    timed(mlx_layers), timed(native_layers)  # warm-up
    theirs, ours = [], []
    for rep in range(reps):
        if rep % 2:
            ours.append(timed(native_layers))
            theirs.append(timed(mlx_layers))
        else:
            theirs.append(timed(mlx_layers))
            ours.append(timed(native_layers))
    return statistics.median(theirs), statistics.median(ours), diff


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

    def mlx_layers() -> list[mx.array]:
        return [
            mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
            for q, (k, v) in zip(qs, caches, strict=True)
        ]

    def native_layers() -> list[mx.array]:
        return [
            native._ext.scaled_dot_product_attention(q, k, v, scale, rows > 1)
            for q, (k, v) in zip(qs, caches, strict=True)
        ]

    return alternate(mlx_layers, native_layers, reps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", help="also write the table to this markdown file")
    parser.add_argument(
        "--windows", action="store_true", help="Gemma 3 270M's sliding-window layers instead"
    )
    args = parser.parse_args()
    if not native.available() or not hasattr(native._ext, "scaled_dot_product_attention"):
        print(f"native attention unavailable: {native.reason() or 'build without it'}")
        return 1
    load = os.getloadavg()[0]
    lines = [
        f"cpu: {cpu_name()}; kernel: {native._ext.isa()}, {native.threads()} threads; "
        f"load average {load:.1f} at the start",
        "",
        "| model | L | Lq | mask | mx.fast ms | native ms | speedup | max rel diff |",
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
        tmp = f"{args.out}.tmp"
        with open(tmp, "w") as f:
            f.write(" ".join(["python", *sys.argv]) + "\n\n" + "\n".join(lines) + "\n")
        os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
