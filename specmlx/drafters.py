"""Where draft tokens come from.

A drafter proposes g tokens with the distributions q they were drawn from, then is
told how many the target accepted so it can roll its own state back. The accept/reject
rule (verify.accept_reject) is the same for every drafter.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from .loading import Model
from .sampling import SamplingParams
from .verify import make_sampler


def prefill(model: Model, cache: list, tokens: list[int], step: int = 512) -> None:
    """Run `tokens` through `model` into `cache`, in chunks so memory stays bounded."""
    for start in range(0, len(tokens), step):
        chunk = mx.array(tokens[start : start + step], mx.uint32)[None]
        model.module(chunk, cache=cache)
        mx.eval([c.state for c in cache])


class ModelDrafter:
    """A small model that samples g tokens autoregressively from its own q."""

    def __init__(self, model: Model, params: SamplingParams, vocab_size: int):
        self.model = model
        self.cache = make_prompt_cache(model.module)
        self.draw = make_sampler(params, vocab_size)
        self.pending: list[int] = []  # emitted tokens the draft has not processed yet

    def prefill(self, tokens: list[int]) -> None:
        prefill(self.model, self.cache, tokens[:-1])
        self.pending = tokens[-1:]

    def propose(self, g: int, key: mx.array) -> tuple[mx.array, mx.array]:
        """(g,) tokens and their (g, V) distributions, lazily (nothing is synced here)."""
        x = mx.array(self.pending, mx.uint32)
        tokens, qs = [], []
        for k in mx.random.split(key, g):
            logits = self.model.module(x[None], cache=self.cache)[:, -1, :]
            q, x = self.draw(logits, k)
            mx.async_eval(x)
            tokens.append(x)
            qs.append(q)
        self.pending = []
        return mx.concatenate(tokens), mx.concatenate(qs)

    def rollback(self, g: int, n: int, emitted: list[int]) -> None:
        """The target accepted n of g drafts, then emitted `emitted` (drafts + its own)."""
        if g == 0:
            self.pending += emitted
        elif n == g:
            # d_g was sampled but never fed through the draft: it goes in next round.
            self.pending = emitted[-2:]
        else:
            trim_prompt_cache(self.cache, g - 1 - n)
            self.pending = emitted[-1:]
