"""Mamba-2 mixers that run a short pass token by token, so that a verify pass gives each
position the bits a one-token decode step gives it.

mlx-lm's Mamba-2 mixers (mamba2, granitemoehybrid, falcon_h1) compute a pass over several
tokens with the chunked SSD form (`mlx_lm.models.ssm.ssm_attn` over the whole pass: a
masked decay matrix and matmuls), and a one-token step with the recurrence (on the CPU
`ssm_attn` over one token, on Metal `ssm_update_kernel`). Different arithmetic, different
last bits: ~3e-6 in the tiny models' logits (bench/results/row_exactness.md), enough for
int8 activations' rounding to carry a near-tie to another greedy token.

Here each such mixer's `_conv` (the causal conv1d and its conv-state update) and `_ssm`
(the state-space update) run a pass of 2 to MAX_TOKENS tokens over a cache that already
holds a state as that many calls over one token each, the state threaded from one to the
next: exactly the calls k decode steps make, on every backend (on Metal each picks the
kernel a decode step does). On the CPU only the SSM differs (the conv's rows come out
alike over any length there); the conv is stepped too so that no backend's choice of
conv kernel by shape can matter. The projections, norms and gates around them stay one
call over all rows: row-exact on the CPU, as plain-KV models show. A prompt prefill
(longer, or over an empty cache) keeps mlx-lm's chunked form, and so does anything with
a mask or per-sequence lengths (batched, padded inputs: not what specmlx runs).

Only the two methods, which read and write the cache's two slots, are wrapped; the
mixers' own code runs unchanged. Patching a class is for the whole process, every model
of that architecture, as specmlx.cpu.attention patches a module's function.

Why the other state-space architectures need none of this: qwen3_next and qwen3_5's gated
delta rule runs its recurrence one token at a time whatever the pass's length, and lfm2's
are a short conv, row-exact on the CPU as the Mamba-2 conv is (specmlx.exactness's
RECURRENT_EXACT names them).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from .caches import layers

# The longest pass stepped: a verify pass or a draft's catch-up, settings.MAX_GAMMA + 1
# tokens (tests/test_stepwise.py holds them together). Not imported: settings reaches the
# drafters, which sit above this module.
MAX_TOKENS = 9
# The mlx-lm classes (module, name) whose `_conv` and `_ssm` are wrapped: Mamba-2 mixers
# keeping (conv state, SSM state) in an ArraysCache's slots 0 and 1.
MIXERS = {
    ("mlx_lm.models.mamba2", "Mamba2Block"),
    ("mlx_lm.models.granitemoehybrid", "GraniteMoeHybridMamba2Mixer"),
    ("mlx_lm.models.falcon_h1", "FalconH1Mixer"),
}
CONV_SLOT, SSM_SLOT = 0, 1

_enabled = True
_patched: set[type] = set()


def set_enabled(on: bool) -> None:
    """Step short passes (True) or run mlx-lm's chunked form for them too (False), from the
    next call on: for measuring what stepping costs."""
    global _enabled
    _enabled = on


def _steps(x: mx.array, cache: ArraysCache | None, mask: mx.array | None, slot: int) -> bool:
    """Whether a pass over x (batch, tokens, features) runs token by token."""
    return (
        _enabled
        and 1 < x.shape[1] <= MAX_TOKENS
        and cache is not None
        and cache[slot] is not None
        and mask is None
        and cache.lengths is None
    )


def _stepwise_conv(conv: Callable) -> Callable:
    def _conv(self, conv_input: mx.array, cache: ArraysCache | None, mask: mx.array | None):
        if not _steps(conv_input, cache, mask, CONV_SLOT):
            return conv(self, conv_input, cache, mask)
        rows = [
            conv(self, conv_input[:, i : i + 1], cache, None) for i in range(conv_input.shape[1])
        ]
        return mx.concatenate(rows, axis=1)

    _conv.__wrapped__ = conv
    return _conv


def _stepwise_ssm(ssm: Callable) -> Callable:
    def _ssm(self, hidden_states, B, C, dt, cache: ArraysCache | None, mask: mx.array | None):
        if not _steps(hidden_states, cache, mask, SSM_SLOT):
            return ssm(self, hidden_states, B, C, dt, cache, mask)
        rows = [
            ssm(self, *(x[:, i : i + 1] for x in (hidden_states, B, C, dt)), cache, None)
            for i in range(hidden_states.shape[1])
        ]
        return mx.concatenate(rows, axis=1)

    _ssm.__wrapped__ = ssm
    return _ssm


def mixers(module: nn.Module) -> list[nn.Module]:
    """The model's Mamba-2 mixers of the kinds in MIXERS."""
    return [m for m in module.modules() if (type(m).__module__, type(m).__name__) in MIXERS]


def patch_model(module: nn.Module) -> int:
    """Make the model's Mamba-2 mixers step short passes (their classes, once per process);
    how many mixers the model has. Any backend: the stepped calls are a decode step's."""
    found = mixers(module)
    for cls in {type(m) for m in found} - _patched:
        cls._conv = _stepwise_conv(cls._conv)
        cls._ssm = _stepwise_ssm(cls._ssm)
        _patched.add(cls)
    return len(found)


def stepped(module: nn.Module) -> bool:
    """Whether every state-space cache of the model belongs to a mixer that steps short
    passes (patched and enabled), and its other caches are plain KV caches: then its
    passes over a verify's few tokens are as row-exact as a plain-KV model's."""
    kinds = [type(c) for c in layers(make_prompt_cache(module))]
    states = kinds.count(ArraysCache)
    found = [m for m in mixers(module) if type(m) in _patched]
    return (
        _enabled
        and states > 0
        and states == len(found)
        and all(kind in (KVCache, ArraysCache) for kind in kinds)
    )
