"""Microbenchmark: an 8-bit output head on the native kernel vs the same head in float32.

    SPECMLX_THREADS=1 python bench/head_matmul.py
    python bench/head_matmul.py --activations [--out FILE]   # the kernel's float32 vs int8 x

Qwen2.5-Coder's heads (151936 rows; 896 columns for 0.5B, 1536 for 1.5B), 8-bit g64 as
specmlx quantizes them, against the float32 matrix that `--cpu-weights fp32` would make
of them, on the fast BLAS when one is found. Rows M = 1, 2, 5, 8: a draft step and
verify passes. Median of 7 evaluated calls each. This is why the fp32 mode leaves 8-bit
layers packed.

--activations times the kernel's two modes (native.set_activations) on the heads specmlx
runs: the 1.5B's 151936x1536 and the 0.5B draft's sub-vocabulary head (65536 rows of its
896-wide tied embedding), 8-bit g64 with fp16 scales and biases as a checkpoint stores
them, at M = 1, 2, 4, 8 (--rows chooses others). Several copies of each head are cycled so
that every call reads its weights from DRAM, as in a model's step; the modes alternate
within every repeat.
GB/s is the bytes one call reads (codes, scales, biases) over its median time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import native_matmul  # first: it activates the fast BLAS before mlx is loaded

median_ms = native_matmul.median_ms

import mlx.core as mx  # noqa: E402

from specmlx.cpu import blas, native, ops  # noqa: E402

ACTIVATION_HEADS = {  # name: (rows, columns, copies cycled: well over the 32 MiB L3)
    "1.5B head 151936x1536": (151936, 1536, 2),
    "0.5B sub-vocab head 65536x896": (65536, 896, 4),
}
ACTIVATION_ROWS = (1, 2, 4, 8)
MODES = ("float32", "int8")


def fp16_head(rows: int, cols: int, copies: int) -> list[tuple[mx.array, ...]]:
    """`copies` distinct buffers of one random 8-bit g64 head, scales and biases in fp16."""
    mx.random.seed(0)
    w, scales, biases = mx.quantize(mx.random.normal((rows, cols)) * 0.02, group_size=64, bits=8)
    heads = [
        (w + 0, scales.astype(mx.float16) + 0, biases.astype(mx.float16) + 0)  # own buffers
        for _ in range(copies)
    ]
    mx.eval(heads)
    return heads


def cycled_ms(x: mx.array, heads: list[tuple[mx.array, ...]], reps: int) -> dict[str, float]:
    """Median ms of one call per mode, the modes alternating in every repeat, each repeat a
    pass over all copies (so a call never finds its weights in cache)."""
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for rep in range(reps + 1):  # the first pass warms up: allocation, page faults
        for mode in MODES:
            native.set_activations(mode)
            for w, s, b in heads:
                t0 = time.perf_counter()
                mx.eval(ops.quantized_matmul(x, w, s, b, 64, 8))
                if rep:
                    times[mode].append(time.perf_counter() - t0)
    return {mode: statistics.median(t) * 1e3 for mode, t in times.items()}


def compare_activations(args) -> None:
    before = native.activations()
    lines = [
        f"command: python {' '.join(sys.argv)}",
        f"cpu: {native_matmul.cpu_name()}, {os.cpu_count()} logical CPUs; kernel: "
        f"{native.describe()}; int8 tiles: {native.q8_kernel()}",
        f"mlx {mx.__version__}; 8-bit g64, fp16 scales and biases; ms per call, median of "
        f"{args.reps} passes over the copies, the modes interleaved",
        "",
        "| head | M | float32 x ms | int8 x ms | int8 speedup | GB/s float32 x | GB/s int8 x |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    try:
        for name, (rows, cols, copies) in ACTIVATION_HEADS.items():
            heads = fp16_head(rows, cols, copies)
            gb = sum(a.nbytes for a in heads[0]) / 1e9
            for m in args.rows:
                x = mx.random.normal((m, cols))
                mx.eval(x)
                ms = cycled_ms(x, heads, args.reps)
                f, q = ms["float32"], ms["int8"]
                row = (
                    f"| {name} | {m} | {f:.2f} | {q:.2f} | {f / q:.2f}x | "
                    f"{gb / f * 1e3:.1f} | {gb / q * 1e3:.1f} |"
                )
                lines.append(row)
                print(row, flush=True)
            del heads
    finally:
        native.set_activations(before)
    if args.out:
        native_matmul.write(args.out, lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--activations", action="store_true", help="float32 vs int8 x")
    parser.add_argument("--reps", type=int, default=7, help="with --activations: timed passes")
    parser.add_argument("--out", help="with --activations: also write the table here")
    parser.add_argument("--isa", help="with --activations: force avx512, avx2 or scalar")
    parser.add_argument(
        "--rows", type=int, nargs="+", default=ACTIVATION_ROWS, help="with --activations: M"
    )
    args = parser.parse_args()
    if args.activations:
        if not native.available():
            sys.exit(f"native kernel unavailable: {native.reason()}")
        native.set_threads(int(os.environ.get("SPECMLX_THREADS", "2")))
        if args.isa:
            native.set_isa(args.isa)
        compare_activations(args)
        return
    threads = int(os.environ.get("SPECMLX_THREADS", "1"))
    if native.available():
        native.set_threads(threads)
    print(f"BLAS: {blas.describe()} · native: {native.describe()}")
    print("| head | M | float32 (BLAS) ms | 8-bit native ms | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for name, cols in (("0.5B 151936x896", 896), ("1.5B 151936x1536", 1536)):
        w = mx.random.normal((151936, cols)) * 0.02
        q, scales, biases = mx.quantize(w, group_size=64, bits=8)
        mx.eval(w, q, scales, biases)
        for m in (1, 2, 5, 8):
            x = mx.random.normal((m, cols))
            mx.eval(x)
            dense = median_ms(lambda: x @ w.T, 7)  # noqa: B023
            packed = median_ms(lambda: ops.quantized_matmul(x, q, scales, biases, 64, 8), 7)  # noqa: B023
            print(f"| {name} | {m} | {dense:.1f} | {packed:.1f} | {dense / packed:.1f}x |")


if __name__ == "__main__":
    main()
