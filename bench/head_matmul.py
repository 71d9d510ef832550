"""Microbenchmark: an 8-bit output head on the native kernel vs the same head in float32.

    SPECMLX_THREADS=1 python bench/head_matmul.py

Qwen2.5-Coder's heads (151936 rows; 896 columns for 0.5B, 1536 for 1.5B), 8-bit g64 as
specmlx quantizes them, against the float32 matrix that `--cpu-weights fp32` would make
of them, on the fast BLAS when one is found. Rows M = 1, 2, 5, 8: a draft step and
verify passes. Median of 7 evaluated calls each. This is why the fp32 mode leaves 8-bit
layers packed.
"""

from __future__ import annotations

import os

import native_matmul  # first: it activates the fast BLAS before mlx is loaded

median_ms = native_matmul.median_ms

import mlx.core as mx  # noqa: E402

from specmlx.cpu import blas, native  # noqa: E402


def main() -> None:
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
            packed = median_ms(lambda: native.quantized_matmul(x, q, scales, biases, 64, 8), 7)  # noqa: B023
            print(f"| {name} | {m} | {dense:.1f} | {packed:.1f} | {dense / packed:.1f}x |")


if __name__ == "__main__":
    main()
