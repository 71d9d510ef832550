"""What a request asks of the target's distribution besides temperature, top-k and top-p:
a bias per token (OpenAI's `logit_bias`) and presence and frequency penalties.

A processor maps the target's logits at the positions one pass judges to the logits it
samples from: `processor(logits (R, V), histories)`, where histories[r] are the tokens
generated before row r's token (the call's own output: the prompt never counts, as in
OpenAI's API). The Target applies it before every judgement, plain or speculative, so the
text follows the processed distribution exactly at any temperature, and greedy output
is the processed argmax. A chain's drafts are drawn from the draft's logits processed
alike (Target.draft_draw), so that they stay acceptable; verification is exact for any
q, so this changes only how often drafts are accepted.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

Processor = Callable[[mx.array, list[list[int]]], mx.array]


def logit_bias(bias: dict[int, float]) -> Processor:
    """Add bias[t] to token t's logit at every position."""
    tokens = mx.array(list(bias), mx.uint32)
    values = mx.array(list(bias.values()), mx.float32)

    def process(logits: mx.array, histories: list[list[int]]) -> mx.array:
        add = (
            mx.zeros((logits.shape[-1],), logits.dtype).at[tokens].add(values.astype(logits.dtype))
        )
        return logits + add

    return process


def penalties(presence: float, frequency: float) -> Processor:
    """Subtract, from each token's logit, `presence` if it was generated before this
    position and `frequency` times how often (OpenAI's presence and frequency penalties)."""

    def process(logits: mx.array, histories: list[list[int]]) -> mx.array:
        counts = np.zeros((len(histories), logits.shape[-1]), np.float32)
        for r, history in enumerate(histories):
            np.add.at(counts[r], np.asarray(history, np.int64), 1.0)
        penalty = presence * (counts > 0) + frequency * counts
        return logits - mx.array(penalty).astype(logits.dtype)

    process.reads_history = True
    return process


def reads_history(processor: Processor | None) -> bool:
    """Whether it needs the generated tokens (a plain pass built before its input token is
    known cannot be processed ahead)."""
    return bool(getattr(processor, "reads_history", False))


def combine(processors: list[Processor]) -> Processor | None:
    """One processor applying each in turn; None where there are none."""
    if not processors:
        return None
    if len(processors) == 1:
        return processors[0]

    def process(logits: mx.array, histories: list[list[int]]) -> mx.array:
        for p in processors:
            logits = p(logits, histories)
        return logits

    process.reads_history = any(reads_history(p) for p in processors)
    return process


def make(
    bias: dict[int, float] | None,
    presence: float,
    frequency: float,
    mask: Processor | None = None,
) -> Processor | None:
    """The processor a call's settings ask for (settings.check_processing checked them);
    a grammar's `mask` (constrained.py) goes last, so that nothing lifts a token it forbids."""
    made = []
    if bias:
        made.append(logit_bias(bias))
    if presence or frequency:
        made.append(penalties(presence, frequency))
    if mask is not None:
        made.append(mask)
    return combine(made)
