"""Attention on the native kernel: mlx-lm's `scaled_dot_product_attention`, replaced in a
model's modules by one that runs specmlx's native op where it applies and mlx-lm's own
everywhere else.

MLX's CPU `fast.scaled_dot_product_attention` takes several times what reading a layer's
keys and values takes at decode shapes (bench/results/attention.md). The native op
(specmlx/cpu/_native/attention.cpp, see its README's "Attention") reads a KV head once
for every query row that uses it, and gives each query row the same bits whatever rows
run beside it: a verify pass over k tokens gives each position what a one-token step
gives it, which speculative greedy decoding relies on.

It applies to float32 queries, keys and values on a CPU stream, head sizes that are
multiples of 16 up to 512, with or without attention sinks (gpt-oss), on caches that keep
every position (KVCache: no mask or the causal one) and on sliding windows (mlx-lm's
RotatingKVCache without kept positions). A sliding window hands one token's attention its
keys in the ring buffer's rotated order with no mask, and several tokens' in time order
with a window mask: both go to the op with each key slot's position, worked out from the
cache's state after its update, and the op takes a row's keys in position order within
the window, so a row gets the same bits in either call. The window is the cache's
max_size, as every mlx-lm model that builds one makes it (Gemma 3, gpt-oss: a cache of
sliding_window positions and a mask of the same window). A tree's pass (specmlx.treepass:
each row reads the context and its own ancestors, which come before it) hands a plain
cache a boolean mask; within `tree_masks()` the op takes it beside the causal ranges.
Quantized caches, other array masks (padding) and everything else keep mlx-lm's path, for
any number of rows: a row never switches implementation with the number of rows beside it.

An attention layer whose `__call__` is mlx-lm's plain one (CACHED_BODY: Llama, Qwen2,
Gemma and a dozen more) goes one step further on a plain KVCache with room for the new
positions: its RoPE, the cache's two slice updates and the attention run as one native op
(`cached_attention`), writing k and v into the cache's buffers in place. A decode step's
graph loses ~11 nodes a layer (reshapes, transposes, RoPEs, slice updates, slices), each of
which cost the Python thread and MLX's dispatch a few microseconds; every output bit and
the cache's contents are those of the unfused calls. Any other call runs mlx-lm's code.

`SPECMLX_ATTENTION=native|mlx` (default native) is read once, at import; `set_mode`
switches at run time: the patched function and the fused attentions read the mode on
every call.
"""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base
from mlx_lm.models.cache import ConcatenateKVCache, KVCache, RotatingKVCache

from ..errors import SpecmlxError
from . import native
from .layers import NativeRoPE
from .source_match import call_body, mixed_class

MODES = ("native", "mlx")
ENV = "SPECMLX_ATTENTION"
HEAD_DIM_STEP = 16  # the kernel's head sizes: multiples of this up to MAX_HEAD_DIM
MAX_HEAD_DIM = 512
# Caches that keep every position: their masks are None (one token) or "causal".
FULL_CACHES = (KVCache, ConcatenateKVCache)

mlx_attention = base.scaled_dot_product_attention  # mlx-lm's, before any patch


def head_dim_ok(d: object) -> bool:
    """Whether the kernel takes head size `d`."""
    return isinstance(d, int) and d % HEAD_DIM_STEP == 0 and 0 < d <= MAX_HEAD_DIM


