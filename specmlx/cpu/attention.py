"""Attention on the native kernel: mlx-lm's `scaled_dot_product_attention`, replaced in a
model's modules by one that runs specmlx's native op where it applies and mlx-lm's own
everywhere else.

MLX's CPU `fast.scaled_dot_product_attention` spends ~1 ms a layer at Qwen2.5-1.5B's
decode shape over a 1000-token cache, several times what reading its keys and values
takes. The native op (specmlx/cpu/_native/attention.cpp, figures in its README) reads a KV
head once for every query row that uses it, and gives each query row the same bits
whatever rows run beside it: a verify pass over k tokens gives each position what a
one-token step gives it, which speculative greedy decoding relies on.

It applies to float32 queries, keys and values on a CPU stream with no mask or the causal
one, head sizes that are multiples of 16 up to 512 and caches that keep every position
(KVCache); quantized caches, attention sinks, array masks (sliding windows, padding) and
everything else keep mlx-lm's path. A sliding window's cache passes an array mask over
several tokens but none for one, so its layers stay on MLX's path for both: a row never
switches implementation with the number of rows beside it.

`SPECMLX_ATTENTION=native|mlx` (default native) is read once, at import; `set_mode`
switches at run time: the patched function reads the mode on every call.
"""

from __future__ import annotations

import os
import sys

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base
from mlx_lm.models.cache import ConcatenateKVCache, KVCache

from ..errors import SpecmlxError
from . import native

MODES = ("native", "mlx")
ENV = "SPECMLX_ATTENTION"
HEAD_DIM_STEP = 16  # the kernel's head sizes: multiples of this up to MAX_HEAD_DIM
MAX_HEAD_DIM = 512
# Caches that keep every position: their masks are None (one token) or "causal".
FULL_CACHES = (KVCache, ConcatenateKVCache)

mlx_attention = base.scaled_dot_product_attention  # mlx-lm's, before any patch


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


def supports(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: object,
    mask: mx.array | str | None,
    sinks: mx.array | None = None,
) -> bool:
    """Whether this call runs on the native op."""
    if mode() != "native" or mx.default_device() != mx.cpu:
        return False
    if sinks is not None or not (cache is None or isinstance(cache, FULL_CACHES)):
        return False
    if not (mask is None or (isinstance(mask, str) and mask == "causal")):
        return False
    if any(x.dtype != mx.float32 or x.ndim != 4 for x in (queries, keys, values)):
        return False
    b, hq, lq, d = queries.shape
    _, hkv, lk, _ = keys.shape
    return (
        keys.shape == values.shape
        and keys.shape[0] == b
        and keys.shape[3] == d
        and hkv > 0
        and hq % hkv == 0
        and d % HEAD_DIM_STEP == 0
        and 0 < d <= MAX_HEAD_DIM
        and lk > 0
        and (mask is None or lq <= lk)
    )


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
    if supports(queries, keys, values, cache, mask, sinks):
        return native._ext.scaled_dot_product_attention(
            queries, keys, values, scale, mask is not None
        )
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
