"""MLX's own RMSNorm and RoPE layers as single native ops on the CPU.

On the CPU `mx.fast.rms_norm` and `mx.fast.rope` run as their decompositions: an RMSNorm
~5 MLX ops, a RoPE ~15 (positions, frequencies, cos, sin, slices, products,
concatenations), each dispatched on its own at a cost that does not shrink with its size.
In a 28-layer model's decode step that was ~1100 of ~2100 graph nodes. The native ops
(specmlx/cpu/_native: rope.cpp, rms_norm.cpp) compute the same formulas, each row from its
own values and position alone, so a row's bits do not depend on the rows evaluated with
it: a verify pass's rows equal the one-token steps'. They serve every pass, prefill
included, so the whole model runs one arithmetic.

Only `nn.RMSNorm` and `nn.RoPE` themselves are swapped (an architecture's own norm or a
scaled RoPE keeps its code, compiled by specmlx.compiled), and a call they do not cover
(a GPU stream, a non-float32 input, per-sequence offsets) runs MLX's own.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import native


class NativeRMSNorm(nn.RMSNorm):
    def __call__(self, x: mx.array) -> mx.array:
        op = native.op("rms_norm")
        weight = self["weight"]
        if (
            op is not None
            and mx.default_device() == mx.cpu
            and x.dtype == mx.float32
            and weight.dtype == mx.float32
            and x.ndim >= 1
        ):
            return op(x, weight, self.eps)
        return super().__call__(x)


class NativeRoPE(nn.RoPE):
    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        op = native.op("rope")
        if (
            op is not None
            and mx.default_device() == mx.cpu
            and x.dtype == mx.float32
            and x.ndim == 4
            and (not isinstance(offset, mx.array) or offset.size == 1)
        ):
            at = (
                offset.astype(mx.int32)
                if isinstance(offset, mx.array)
                else mx.array(offset, mx.int32)
            )
            return op(x, self.dims, self.traditional, self.base, self.scale, at.reshape(()))
        return super().__call__(x, offset)


SWAPS = {nn.RMSNorm: NativeRMSNorm, nn.RoPE: NativeRoPE}


def describe() -> str:
    """Whether the native norm, RoPE and gated-MLP ops run (a part of the kernel line)."""
    if native.op("rope") is None:
        return "MLX norms and RoPE"
    return "native RMSNorm, RoPE and gated MLPs"


def patch_model(module: nn.Module) -> int:
    """Swap the model's nn.RMSNorm and nn.RoPE layers for the native ones; how many (0 on
    the GPU, or without the kernel)."""
    if native.op("rope") is None or mx.default_device() != mx.cpu:
        return 0
    count = 0
    for layer in module.modules():
        native_class = SWAPS.get(type(layer))
        if native_class is not None:
            layer.__class__ = native_class
            count += 1
    return count
