"""Free guesses that measure the target's cost curve, not the text."""

from __future__ import annotations

import mlx.core as mx

from .protocol import Draw, GoOn, Proposal, point_mass


class CostProbe:
    """Proposes the last token again, g times: a verify pass over g + 1 tokens that costs
    no draft model, for when the γ policy must re-measure T(g + 1) while drafting does
    not pay (the draft model's catch-up on everything it missed would cost more than the
    measurement learns). Whatever of it passes is exact like any other draft."""

    name = "probe"

    def __init__(self, vocab_size: int, sampled: bool):
        self.vocab_size = vocab_size
        self.sampled = sampled
        self.last = 0

    def start(self, context: list[int]) -> None:
        self.last = context[-1]

    def propose(self, g: int, key: mx.array, draw: Draw, go_on: GoOn | None = None) -> Proposal:
        tokens = mx.array([self.last] * g, mx.uint32)
        return Proposal(tokens, point_mass(tokens, self.vocab_size) if self.sampled else None)

    def commit(self, proposal: Proposal | None, accepted: int, emitted: list[int]) -> int:
        self.last = emitted[-1]
        return 0
