"""A decoder layer's whole step as one native op on the CPU.

With its attention, MLP, norms and projections already native, a 1.5B decode step was
still ~9 graph nodes a layer (two norms, the stacked q/k/v product, the cached attention,
o, the gated product, down, two residual adds), and a node costs the Python thread and
MLX's dispatch the same whatever its size, time the kernel's threads wait through (see
bench/results/ARCHIVE.md, "a decoder layer as one op"). A layer whose block is mlx-lm's
plain pre-norm one (BLOCK_BODY: Llama, Qwen2 and ~45 more files) and whose parts are all
the native ones (an attention with CACHED_BODY, a gated MLP, nn.RMSNorm norms, projections
on the kernel of one group size and bits, a bias on q, k and v or on none, none on o,
gate, up and down) runs its step as `decoder_layer`: one node, whose output and caches are
bitwise those of the nine (the same functions on the same values, in the same order). A
call the op does not take (see attention.cache_room) runs the block's own code.
"""

from __future__ import annotations

import ast

import mlx.core as mx
import mlx.nn as nn

from . import attention, native
from .layers import NativeRMSNorm
from .mlp import _GatedMLP
from .packing import packed_of
from .quantized import NativeQuantizedLinear
from .source_match import call_body, mixed_class

# The body of mlx-lm's pre-norm block __call__(self, x, mask=None, cache=None). Kept here
# verbatim, not read from mlx-lm, so that a change to mlx-lm's code can only turn the fused
# op off, never make it compute something else.
BLOCK_BODY = """
r = self.self_attn(self.input_layernorm(x), mask, cache)
h = x + r
r = self.mlp(self.post_attention_layernorm(h))
out = h + r
return out
"""

_enabled = True


def set_enabled(on: bool) -> None:
    """Turn the fused layers on or off for every model (benchmarks and tests)."""
    global _enabled
    _enabled = on


def available() -> bool:
    """Whether the native extension has the fused decoder-layer op."""
    return native.op("decoder_layer") is not None


def rows_available() -> bool:
    """Whether the native extension runs a batched pass's layer as one op too."""
    return native.op("decoder_layer_rows") is not None


def describe() -> str:
    """Whether decoder layers run as one op, for the kernel line of stats and benchmarks."""
    return "decoder layers as one op" if _enabled and available() else "decoder layers op by op"


def _has_block_body(cls: type) -> bool:
    body = call_body(cls, ["self", "x", "mask", "cache"])
    return body == [ast.dump(stmt) for stmt in ast.parse(BLOCK_BODY).body]


def _linears(block: nn.Module) -> list[nn.Module] | None:
    """q, k, v, o, gate, up and down where the parts are the native ones, else None."""
    attn, mlp = block.self_attn, block.mlp
    if not (isinstance(attn, attention._CachedAttention) and isinstance(mlp, _GatedMLP)):
        return None
    if not (type(block.input_layernorm) is type(block.post_attention_layernorm) is NativeRMSNorm):
        return None
    layers = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj]
    layers.append(mlp.down_proj)
    kind = (layers[0].bits, layers[0].group_size, "affine")
    if not all(isinstance(layer, NativeQuantizedLinear) for layer in layers):
        return None
    if any((layer.bits, layer.group_size, layer.mode) != kind for layer in layers):
        return None
    biased = {"bias" in layer for layer in layers[:3]}
    if any("bias" in layer for layer in layers[3:]) or len(biased) != 1:
        return None
    return layers


class _Parts:
    """What a fused block's calls read, found once when it is patched (through nn.Module's
    attribute lookup, each a Python-level __getattr__, they cost more than the op's call):
    its attention, norms and MLP activation, and the seven linear layers in the op's order.
    The arrays themselves are read from the layers on every call."""

    __slots__ = ("attn", "norms", "layers", "activation", "biased")

    def __init__(self, block: nn.Module, layers: list[nn.Module]):
        self.attn = block.self_attn
        self.norms = (block.input_layernorm, block.post_attention_layernorm)
        self.layers = layers
        self.activation = block.mlp._activation
        self.biased = "bias" in layers[0]


