"""A fixed γ: the first drafter with something to offer drafts up to γ each round; with
a tree size, a drafter that grows trees drafts a tree of that many nodes, γ deep."""

from __future__ import annotations

from .. import tree
from ..drafters import grows_trees
from ..drafters.protocol import Drafter, available
from ..tree import Shape
from .acceptance import Acceptance
from .round import Plan, RoundSummary
from .trees import MAX_WIDTH, grow_shape


class FixedGamma:
    def __init__(self, gamma: int, drafters: list[Drafter], trees: int = 0):
        """`trees`: the nodes of each round's tree (0: chains), in the shape this text's
        acceptance makes best (policy.trees): learnt from the rounds' walks, as auto
        learns it, so a sure drafter's tree runs deep and an unsure one's wide. It reads
        no clock: the same call makes the same trees."""
        self.gamma, self.drafters, self.trees = gamma, drafters, trees
        self.helpers: list[Drafter] = []
        self.acceptance = Acceptance()

    def shape(self) -> Shape:
        """The tree of `trees` nodes, at most γ deep, with the most drafts expected to
        pass (it may be a chain: where the drafter is sure, depth is worth more)."""
        alphas = self.acceptance.by_position(self.gamma)
        later = self.acceptance.sibling_alphas(MAX_WIDTH - 1)
        return Shape(tuple(grow_shape(alphas, later, self.trees)[0]), depth=self.gamma)

    def plan(self, remaining: int, context: int = 0) -> Plan:
        for drafter in self.drafters if self.gamma else []:
            offer = min(self.gamma, available(drafter, self.gamma))
            if offer and self.trees > 1 and grows_trees(drafter):
                shape = self.shape()
                if not tree.is_chain(list(shape.parents)):
                    return Plan(drafter, shape.nodes, tree=shape)
                offer = min(offer, shape.nodes)
            if offer:  # prompt lookup proposes only what the context offers
                return Plan(drafter, offer)
        return Plan(None, 0)

    def observe(self, round: RoundSummary) -> None:
        if round.parents is not None:
            self.acceptance.observe_tree(tree.walk(round.parents, round.path))
        elif round.drafted and not round.tree_as_chain:
            self.acceptance.observe(round.drafted, round.accepted)

    def while_running(self) -> None:
        pass

    def finish(self) -> None:
        pass
