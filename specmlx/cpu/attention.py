"""Attention on the native kernel: mlx-lm's `scaled_dot_product_attention`, replaced in a
model's modules by one that runs specmlx's native op where it applies and mlx-lm's own
everywhere else.

MLX's CPU `fast.scaled_dot_product_attention` spends ~1 ms a layer at Qwen2.5-1.5B's
decode shape over a 1000-token cache, several times what reading its keys and values
takes. The native op (specmlx/cpu/_native/attention.cpp, figures in its README) reads a KV
head once for every query row that uses it, and gives each query row the same bits
whatever rows run beside it: a verify pass over k tokens gives each position what a
one-token step gives it, which speculative greedy decoding relies on.

It applies to float32 queries, keys and values on a CPU stream, head sizes that are
multiples of 16 up to 512, with or without attention sinks (gpt-oss), on caches that keep
every position (KVCache: no mask or the causal one) and on sliding windows (mlx-lm's
RotatingKVCache without kept positions). A sliding window hands one token's attention its
keys in the ring buffer's rotated order with no mask, and several tokens' in time order
with a window mask: both go to the op with each key slot's position, worked out from the
cache's state after its update, and the op takes a row's keys in position order within
the window, so a row gets the same bits in either call. The window is the cache's
max_size, as every mlx-lm model that builds one makes it (Gemma 3, gpt-oss: a cache of
sliding_window positions and a mask of the same window). Quantized caches, other array
masks (padding) and everything else keep mlx-lm's path, for any number of rows: a row
never switches implementation with the number of rows beside it.

`SPECMLX_ATTENTION=native|mlx` (default native) is read once, at import; `set_mode`
switches at run time: the patched function reads the mode on every call.
"""

from __future__ import annotations

import os
import sys

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base
from mlx_lm.models.cache import ConcatenateKVCache, KVCache, RotatingKVCache

from ..errors import SpecmlxError
from . import native

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


def available() -> bool:
    """Whether the native extension has the attention op."""
    return hasattr(native._ext, "scaled_dot_product_attention")


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
    return "native attention" if mode() == "native" else "mx.fast attention"


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
    if not (mask is None or (isinstance(mask, str) and mask == "causal" and lq <= lk)):
        return None
    call["causal"] = mask is not None
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


def windows_exact(module: nn.Module) -> bool:
    """Whether `module`'s sliding-window layers give each row of a pass over k tokens the
    bits a one-token step gives it: they run on the native op (this mode, head sizes it
    takes, windows that keep no positions). Asked at load, for int8 activations
    (specmlx.cpu.native.rows_exact): switching to 'mlx' afterwards brings the windows'
    last-bit residue back."""
    from mlx_lm.models.cache import make_prompt_cache

    from ..caches import layers

    heads = {getattr(m, "head_dim", None) for m in module.modules() if hasattr(m, "head_dim")}
    windows = [c for c in layers(make_prompt_cache(module)) if type(c) is RotatingKVCache]
    return (
        mode() == "native"
        and mx.default_device() == mx.cpu
        and bool(heads)
        and all(head_dim_ok(d) for d in heads)
        and all(c.keep == 0 for c in windows)
    )


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
