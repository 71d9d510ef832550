"""Logits to the processed distribution that both models sample from.

The draft and the target must be processed identically: rejection sampling is exact
for the distribution p that the target *samples from*, so temperature, top-k and top-p
belong inside p (and q), not after it. Temperature 0 is the greedy limit: a one-hot
on the argmax, which makes the same accept/reject code deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .cpu import softmax
from .errors import SpecmlxError

# The least top-p the sampler can act on: it compares top-p with float32 sums, and a value
# under float32's smallest normal number rounds to 0 there (or is a subnormal that a GPU
# flushes to 0), which keeps no token at all and samples token 0 forever.
SMALLEST_TOP_P = float(np.finfo(np.float32).tiny)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    # Coupled sampling (settings.SAMPLINGS): each output position's randomness is keyed by
    # (seed, position), and a draft passes where it equals the target's own draw there.
    coupled: bool = False

    def __post_init__(self):
        if not self.temperature >= 0:
            raise SpecmlxError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SpecmlxError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_p < SMALLEST_TOP_P:
            raise SpecmlxError(
                f"top-p {self.top_p:g} is below {SMALLEST_TOP_P:.2g}, the least float32 sampling "
                "can tell from 0; give a larger one (any top-p this small keeps just the most "
                "likely token)"
            )
        if self.top_k < 0:
            raise SpecmlxError(f"top-k must be >= 0 (0 disables it), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# How tokens are drawn when speculating at temperature > 0 (settings.SAMPLINGS).
# "rejection": modified rejection sampling (accept a draft with min(1, p/q), else
# resample from the residual), which accepts the most drafts a draft can earn, its
# randomness split round by round: a seed repeats a text only where the rounds repeat.
# "coupled": the target draws each position's token by inverse CDF from uniforms keyed
# by (seed, position), the draft from the same uniforms, and a draft passes where the two
# draws agree; every token is the target's own draw, so a seed gives one text whatever
# the rounds were, equal to the target alone's at that seed.
#
# The keys of each block of this many output positions come from one split, so a
# position's key never depends on how many tokens the call asked for.
KEYS_PER_BLOCK = 4096
KEY_BLOCKS = 1024


def position_keys(seed: int):
    """keys(start, count) -> (count, 2): the random key of each output position from
    `start` on, a function of (seed, position) alone."""
    blocks = mx.random.split(mx.random.key(seed), KEY_BLOCKS)
    made: dict[int, mx.array] = {}

    def block(j: int) -> mx.array:
        if j >= KEY_BLOCKS:
            raise SpecmlxError(f"coupled sampling keys {KEYS_PER_BLOCK * KEY_BLOCKS} positions")
        if j not in made:
            made[j] = mx.random.split(blocks[j], KEYS_PER_BLOCK)
        return made[j]

    def keys(start: int, count: int) -> mx.array:
        parts, t = [], start
        while t < start + count:
            j, i = divmod(t, KEYS_PER_BLOCK)
            take = min(start + count - t, KEYS_PER_BLOCK - i)
            parts.append(block(j)[i : i + take])
            t += take
        return parts[0] if len(parts) == 1 else mx.concatenate(parts)

    return keys


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
    probs = softmax(logits)
    if params.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p.
        descending = -mx.sort(-probs, axis=-1)
        mass_before = mx.cumsum(descending, axis=-1) - descending
        kept = mx.where(mass_before < params.top_p, descending, mx.inf)
        threshold = mx.min(kept, axis=-1, keepdims=True)
        probs = mx.where(probs >= threshold, probs, 0.0)
        probs = probs / mx.sum(probs, axis=-1, keepdims=True)
    return probs


# Tokens per block of sample()'s two-stage inverse CDF.
BLOCK = 256


def sample(probs: mx.array, key: mx.array) -> mx.array:
    """One token id per row of `probs` (..., V), drawn from the row normalised; a token of
    probability zero is never drawn.

    By inverse CDF, one uniform draw per stage: MLX's exp, log and random bits are scalar
    on a CPU, so Gumbel noise (mx.random.categorical) draws a uniform and takes two logs
    for every token of the vocabulary, every row, where this draws two uniforms a row and
    otherwise only adds: a sampled row stops being a visible share of a draft pass or a
    verify (bench/results/ARCHIVE.md, `auto-vs-fixed-int4-humaneval-10`).
    """
    u = uniforms(key, probs.shape[:-1])
    return inverse_cdf(probs, u[0], u[1])


def uniforms(key: mx.array, rows: tuple[int, ...]) -> mx.array:
    """(2, *rows) uniforms in (0, 1] from `key`: sample()'s two stages for each row. Coupled
    verification draws a row's with its position's key exactly as a plain step does."""
    return 1.0 - mx.random.uniform(shape=(2, *rows), key=key)


def inverse_cdf(probs: mx.array, u_block: mx.array, u_token: mx.array) -> mx.array:
    """The token where each row's running mass first reaches u ∈ (0, 1] of its total, in
    two stages: a block of BLOCK tokens by the blocks' masses (u_block), then a token within
    it (u_token). A single float32 running sum over the whole vocabulary would round off
    every token below half an ulp of the sum so far (3e-8 near 1: up to 0.5% of the mass
    over 152k tokens); in short sums the loss stays below 3e-5, less than Gumbel noise
    drawn from float32 uniforms leaves out."""
    *lead, size = probs.shape
    padded = mx.pad(probs, [(0, 0)] * len(lead) + [(0, -size % BLOCK)])
    blocks = padded.reshape(*lead, -1, BLOCK)
    # The first entry whose running mass reaches u of the total: it has mass of its own.
    running = mx.cumsum(mx.sum(blocks, axis=-1), axis=-1)
    b = mx.sum(running < u_block[..., None] * running[..., -1:], axis=-1)
    block = mx.take_along_axis(blocks, b[..., None, None], axis=-2).squeeze(-2)
    running = mx.cumsum(block, axis=-1)
    t = mx.sum(running < u_token[..., None] * running[..., -1:], axis=-1)
    return (b * BLOCK + t).astype(mx.uint32)
