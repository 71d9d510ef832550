"""MLX's quantized layers on the native kernel: NativeQuantizedLinear and
NativeQuantizedEmbedding, the two halves of a tensor-parallel pair (mlx.nn's
Quantized{AllToSharded,ShardedToAll}Linear, as mlx-lm's `shard` makes them), and
`patch_model`, which swaps a model's layers for them.

A patched layer keeps its parameters and class ancestry (only __class__ changes to a
subclass), and every call still checks that it runs on a CPU stream, so a patched model
stays usable anywhere.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import QuantizedAllToShardedLinear, QuantizedShardedToAllLinear

from . import native
from .ops import BITS, GROUP_SIZES, quantized_matmul, supports


class NativeQuantizedLinear(nn.QuantizedLinear):
    """A QuantizedLinear whose matmul goes through specmlx.cpu.ops.quantized_matmul; on the
    kernel a float32 product takes its bias in the same op (the same one rounding as
    y + bias, without the three graph nodes MLX's add of a half bias makes).

    `packed_tiles`: specmlx.cpu.packing.pack_layers' copy of the weights in the layout the
    four-row tiles stream, or None; None too once the weight, scales or biases it was made
    from are replaced, so a stale copy is never read."""

    _packed: tuple | None = None  # ((weight, scales, biases) packed, the copy): not a parameter

    @property
    def packed_tiles(self) -> mx.array | None:
        if self._packed is None:
            return None
        (w, s, b), packed = self._packed
        fresh = self["weight"] is w and self["scales"] is s and self.get("biases") is b
        return packed if fresh else None

    def __call__(self, x: mx.array) -> mx.array:
        return _product(self, x, self.get("bias"), self.packed_tiles)


def _product(
    layer: nn.Module, x: mx.array, bias: mx.array | None, packed: mx.array | None
) -> mx.array:
    """x @ layer's weights.T (+ bias) on the kernel where it applies, MLX's elsewhere."""
    w, scales, biases = layer["weight"], layer["scales"], layer.get("biases")
    if (
        bias is not None
        and bias.dtype == scales.dtype
        and mx.float32 in (x.dtype, scales.dtype)
        and supports(x, w, scales, biases, layer.group_size, layer.bits, layer.mode)
    ):
        return native._ext.quantized_matmul(
            x, w, scales, biases, layer.group_size, layer.bits, bias, packed
        )
    y = quantized_matmul(x, w, scales, biases, layer.group_size, layer.bits, layer.mode, packed)
    return y if bias is None else y + bias


class NativeAllToShardedLinear(QuantizedAllToShardedLinear):
    """A tensor split's first layer (this rank's rows of the output; nothing crosses ranks
    in the forward pass) on the kernel: MLX's own CPU product took ~25x the kernel's time,
    so a split model ran at a small fraction of one process's speed."""

    def __call__(self, x: mx.array) -> mx.array:
        return _product(self, x, self.get("bias"), None)


class NativeShardedToAllLinear(QuantizedShardedToAllLinear):
    """A tensor split's second layer on the kernel: this rank's share of the product over
    its slice of the input, summed over the ranks, then the bias once."""

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.distributed.all_sum(_product(self, x, None, None), group=self.group)
        bias = self.get("bias")
        return y if bias is None else y + bias


class NativeQuantizedEmbedding(nn.QuantizedEmbedding):
    """A QuantizedEmbedding whose as_linear (tied output heads) uses `quantized_matmul`,
    and whose float32 lookups are one native op (`quantized_rows`) on the CPU.

    `lookup_dtype` (set by keep_stored_halves): the lookup widens its gathered rows of
    scales and biases to it before dequantizing, as widening the whole table at load did.
    """

    lookup_dtype: mx.Dtype | None = None

    def __call__(self, x: mx.array) -> mx.array:
        rows = native.op("quantized_rows")
        scales = self["scales"]
        if (
            rows is not None
            and (self.lookup_dtype or scales.dtype) == mx.float32
            and self.bits in BITS
            and self.mode == "affine"
            and x.dtype in (mx.int32, mx.uint32)
            and mx.default_device() == mx.cpu
        ):
            # One op for the ~38 nodes of the gathers and MLX's dequantize; the same bits.
            return rows(x, self["weight"], scales, self["biases"], self.group_size, self.bits)
        if self.lookup_dtype is None:
            return super().__call__(x)
        return mx.dequantize(
            self["weight"][x],
            scales=self["scales"][x].astype(self.lookup_dtype),
            biases=self["biases"][x].astype(self.lookup_dtype),
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )

    def as_linear(self, x: mx.array) -> mx.array:
        return quantized_matmul(
            x,
            self["weight"],
            self["scales"],
            self.get("biases"),
            self.group_size,
            self.bits,
            self.mode,
        )


