"""A fixed γ: the first drafter with something to offer drafts up to γ each round; with
a tree size, a drafter that grows trees drafts a tree of that many nodes, γ deep."""

from __future__ import annotations

from ..drafters import grows_trees
from ..drafters.protocol import Drafter, available
from ..tree import Shape
from .acceptance import PRIOR_ALPHA, SIBLING_PRIOR
from .round import Plan, RoundSummary
from .trees import MAX_WIDTH, grow_shape


class FixedGamma:
    def __init__(self, gamma: int, drafters: list[Drafter], trees: int = 0):
        """`trees`: the nodes of each round's tree (0: chains), in the shape that the
        priors of acceptance make best (policy.trees), at most γ deep."""
        self.gamma, self.drafters = gamma, drafters
        self.helpers: list[Drafter] = []
        parents, _ = grow_shape([PRIOR_ALPHA] * gamma, [SIBLING_PRIOR] * (MAX_WIDTH - 1), trees)
        self.shape = Shape(tuple(parents)) if trees > 1 else None

    def plan(self, remaining: int, context: int = 0) -> Plan:
        for drafter in self.drafters if self.gamma else []:
            offer = min(self.gamma, available(drafter, self.gamma))
            if offer and self.shape is not None and grows_trees(drafter):
                return Plan(drafter, self.shape.nodes, tree=self.shape)
            if offer:  # prompt lookup proposes only what the context offers
                return Plan(drafter, offer)
        return Plan(None, 0)

    def observe(self, round: RoundSummary) -> None:
        pass

    def while_running(self) -> None:
        pass

    def finish(self) -> None:
        pass
