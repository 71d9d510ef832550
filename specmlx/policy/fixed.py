"""A fixed γ: the draft model drafts γ each round; prompt lookup what it finds."""

from __future__ import annotations

from ..drafters import LookupDrafter, ModelDrafter
from .round import Plan, Round


class FixedGamma:
    def __init__(self, gamma: int, model: ModelDrafter | None, lookup: LookupDrafter | None):
        self.gamma, self.model, self.lookup = gamma, model, lookup

    def plan(self, remaining: int) -> Plan:
        if self.gamma == 0:
            return Plan(None, 0)
        found = self.lookup.find(self.gamma) if self.lookup is not None else []
        if self.lookup is not None and (found or self.model is None):
            return Plan(self.lookup, len(found))  # it proposes only what the context offers
        return Plan(self.model, self.gamma)

    def observe(self, round: Round) -> None:
        pass

    def while_running(self) -> None:
        pass

    def finish(self) -> None:
        pass
