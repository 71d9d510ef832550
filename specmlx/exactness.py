"""Whether a model's pass over k tokens gives each position bit for bit what a one-token
step gives it, per architecture and cache kind.

Speculative greedy decoding is lossless only where it is: a verify pass must pick the
tokens the target alone would. Last-bit differences are harmless in float32, but enough
for int8 activations' rounding to carry a near-tie to another greedy token, so
specmlx.cpu.prepare puts the kernel on float32 x for good where `passes_exact` says no.

The rules need the model's caches and specmlx.stepwise, which sit above specmlx.cpu:
they live here, and the CPU backend is handed `passes_exact` by specmlx.loading.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from . import stepwise
from .caches import layers
from .cpu import attention

# Recurrent layers whose mlx-lm code is exact over a pass as it stands: the gated delta
# rule of Qwen3-Next and Qwen3.5 runs one token at a time whatever the pass's length, and
# LFM2's short conv gives each row the same bits over any length on the CPU
# (bench/row_exactness.py; tests/test_stepwise.py checks their INT4 copies too).
RECURRENT_EXACT = ("qwen3_next", "qwen3_5", "lfm2")


def windows_exact(module: nn.Module) -> bool:
    """Whether `module`'s sliding-window layers give each row of a pass over k tokens the
    bits a one-token step gives it: they run on the native attention op (its mode, head
    sizes it takes, windows that keep no positions). Asked at load: switching attention to
    'mlx' afterwards brings the windows' last-bit residue back."""
    heads = {getattr(m, "head_dim", None) for m in module.modules() if hasattr(m, "head_dim")}
    windows = [c for c in layers(make_prompt_cache(module)) if type(c) is RotatingKVCache]
    return (
        attention.mode() == "native"
        and mx.default_device() == mx.cpu
        and bool(heads)
        and all(attention.head_dim_ok(d) for d in heads)
        and all(c.keep == 0 for c in windows)
    )


def rows_exact(module: nn.Module, exact_windows: bool = False) -> bool:
    """Whether the model's pass over k tokens gives each position bit for bit what a
    one-token step gives it: where every layer keeps a plain KV cache (global causal
    attention) or a sliding window that the native attention op runs (`exact_windows`:
    windows_exact), or a Mamba-2 state that specmlx.stepwise steps through short passes, or
    RECURRENT_EXACT's layers. Sliding windows on mlx-lm's attention (its masked
    multi-token path) and mlx-lm's chunked Mamba-2 scan differ in the logits' last bits
    (bench/row_exactness.py)."""
    caches = layers(make_prompt_cache(module))
    kv_only = all(type(c) is KVCache for c in caches)
    windows = exact_windows and all(type(c) in (KVCache, RotatingKVCache) for c in caches)
    recurrent = getattr(module, "model_type", None) in RECURRENT_EXACT and all(
        type(c) in (KVCache, ArraysCache) for c in caches
    )
    return kv_only or windows or recurrent or stepwise.stepped(module)


def passes_exact(module: nn.Module) -> bool:
    """rows_exact with the model's sliding windows as they run now: what
    specmlx.cpu.prepare asks before it keeps int8 activations."""
    return rows_exact(module, windows_exact(module))