SHARDED = (QuantizedAllToShardedLinear, QuantizedShardedToAllLinear)


def _qualifies(layer: nn.Module) -> bool:
    # 6-bit products need int8 x; a 6-bit embedding's lookups do not (its as_linear then
    # falls back to MLX's product call by call, through supports)
    six_ok = native.activations() == "int8" or isinstance(layer, nn.QuantizedEmbedding)
    return (
        layer.bits in BITS
        and (layer.bits != 6 or six_ok)
        and getattr(layer, "mode", "affine") == "affine"
        and layer.group_size in GROUP_SIZES
        and layer.get("biases") is not None
    )


def runs_int4(module: nn.Module) -> bool:
    """Whether `patch_model` would put some of this model's 4-bit layers on the kernel."""
    return (
        native._ext is not None
        and mx.default_device() == mx.cpu
        and any(
            isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding, *SHARDED))
            and layer.bits == 4
            and _qualifies(layer)
            for layer in module.modules()
        )
    )


# A patched layer's parameters that may stay in the checkpoint's half type under float32
# activations: the kernel widens scales and biases exactly before the same float32
# arithmetic, `y + bias` promotes to float32 exactly, and an embedding's lookup widens the
# rows it gathers, so the result is bitwise the one with float32 copies. Norms (Gemma adds 1
# in the weight's type) would change, so everything else keeps the dtype policy.
HALF_IN_PLACE = ("scales", "biases", "bias")


def keep_stored_halves(module: nn.Module, stored: dict[str, mx.array]) -> int:
    """Put back the checkpoint's own fp16/bf16 arrays (mapped, not copied) where the dtype
    policy widened a patched layer's scales, biases or bias to float32: ~15% of an INT4
    model's bytes that would otherwise be private copies. Call after `patch_model`; returns
    how many arrays were put back."""
    restored = []
    for path, layer in module.named_modules():
        if not isinstance(layer, (NativeQuantizedLinear, NativeQuantizedEmbedding)):
            continue
        policy = layer["scales"].dtype
        for name in HALF_IN_PLACE:
            original = stored.get(f"{path}.{name}" if path else name)
            if (
                name in layer
                and original is not None
                and original.dtype in (mx.float16, mx.bfloat16)
                and layer[name].dtype == mx.float32
            ):
                layer[name] = original
                restored.append(original)
        if isinstance(layer, NativeQuantizedEmbedding) and layer["scales"].dtype != policy:
            layer.lookup_dtype = policy
    return len(restored)


def patch_model(module: nn.Module) -> int:
    """Route the model's 4- and 8-bit affine QuantizedLinear / QuantizedEmbedding.as_linear
    layers, and its 6-bit ones under int8 x, through the native kernel; returns how many
    layers were patched (0 when unavailable).

    Layers keep their parameters and class ancestry (only __class__ changes to a subclass),
    and every call still checks it runs on a CPU stream, so a patched model stays usable
    anywhere. Other layers are left alone.
    """
    if native._ext is None or mx.default_device() != mx.cpu:
        return 0
    native.check_settings()
    swaps = {
        nn.QuantizedLinear: NativeQuantizedLinear,
        nn.QuantizedEmbedding: NativeQuantizedEmbedding,
        QuantizedAllToShardedLinear: NativeAllToShardedLinear,
        QuantizedShardedToAllLinear: NativeShardedToAllLinear,
    }
    patched = 0
    for layer in module.modules():
        native_class = swaps.get(type(layer))
        if native_class is not None and _qualifies(layer):
            layer.__class__ = native_class
            patched += 1
    return patched