def _fused_call(block: nn.Module, x: mx.array, mask: object, cache: object) -> mx.array | None:
    """BLOCK_BODY's result through the fused op, or None where it does not take the call."""
    if isinstance(getattr(cache, "rows", None), list):  # a batched pass (batch.RowsCache)
        return _fused_rows_call(block, x, cache)
    parts = block._fused_parts
    room = attention.cache_room(parts.attn, x, mask, cache) if _enabled else None
    if room is None:
        return None
    keys, values = room
    del room
    attn, layers, (norm_in, norm_post) = parts.attn, parts.layers, parts.norms
    q = layers[0]
    if norm_in["weight"].dtype != mx.float32 or norm_post["weight"].dtype != mx.float32:
        return None
    w = _weights(parts)
    rope = attn.rope
    reuse = attention.reusable(keys, values)
    out, cache.keys, cache.values = native._ext.decoder_layer(
        x,
        norm_in["weight"],
        norm_in.eps,
        w[0] + w[1] + w[2],
        [layer["bias"] for layer in layers[:3]] if parts.biased else [],
        w[3],
        norm_post["weight"],
        norm_post.eps,
        w[4] + w[5],
        w[6],
        keys,
        values,
        q.group_size,
        q.bits,
        parts.activation,
        attn.n_heads,
        cache.offset,
        rope.dims,
        rope.traditional,
        rope.base,
        rope.scale,
        attn.scale,
        mask is not None,
        reuse,
        packed_of(layers),
    )
    cache.offset += x.shape[1]
    return out


def _weights(parts: _Parts) -> list[list[mx.array]]:
    return [[layer["weight"], layer["scales"], layer["biases"]] for layer in parts.layers]


def _fused_rows_call(block: nn.Module, x: mx.array, rows: object) -> mx.array | None:
    """A batched pass's layer (batch.RowsCache: row r of x is sequence r's, its first
    lengths[r] tokens new, on its own cache) as one op, each row's bits those of its own
    pass; None where the op does not take every row (a cache without room for its tokens
    grows on the layer's own path)."""
    parts = block._fused_parts
    if not (_enabled and rows_available()) or x.dtype != mx.float32:
        return None
    attn, layers, (norm_in, norm_post) = parts.attn, parts.layers, parts.norms
    if norm_in["weight"].dtype != mx.float32 or norm_post["weight"].dtype != mx.float32:
        return None
    lengths = rows.shared.lengths
    rope = getattr(attn.rope, "inner", attn.rope)  # the pass runs RoPEs row by row elsewhere
    k_caches, v_caches, reuse = [], [], []
    for cache, m in zip(rows.rows, lengths, strict=True):
        room = attention.room_for(attn, 1, m, None if m == 1 else "causal", cache, rope)
        if room is None:
            return None
        keys, values = room
        del room
        reuse.append(attention.reusable(keys, values))
        k_caches.append(keys)
        v_caches.append(values)
    del keys, values
    q, w = layers[0], _weights(parts)
    out, k_new, v_new = native._ext.decoder_layer_rows(
        x,
        norm_in["weight"],
        norm_in.eps,
        w[0] + w[1] + w[2],
        [layer["bias"] for layer in layers[:3]] if parts.biased else [],
        w[3],
        norm_post["weight"],
        norm_post.eps,
        w[4] + w[5],
        w[6],
        k_caches,
        v_caches,
        q.group_size,
        q.bits,
        parts.activation,
        attn.n_heads,
        [cache.offset for cache in rows.rows],
        lengths,
        rope.dims,
        rope.traditional,
        rope.base,
        rope.scale,
        attn.scale,
        [int(m > 1) for m in lengths],
        [int(r) for r in reuse],
        packed_of(layers),
    )
    for cache, keys, values, m in zip(rows.rows, k_new, v_new, lengths, strict=True):
        cache.keys, cache.values = keys, values
        cache.offset += m
    return out


class _FusedBlock:
    """Mixed in before a block class with BLOCK_BODY: the fused op where it takes the call,
    the class's own __call__ everywhere else."""

    def __call__(self, x: mx.array, mask: object = None, cache: object = None) -> mx.array:
        out = _fused_call(self, x, mask, cache)
        return super().__call__(x, mask, cache) if out is None else out


_fused_classes: dict[type, type | None] = {}


def _fused_class(cls: type) -> type | None:
    """cls with _FusedBlock mixed in, or None where its __call__ is not BLOCK_BODY."""
    return mixed_class(_fused_classes, cls, _FusedBlock, "NativeFused", _fused_attrs)


def _fused_attrs(cls: type) -> dict | None:
    return {} if _has_block_body(cls) else None


def patch_blocks(module: nn.Module) -> int:
    """Give the model's blocks with BLOCK_BODY whose parts are all native the fused op;
    returns how many. Call after specmlx.cpu.attention.patch_attentions,
    mlp.patch_mlps and qkv.patch_projections."""
    if not available() or mx.default_device() != mx.cpu:
        return 0
    patched = 0
    for layer in module.modules():
        if isinstance(layer, _FusedBlock) or "self_attn" not in layer or "mlp" not in layer:
            continue
        if not all(name in layer for name in ("input_layernorm", "post_attention_layernorm")):
            continue
        fused = _fused_class(type(layer))
        linears = _linears(layer) if fused is not None else None
        if linears is not None:
            layer.__class__ = fused
            layer._fused_parts = _Parts(layer, linears)
            patched += 1
    return patched
