"""Prompt lookup: propose what followed the previous occurrence of the last n-gram."""

from __future__ import annotations

import mlx.core as mx

from .protocol import Draw, GoOn, Proposal, Verdict


class LookupDrafter:
    """Free to run and often right on summarisation, extraction and code edits, where the
    output copies the prompt. Its drafts are guesses (q None: a point mass), so exactness
    holds unchanged: accept with probability p(x), else resample from p with x removed.
    """

    name = "lookup"
    free = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2):
        # One token matches somewhere in almost any long text, and what followed it there
        # seldom follows here: on prose such guesses kept lookup looking (and losing).
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.start([])

    def start(self, context: list[int]) -> None:
        self.history: list[int] = []
        # n -> {n-gram: where its latest occurrence with a token after it starts}. Kept as
        # the text grows, so a round's lookup is a few dict reads, not a scan of the whole
        # text: the policy looks before the next pass starts, so the pass waits on it.
        self.starts: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(self.min_ngram, self.max_ngram + 1)
        }
        self._found: tuple[int, int, list[int]] = (-1, 0, [])  # (history length, g, found)
        self._extend(context)

    def _extend(self, tokens: list[int]) -> None:
        h = self.history
        for token in tokens:
            h.append(token)
            end = len(h) - 1  # the new token follows every n-gram that ends just before it
            for n, starts in self.starts.items():
                if end >= n:
                    starts[tuple(h[end - n : end])] = end - n

    def find(self, g: int) -> list[int]:
        """Up to g tokens that followed the most recent earlier match of the longest
        suffix (of min_ngram to max_ngram tokens); one lookup per round, whatever is asked
        (a shorter proposal is a prefix)."""
        length, longest, found = self._found
        if length == len(self.history) and g <= longest:
            return found[:g]
        h = self.history
        found = []
        for n in range(min(self.max_ngram, len(h) - 1), self.min_ngram - 1, -1):
            start = self.starts[n].get(tuple(h[-n:]))
            if start is not None:
                found = h[start + n : start + n + g]
                break
        self._found = (len(h), g, found)
        return found

    def available(self, g: int) -> int:
        return len(self.find(g))

    def propose(self, g: int, keys: mx.array, draw: Draw, go_on: GoOn | None = None) -> Proposal:
        return Proposal(mx.array(self.find(g), mx.uint32))

    def commit(self, proposal: Proposal | None, verdict: Verdict) -> int:
        self._extend(verdict.emitted)
        return 0


def make(sources: object) -> LookupDrafter:
    """The registered factory: prompt lookup needs neither a model nor the width."""
    return LookupDrafter()
