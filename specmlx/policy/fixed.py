"""A fixed γ: the first drafter with something to offer drafts up to γ each round."""

from __future__ import annotations

from ..drafters.protocol import Drafter, available
from .round import Plan, RoundSummary


class FixedGamma:
    def __init__(self, gamma: int, drafters: list[Drafter]):
        self.gamma, self.drafters = gamma, drafters
        self.helpers: list[Drafter] = []

    def plan(self, remaining: int, context: int = 0) -> Plan:
        for drafter in self.drafters if self.gamma else []:
            offer = min(self.gamma, available(drafter, self.gamma))
            if offer:  # prompt lookup proposes only what the context offers
                return Plan(drafter, offer)
        return Plan(None, 0)

    def observe(self, round: RoundSummary) -> None:
        pass

    def while_running(self) -> None:
        pass

    def finish(self) -> None:
        pass