def _env_mode() -> tuple[str, str]:
    """(the mode SPECMLX_ATTENTION asks for, or the default; '' or why it is bad)."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return MODES[0], ""
    if text not in MODES:
        return MODES[0], f"{ENV} must be one of {', '.join(MODES)}, got {text!r}"
    return text, ""


# A bad value is reported when a model is prepared (patch_model), as one line from the CLI,
# rather than breaking `import specmlx`.
_mode, _env_problem = _env_mode()


_trees = [0]  # tree passes under way (tree_masks)


@contextmanager
def tree_masks() -> Iterator[None]:
    """Within the block a boolean array mask on a plain cache is a tree's: no row reads a
    key past its own position, so the native op takes it with its causal ranges."""
    _trees[0] += 1
    try:
        yield
    finally:
        _trees[0] -= 1


def _tree_mask(mask: object, lq: int, lk: int) -> mx.array | None:
    """A tree pass's mask as the op's (Lq, Lk) booleans, or None where `mask` is not one."""
    if not (_trees[0] and isinstance(mask, mx.array) and mask.dtype == mx.bool_ and lq <= lk):
        return None
    if mask.ndim < 2 or mask.shape[-2:] != (lq, lk) or any(n != 1 for n in mask.shape[:-2]):
        return None
    return mask.reshape(lq, lk)


def available() -> bool:
    """Whether the native extension has the attention op."""
    return native.op("scaled_dot_product_attention") is not None


def mode() -> str:
    """Which attention patched models run on the CPU: 'native' or 'mlx'."""
    return _mode if available() else "mlx"


def set_mode(name: str) -> None:
    """Run 'native' or 'mlx' attention in patched models from the next call on."""
    if name not in MODES:
        raise SpecmlxError(f"unknown attention {name!r}; use one of {', '.join(MODES)}")
    if name == "native" and not available():
        raise SpecmlxError(f"native attention unavailable: {native.reason() or 'old build'}")
    global _mode
    _mode = name


def describe() -> str:
    """Which attention runs, for the kernel line of stats and benchmarks."""
    if mode() != "native":
        return "mx.fast attention"
    fused = ", fused with RoPE and the cache write" if cached_available() else ""
    return "native attention" + fused


def _window(
    cache: RotatingKVCache, keys: mx.array, lq: int, mask: mx.array | str | None
) -> tuple[int, int, int] | None:
    """(window, key_start, rotation) of a sliding window's call: the op's positions for the
    keys as `cache.update_and_fetch` just handed them in; None where they are not known.

    One token (`_update_in_place`): the ring buffer, or its first `offset` slots before it
    fills; the newest key sits in slot `_idx - 1` and the oldest after it. Several
    (`_update_concat`): the keys in time order, `_idx` of them, up to max_size - 1 old
    ones before the new (more than the window right after such a pass). Either way the
    newest key's position is offset - 1 and the oldest sits in slot `_idx` mod the length.
    """
    n, offset, idx = keys.shape[2], cache.offset, cache._idx
    if cache.keep != 0 or not (lq <= n <= offset and 0 < idx <= n):
        return None
    if lq == 1:
        if mask is not None or n != min(offset, cache.keys.shape[2]):
            return None
    else:
        causal = isinstance(mask, str) and mask == "causal"
        windowed = isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.shape == (lq, n)
        if n != idx or not (causal or windowed):
            return None
    return cache.max_size, offset - n, idx % n


def _native_call(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: object,
    mask: mx.array | str | None,
    sinks: mx.array | None,
) -> dict | None:
    """The native op's keyword arguments past (q, k, v, scale) for this call, or None where
    it does not apply."""
    if mode() != "native" or mx.default_device() != mx.cpu:
        return None
    rotating = type(cache) is RotatingKVCache
    if not (rotating or cache is None or isinstance(cache, FULL_CACHES)):
        return None  # a quantized cache's keys are tuples, for one
    if any(x.dtype != mx.float32 or x.ndim != 4 for x in (queries, keys, values)):
        return None
    b, hq, lq, d = queries.shape
    _, hkv, lk, _ = keys.shape
    if not (
        keys.shape == values.shape
        and keys.shape[0] == b
        and keys.shape[3] == d
        and hkv > 0
        and hq % hkv == 0
        and head_dim_ok(d)
        and lk > 0
    ):
        return None
    if sinks is not None and (sinks.dtype != mx.float32 or sinks.shape != (hq,)):
        return None
    call = {"sinks": sinks}
    if rotating:
        window = _window(cache, keys, lq, mask)
        if window is None:
            return None
        call.update(causal=True, window=window[0], key_start=window[1], rotation=window[2])
        return call
    if mask is None or (isinstance(mask, str) and mask == "causal" and lq <= lk):
        call["causal"] = mask is not None
        return call
    tree = _tree_mask(mask, lq, lk)
    if tree is None:
        return None
    call.update(causal=True, mask=tree)
    return call


def supports(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: object,
    mask: mx.array | str | None,
    sinks: mx.array | None = None,
) -> bool:
    """Whether this call runs on the native op."""
    return _native_call(queries, keys, values, cache, mask, sinks) is not None


def scaled_dot_product_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: object,
    scale: float,
    mask: mx.array | str | None,
    sinks: mx.array | None = None,
) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention`, on the native op where it applies."""
    call = _native_call(queries, keys, values, cache, mask, sinks)
    if call is not None:
        return native._ext.scaled_dot_product_attention(queries, keys, values, scale, **call)
    return mlx_attention(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def patch_model(module: nn.Module) -> bool:
    """Point the mlx-lm modules that define this model's layers (e.g. mlx_lm.models.qwen2)
    at the function above; whether the model's attention now goes through it. Patching
    a module is for the whole process, every model of that architecture: calls that the
    native op does not take (a GPU stream included) still reach mlx-lm's own."""
    if not available() or mx.default_device() != mx.cpu:
        return False
    if _env_problem:
        raise SpecmlxError(_env_problem)
    routed = False
    for layer in module.modules():
        source = sys.modules.get(type(layer).__module__)
        current = getattr(source, "scaled_dot_product_attention", None)
        if current is mlx_attention:
            source.scaled_dot_product_attention = scaled_dot_product_attention
        routed |= current in (mlx_attention, scaled_dot_product_attention)
    return routed


# The body of mlx-lm's plain attention __call__(self, x, mask=None, cache=None), as Qwen2,
# Llama, Gemma, Granite, GLM-4, Helium, InternLM3, StarCoder2 and others have it. Kept here
# verbatim, not read from mlx-lm, so that a change to mlx-lm's code can only turn the fused
# op off, never make it compute something else.
CACHED_BODY = """
B, L, D = x.shape
queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
if cache is not None:
    queries = self.rope(queries, offset=cache.offset)
    keys = self.rope(keys, offset=cache.offset)
    keys, values = cache.update_and_fetch(keys, values)
else:
    queries = self.rope(queries)
    keys = self.rope(keys)
output = scaled_dot_product_attention(
    queries, keys, values, cache=cache, scale=self.scale, mask=mask
)
output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)
return self.o_proj(output)
"""


# sys.getrefcount of a cache array held by the cache and one local name alone (the call's
# own argument is the third).
_CACHE_REFS = 3


def cached_available() -> bool:
    """Whether the native extension has the fused cached-attention op."""
    return native.op("cached_attention") is not None


def _has_cached_body(cls: type) -> bool:
    """Whether cls.__call__ is (self, x, mask=None, cache=None) with CACHED_BODY, calling
    mlx-lm's attention function (or this module's)."""
    body = call_body(cls, ["self", "x", "mask", "cache"])
    if body != [ast.dump(stmt) for stmt in ast.parse(CACHED_BODY).body]:
        return False
    function = cls.__call__.__globals__.get("scaled_dot_product_attention")
    return function in (mlx_attention, scaled_dot_product_attention)


def cache_room(
    attn: nn.Module, x: mx.array, mask: mx.array | str | None, cache: object
) -> tuple[mx.array, mx.array] | None:
    """The cache's (keys, values) buffers where the fused op can take this call of an
    attention with CACHED_BODY, else None: not native mode or the CPU, a cache other than
    a plain KVCache with room for L more positions, an array mask, a scaled RoPE, or shapes
    and types it does not have."""
    if x.dtype != mx.float32 or x.ndim != 3:
        return None
    return room_for(attn, x.shape[0], x.shape[1], mask, cache)


def room_for(
    attn: nn.Module,
    b: int,
    length: int,
    mask: mx.array | str | None,
    cache: object,
    rope: nn.Module | None = None,
) -> tuple[mx.array, mx.array] | None:
    """cache_room for a float32 x of b rows of `length` new tokens each; `rope`: the
    attention's own RoPE where another stands in for it (a batched pass's, batch.py)."""
    if mode() != "native" or type(cache) is not KVCache or mx.default_device() != mx.cpu:
        return None
    if not (mask is None or (isinstance(mask, str) and mask == "causal")):
        return None
    keys, values = cache.keys, cache.values
    if keys is None or type(attn.rope if rope is None else rope) is not NativeRoPE:
        return None
    _, hkv, size, d = keys.shape
    if (
        cache.offset + length > size
        or values.shape != keys.shape
        or mx.float32 != keys.dtype
        or mx.float32 != values.dtype
        or keys.shape[0] != b
        or hkv != attn.n_kv_heads
        or not head_dim_ok(d)
    ):
        return None
    return keys, values


def reusable(keys: mx.array, values: mx.array) -> bool:
    """Whether only the cache (and the caller's `keys`, `values`) hold its arrays: the op
    may then write the new positions into their buffers in place, as MLX's donation lets a
    slice update do. Call with the cache's arrays bound to those two names alone."""
    # +1: getrefcount's own argument, +1: this function's parameter
    return sys.getrefcount(keys) == sys.getrefcount(values) == _CACHE_REFS + 1


def _cached_call(
    attn: nn.Module, x: mx.array, mask: mx.array | str | None, cache: object
) -> mx.array | None:
    """CACHED_BODY's result through the fused op, or None where the op does not take the
    call (see cache_room)."""
    room = cache_room(attn, x, mask, cache)
    if room is None:
        return None
    keys, values = room
    del room
    b, length, _ = x.shape
    _, hkv, _, d = keys.shape
    queries, new_keys, new_values = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    if any(a.dtype != mx.float32 for a in (queries, new_keys, new_values)) or (
        queries.shape != (b, length, attn.n_heads * d)
        or new_keys.shape != (b, length, hkv * d)
        or new_values.shape != new_keys.shape
    ):
        return None  # nothing evaluated: the projections' nodes are dropped unused
    rope = attn.rope
    reuse = reusable(keys, values)
    output, cache.keys, cache.values = native._ext.cached_attention(
        queries,
        new_keys,
        new_values,
        keys,
        values,
        attn.n_heads,
        cache.offset,
        rope.dims,
        rope.traditional,
        rope.base,
        rope.scale,
        attn.scale,
        mask is not None,
        reuse,
    )
    cache.offset += length
    return attn.o_proj(output)


class _CachedAttention:
    """Mixed in before an attention class with CACHED_BODY: the fused op where it takes the
    call, the class's own __call__ everywhere else."""

    def __call__(
        self, x: mx.array, mask: mx.array | str | None = None, cache: object = None
    ) -> mx.array:
        out = _cached_call(self, x, mask, cache)
        return super().__call__(x, mask, cache) if out is None else out


_cached_classes: dict[type, type | None] = {}


def _cached_class(cls: type) -> type | None:
    """cls with _CachedAttention mixed in, or None where its __call__ is not CACHED_BODY."""
    return mixed_class(_cached_classes, cls, _CachedAttention, "NativeCached", _cached_attrs)


def _cached_attrs(cls: type) -> dict | None:
    return {} if _has_cached_body(cls) else None


def patch_attentions(module: nn.Module) -> int:
    """Give the model's attention layers whose __call__ is CACHED_BODY the fused op (see
    the module's docstring); returns how many. Call after patch_model, which routes the
    module's attention function, and after specmlx.cpu.layers.patch_model, which makes
    their RoPEs native."""
    if not cached_available() or mx.default_device() != mx.cpu:
        return 0
    patched = 0
    for layer in module.modules():
        if isinstance(layer, _CachedAttention) or "o_proj" not in layer:
            continue
        cached = _cached_class(type(layer))
        if cached is not None:
            layer.__class__ = cached
            patched += 1
    return patched
