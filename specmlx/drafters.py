"""Where draft tokens come from.

A drafter proposes g tokens with the distributions q they were drawn from, then is
told how many the target accepted so it can roll its own state back. The accept/reject
rule (verify.accept_reject) is the same for every drafter.
"""

from __future__ import annotations

import mlx.core as mx

from .caches import PREFILL_STEP, align_cache, make_cache, prefill, timed_pass, trim
from .loading import Model


class ModelDrafter:
    """A small model that samples g tokens autoregressively from its own q.

    Its KV cache persists across generate() calls of a Session, like the target's.
    """

    def __init__(self, model: Model):
        self.model = model
        self.cache = make_cache(model.module)
        self.cached: list[int] = []  # tokens whose KV entries are in the cache
        self.pending: list[int] = []  # emitted tokens not yet fed to the draft
        self.backlog = 0  # tokens the last proposal had to catch up on first
        self.proposals = 0  # made in this Session

    def prefill(self, tokens: list[int]) -> None:
        """Line the cache up with `tokens`; what it lacks is fed lazily, at the first
        proposal, so a call that never drafts (auto γ = 0) never pays for it."""
        keep = align_cache(self.model, self.cache, self.cached, tokens[:-1])
        self.pending = tokens[keep:]

    def catch_up(self) -> int:
        """Feed all pending tokens but the last through the draft; return how many."""
        backlog, self.pending = self.pending[:-1], self.pending[-1:]
        prefill(self.model, self.cache, backlog)
        self.cached += backlog
        return len(backlog)

    def time_pass(self) -> float:
        """Seconds for one one-token pass, the cache left as it was: the draft's cost now,
        without taking what it missed (best of two: a process's first pass pays one-time
        work, and one pass can meet a burst of load)."""
        token = (self.cached or self.pending)[-1:]
        return min(timed_pass(self.model, self.cache, token) for _ in range(2))

    def propose(self, g: int, key: mx.array, draw, go_on=None) -> tuple[mx.array, mx.array | None]:
        """(g,) tokens and their (g, V) distributions, lazily (nothing is synced here
        unless `go_on` is given).

        `draw(logits, key) -> (probs, token)` is the compiled sampler for this call; its
        probs are None at temperature 0, and so is the second array returned.
        `go_on(logits, probs) -> bool`, when given, is shown each draft as it is made
        (which syncs every pass) and ends the proposal early by returning False: then
        fewer than g tokens come back. It sees the last draft too.
        """
        self.proposals += 1
        self.backlog = len(self.pending) - 1
        if self.backlog >= PREFILL_STEP:  # a long wait: feed it in bounded chunks first
            self.catch_up()
        # What the draft missed (the last accepted draft, plain rounds) rides with the
        # token it drafts from: one pass over a few tokens costs little more than one.
        self.cached += self.pending
        x = mx.array(self.pending, mx.uint32)
        tokens, qs = [], []
        for k in mx.random.split(key, g):
            logits = self.model.module(x[None], cache=self.cache)[:, -1, :]
            q, x = draw(logits, k)
            mx.async_eval(x)
            tokens.append(x)
            qs.append(q)
            if go_on is not None and not go_on(logits, q):
                break
        self.pending = []
        return mx.concatenate(tokens), None if qs[0] is None else mx.concatenate(qs)

    def rollback(self, g: int, n: int, drafts: list[int], emitted: list[int]) -> None:
        """The target accepted n of the g > 0 `drafts`, then emitted `emitted`."""
        # The draft fed d_1..d_{g-1} through itself; d_g was sampled but never fed.
        self.cached += drafts[: g - 1]
        if n == g:
            self.pending = emitted[-2:]  # [d_g, the bonus token]
        else:
            trim(self.cache, g - 1 - n)
            del self.cached[len(self.cached) - (g - 1 - n) :]
            self.pending = emitted[-1:]


class LookupDrafter:
    """Prompt lookup: propose what followed the previous occurrence of the last n-gram.

    Free to run and often right on summarisation, extraction and code edits, where the
    output copies the prompt. Its q is a point mass, so exactness holds unchanged:
    accept with probability p(x), else resample from p with x removed.
    """

    def __init__(self, tokens: list[int], max_ngram: int = 3):
        self.history = list(tokens)
        self.max_ngram = max_ngram

    def find(self, g: int) -> list[int]:
        """Up to g tokens that followed the most recent earlier match of the longest suffix."""
        h = self.history
        for n in range(min(self.max_ngram, len(h) - 1), 0, -1):
            tail = h[-n:]
            for start in range(len(h) - n - 1, -1, -1):
                if h[start : start + n] == tail:
                    return h[start + n : start + n + g]
        return []

    def extend(self, emitted: list[int]) -> None:
        self.history += emitted


def point_mass(drafts: mx.array, vocab_size: int) -> mx.array:
    """The one-hot q of drafts that are guesses rather than samples (lookup, probes)."""
    return (mx.arange(vocab_size)[None] == drafts[:, None]).astype(mx.float32)
