"""Microbenchmark: specmlx's native INT4 CPU matmul vs mx.quantized_matmul.

    python bench/native_matmul.py                       # full table (a few minutes)
    python bench/native_matmul.py --quick               # 4096x4096 only
    python bench/native_matmul.py --out bench/results/native_matmul.md

Shapes: a 4096x4096 layer and Qwen2.5-1.5B's linear layers (hidden 1536, intermediate
8960, vocab 151936), INT4 g64 with float32 activations and scales (what specmlx.load uses
on the CPU). Rows M = 1, 2, 4, 8 (decode and verify) and 32 (a prefill chunk). Each cell
is the median of several runs of one evaluated call, so MLX's per-call overhead is
included, as it is in a model. Two alternatives are timed too: a float32 matmul on weights
dequantized beforehand (the `--cpu-weights fp32` path; it uses OpenBLAS when
specmlx.cpu.blas finds one, and 8x the memory), and for M = 32 dequantize + matmul per call
(what large M would cost without the kernel).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

from specmlx.cpu import blas

blas.activate()  # before mlx is imported, so MLX's sgemm is OpenBLAS when there is one

import mlx.core as mx  # noqa: E402

from specmlx.cpu import native  # noqa: E402

SHAPES = {  # name: (N output features, K input features)
    "4096x4096": (4096, 4096),
    "qwen1.5b q/o 1536x1536": (1536, 1536),
    "qwen1.5b k/v 256x1536": (256, 1536),
    "qwen1.5b gate/up 8960x1536": (8960, 1536),
    "qwen1.5b down 1536x8960": (1536, 8960),
    "qwen1.5b head 151936x1536": (151936, 1536),
}
ROWS = (1, 2, 4, 8, 32)
GROUP_SIZE = 64


def median_ms(fn: Callable[[], mx.array], reps: int) -> float:
    mx.eval(fn())  # warm-up: first-call allocation and page faults
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure(m: int, w, scales, biases, thread_counts: list[int], args) -> str:
    """The table cells after the row count, for x with m rows against one layer."""
    n, k = w.shape[0], w.shape[1] * 8
    x = mx.random.normal((m, k))
    mx.eval(x)

    def mlx_qmm() -> mx.array:
        return mx.quantized_matmul(
            x, w, scales, biases, transpose=True, group_size=GROUP_SIZE, bits=4
        )

    def ours() -> mx.array:
        return native.quantized_matmul(x, w, scales, biases, GROUP_SIZE)

    def dequant_matmul() -> mx.array:
        return x @ mx.dequantize(w, scales, biases, group_size=GROUP_SIZE, bits=4).T

    def dense() -> mx.array:
        return x @ w_fp32.T

    ref = median_ms(mlx_qmm, args.mlx_reps)
    times = []
    for t in thread_counts:
        native.set_threads(t)
        times.append(median_ms(ours, args.reps))
    dense_cell = dequant_cell = "-"
    if n * k <= 4096 * 4096:  # the 151936-row head would need 0.9 GB as float32
        w_fp32 = mx.dequantize(w, scales, biases, group_size=GROUP_SIZE, bits=4)
        mx.eval(w_fp32)
        dense_cell = f"{median_ms(dense, args.reps):.3f}"
        del w_fp32
        if m >= 32:
            dequant_cell = f"{median_ms(dequant_matmul, args.mlx_reps):.2f}"
    native_cells = " | ".join(f"{t:.3f}" for t in times)
    return f"{ref:.2f} | {native_cells} | {ref / min(times):.1f}x | {dense_cell} | {dequant_cell} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="only the 4096x4096 layer")
    parser.add_argument("--reps", type=int, default=9, help="timed runs of the native kernel")
    parser.add_argument("--mlx-reps", type=int, default=3, help="timed runs of mlx (slow)")
    parser.add_argument("--out", help="also write the table (markdown) to this file")
    args = parser.parse_args()
    if not native.available():
        sys.exit(f"native kernel unavailable: {native.reason()}")

    pool = native.threads()
    thread_counts = sorted({1, min(2, pool)} | ({pool} if pool <= 4 else set()))
    lines = [
        f"command: python {' '.join(sys.argv)}",
        f"cpu: {cpu_name()}, {os.cpu_count()} logical CPUs; kernel: {native.describe()}",
        f"fp32 matmul BLAS: {blas.active_library() or 'MLX bundled (reference BLAS)'}",
        f"mlx {mx.__version__}; INT4 g{GROUP_SIZE}, float32 x and scales; "
        f"median of {args.reps} (native) / {args.mlx_reps} (mlx) runs, ms per call",
        "note: taken on a shared, noisy machine; compare ratios within a row, not across runs",
        "",
        "| layer (N x K) | M | mx.quantized_matmul | "
        + " | ".join(f"native {t} thr" for t in thread_counts)
        + " | speedup (best) | fp32 matmul | dequant+matmul |",
        "|---|---:|---:|" + "---:|" * len(thread_counts) + "---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    shapes = {"4096x4096": SHAPES["4096x4096"]} if args.quick else SHAPES
    try:
        for name, (n, k) in shapes.items():
            mx.random.seed(0)
            w, scales, biases = mx.quantize(mx.random.normal((n, k)), group_size=GROUP_SIZE)
            mx.eval(w, scales, biases)
            for m in ROWS:
                row = f"| {name} | {m} | " + measure(m, w, scales, biases, thread_counts, args)
                lines.append(row)
                print(row, flush=True)
    finally:
        native.set_threads(pool)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
