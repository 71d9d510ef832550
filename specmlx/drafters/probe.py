"""Free guesses that measure the target's cost curve, not the text."""

from __future__ import annotations

import mlx.core as mx

from .protocol import Drafter, Draw, GoOn, Proposal, Verdict


class CostProbe:
    """Proposes the last token again, g times: a verify pass over g + 1 tokens that costs
    no draft model, for when the γ policy must re-measure T(g + 1) while drafting does
    not pay (the draft model's catch-up on everything it missed would cost more than the
    measurement learns). Whatever of it passes is exact like any other draft.

    With `retime` set (by the policy that owns it), the probe also times one pass of that
    drafter, so that a figure taken in a burst of load does not keep it out for good."""

    name = "probe"
    free = True

    def __init__(self) -> None:
        self.last = 0
        self.retime: Drafter | None = None

    def start(self, context: list[int]) -> None:
        self.last = context[-1]

    def propose(self, g: int, keys: mx.array, draw: Draw, go_on: GoOn | None = None) -> Proposal:
        timed = None
        if self.retime is not None:
            timed, self.retime = self.retime.time_pass(), None
        return Proposal(mx.array([self.last] * g, mx.uint32), timed_draft_s=timed)

    def commit(self, proposal: Proposal | None, verdict: Verdict) -> int:
        self.last = verdict.token
        return 0
