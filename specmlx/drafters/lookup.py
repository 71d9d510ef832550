"""Prompt lookup: propose what followed the previous occurrence of the last n-gram."""

from __future__ import annotations

import mlx.core as mx

from ..tree import Shape
from .protocol import Draw, GoOn, Proposal, Verdict

# Earlier occurrences kept per n-gram: each can give a tree a branch of its own.
OCCURRENCES = 4


class LookupDrafter:
    """Free to run and often right on summarisation, extraction and code edits, where the
    output copies the prompt. Its drafts are guesses (q None: a point mass), so exactness
    holds unchanged: accept with probability p(x), else resample from p with x removed.
    Asked for a tree, it proposes what followed each of the matched n-gram's recent
    occurrences (and a shorter n-gram's) as branches: where a text repeats a phrase with
    different endings, one of them is often the right one.
    """

    name = "lookup"
    free = True
    trees = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2):
        # One token matches somewhere in almost any long text, and what followed it there
        # seldom follows here: on prose such guesses kept lookup looking (and losing).
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.start([])

    def start(self, context: list[int]) -> None:
        self.history: list[int] = []
        # n -> {n-gram: where its latest occurrences with a token after them start, the
        # most recent last}. Kept as the text grows, so a round's lookup is a few dict
        # reads, not a scan of the whole text: the policy looks before the next pass
        # starts, so the pass waits on it.
        self.starts: dict[int, dict[tuple[int, ...], list[int]]] = {
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
                    seen = starts.setdefault(tuple(h[end - n : end]), [])
                    seen.append(end - n)
                    del seen[:-OCCURRENCES]

    def find(self, g: int) -> list[int]:
        """Up to g tokens that followed the most recent earlier match of the longest
        suffix (of min_ngram to max_ngram tokens); one lookup per round, whatever is asked
        (a shorter proposal is a prefix)."""
        length, longest, found = self._found
        if length == len(self.history) and g <= longest:
            return found[:g]
        found = next(self._continuations(g), [])
        self._found = (len(self.history), g, found)
        return found

    def _continuations(self, g: int):
        """Up to g tokens after each earlier occurrence of the text's last n tokens: the
        longest n first, the most recent occurrence first."""
        h = self.history
        for n in range(min(self.max_ngram, len(h) - 1), self.min_ngram - 1, -1):
            for start in reversed(self.starts[n].get(tuple(h[-n:]), [])):
                yield h[start + n : start + n + g]

    def branches(self, shape: Shape) -> tuple[list[int], list[int]]:
        """(tokens, parents): the continuations merged into one tree where they share a
        beginning, in the order _continuations gives them (the chain's first), within
        `shape`'s nodes, depth and width."""
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[int, dict[int, int]] = {}  # node -> {token: its child with it}
        for branch in self._continuations(len(shape.at_depth)):
            node = -1
            for token in branch:
                under = children.setdefault(node, {})
                if token not in under:
                    if len(tokens) == shape.nodes or len(under) == shape.width:
                        break
                    under[token] = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                node = under[token]
        return tokens, parents

    def available(self, g: int) -> int:
        return len(self.find(g))

    def propose(
        self,
        g: int,
        keys: mx.array,
        draw: Draw,
        go_on: GoOn | None = None,
        tree: Shape | None = None,
    ) -> Proposal:
        if tree is None:
            return Proposal(mx.array(self.find(g), mx.uint32))
        tokens, parents = self.branches(tree)
        return Proposal(mx.array(tokens, mx.uint32), parents=parents)

    def commit(self, proposal: Proposal | None, verdict: Verdict) -> int:
        self._extend(verdict.emitted)
        return 0


def make(sources: object) -> LookupDrafter:
    """The registered factory: prompt lookup needs neither a model nor the width."""
    return LookupDrafter()
