"""The extension's ops on arrays, each with MLX's own op as its fallback: the quantized
matmul (and `supports`, which decides per call), a row softmax and a row argmax.

The matmul computes x @ dequantize(w)^T for 4-, 6- and 8-bit affine weights (8 or 6 bits:
the embeddings and output heads of specmlx-quantized checkpoints, 6 the heavier layers of
mlx-lm's mixed recipes). A call it does not handle (other bits or modes, a GPU stream, no
extension) runs `mx.quantized_matmul`; 6-bit weights run on the kernel under int8 x only.
"""

from __future__ import annotations

import mlx.core as mx

from . import native

GROUP_SIZES = (32, 64, 128)
BITS = (4, 6, 8)  # 6 bits on int8 activations only: the float32-x tiles read 4 and 8
FLOAT_TYPES = (mx.float32, mx.bfloat16, mx.float16)


def supports(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
    mode: str = "affine",
    transpose: bool = True,
) -> bool:
    """Whether this call can run on the native kernel."""
    return (
        native._ext is not None
        and bits in BITS
        and (bits != 6 or native.activations() == "int8")
        and mode == "affine"
        and transpose
        and group_size in GROUP_SIZES
        and biases is not None
        and mx.default_device() == mx.cpu
        and w.dtype == mx.uint32
        and w.ndim == 2
        and x.ndim >= 1
        and x.shape[-1] == w.shape[1] * 32 // bits
        and x.dtype in FLOAT_TYPES
        and scales.dtype in FLOAT_TYPES
        and biases.dtype == scales.dtype
    )


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None = None,
    group_size: int = 64,
    bits: int = 4,
    mode: str = "affine",
    packed: mx.array | None = None,
) -> mx.array:
    """x @ dequantize(w, scales, biases).T: the native kernel where it applies, else MLX's.
    `packed`: specmlx.cpu.packing's layout of the same matrix (see pack_layers there)."""
    if supports(x, w, scales, biases, group_size, bits, mode):
        return native._ext.quantized_matmul(x, w, scales, biases, group_size, bits, None, packed)
    return mx.quantized_matmul(
        x,
        w,
        scales=scales,
        biases=biases,
        transpose=True,
        group_size=group_size,
        bits=bits,
        mode=mode,
    )


def softmax(x: mx.array) -> mx.array:
    """Softmax over the last axis: the native kernel for float32 on a CPU stream (MLX's CPU
    exp is scalar on x86), else MLX's."""
    kernel = native.op("softmax")
    if kernel is not None and x.dtype == mx.float32 and mx.default_device() == mx.cpu:
        return kernel(x)
    return mx.softmax(x, axis=-1)


def argmax(x: mx.array, n: int | None = None) -> mx.array:
    """uint32 index of the largest of each row's first `n` entries (all by default), the
    first of equals: the native kernel for float32 on a CPU stream (MLX's CPU argmax is a
    scalar loop), else mx.argmax, with the same result."""
    n = x.shape[-1] if n is None else min(n, x.shape[-1])
    kernel = native.op("argmax")
    if kernel is not None and x.dtype == mx.float32 and mx.default_device() == mx.cpu:
        return kernel(x, n)
    return mx.argmax(x[..., :n], axis=-1).astype(mx.uint32)
