"""Logits to the processed distribution that both models sample from.

The draft and the target must be processed identically: rejection sampling is exact
for the distribution p that the target *samples from*, so temperature, top-k and top-p
belong inside p (and q), not after it. Temperature 0 is the greedy limit: a one-hot
on the argmax, which makes the same accept/reject code deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .errors import SpecmlxError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise SpecmlxError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SpecmlxError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SpecmlxError(f"top-k must be >= 0 (0 disables it), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: mx.array, params: SamplingParams) -> mx.array:
    """Processed float32 distribution over the last axis of `logits`."""
    logits = logits.astype(mx.float32)
    if params.greedy:
        best = mx.argmax(logits, axis=-1, keepdims=True)
        return (mx.arange(logits.shape[-1]) == best).astype(mx.float32)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = mx.sort(logits, axis=-1)[..., -params.top_k][..., None]
        logits = mx.where(logits < kth, -mx.inf, logits)
    probs = mx.softmax(logits, axis=-1)
    if params.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p.
        descending = -mx.sort(-probs, axis=-1)
        mass_before = mx.cumsum(descending, axis=-1) - descending
        kept = mx.where(mass_before < params.top_p, descending, mx.inf)
        threshold = mx.min(kept, axis=-1, keepdims=True)
        probs = mx.where(probs >= threshold, probs, 0.0)
        probs = probs / mx.sum(probs, axis=-1, keepdims=True)
    return probs


def sample(probs: mx.array, key: mx.array) -> mx.array:
    """One token id per row of `probs` (zeros are never drawn)."""
    return mx.random.categorical(mx.log(probs), key=key).astype(mx.uint32)
