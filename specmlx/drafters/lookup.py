"""Prompt lookup: propose what followed the previous occurrence of the last n-gram."""

from __future__ import annotations

import mlx.core as mx

from .protocol import Draw, GoOn, Proposal, point_mass


class LookupDrafter:
    """Free to run and often right on summarisation, extraction and code edits, where the
    output copies the prompt. Its q is a point mass, so exactness holds unchanged: accept
    with probability p(x), else resample from p with x removed.
    """

    name = "lookup"

    def __init__(self, vocab_size: int, sampled: bool, max_ngram: int = 3, min_ngram: int = 2):
        self.vocab_size = vocab_size
        self.sampled = sampled  # at T > 0 the verify needs q, here a point mass
        # One token matches somewhere in almost any long text, and what followed it there
        # seldom follows here: on prose such guesses kept lookup looking (and losing).
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.history: list[int] = []
        self._found: tuple[int, int, list[int]] = (-1, 0, [])  # (history length, g, found)

    def start(self, context: list[int]) -> None:
        self.history = list(context)

    def find(self, g: int) -> list[int]:
        """Up to g tokens that followed the most recent earlier match of the longest
        suffix (of min_ngram to max_ngram tokens); one scan per round, whatever is asked
        (a shorter proposal is a prefix)."""
        length, longest, found = self._found
        if length == len(self.history) and g <= longest:
            return found[:g]
        h = self.history
        found = []
        for n in range(min(self.max_ngram, len(h) - 1), self.min_ngram - 1, -1):
            tail = h[-n:]
            start = next((s for s in range(len(h) - n - 1, -1, -1) if h[s : s + n] == tail), None)
            if start is not None:
                found = h[start + n : start + n + g]
                break
        self._found = (len(h), g, found)
        return found

    def propose(self, g: int, key: mx.array, draw: Draw, go_on: GoOn | None = None) -> Proposal:
        tokens = mx.array(self.find(g), mx.uint32)
        return Proposal(tokens, point_mass(tokens, self.vocab_size) if self.sampled else None)

    def commit(self, proposal: Proposal | None, accepted: int, emitted: list[int]) -> int:
        self.history += emitted
        return 0
