"""Trees in the γ policy: the best tree of drafts for a budget, by a model of acceptance.

Sequoia's positional acceptance: once the verify's walk has reached a node, the chance
that it takes the node's child of rank r (0: the first tried) depends on r alone, and
for the first child on its depth too, as a chain's drafts do (Acceptance.by_position):
m(0, i) = α_i, m(r, i) = (1 - α_i) (1 - c_1) ... (1 - c_(r-1)) c_r, where c_r is the
chance that a later sibling passes once those before it failed (Acceptance.siblings).
A node is on the accepted path with the product of m along its path, its score, and a
tree's expected accepted drafts are the sum of its nodes' scores.

The best tree of n nodes: Sequoia finds it by a dynamic program; here a greedy expansion
by marginal gain. From the root's first child, the frontier node (a node's first child,
or the next sibling of a node) with the highest score is added, one at a time. Where the
scores fall with rank (m(r + 1, i) <= m(r, i), as for a drafter that ranks its
candidates well), the nodes added are the n best of the unbounded tree, a set closed
under parents and earlier siblings, which makes the greedy tree the best of its size;
where they do not it is a good tree, never an invalid one. Each prefix of the order of
addition is itself a tree, so the engine can cut a shape to fewer nodes and keep the
best of that size.
"""

from __future__ import annotations

import heapq

MAX_WIDTH = 4  # the most children of one node a tree is planned with


def rank_chance(alpha: float, later: list[float], rank: int) -> float:
    """m(rank, i) for a depth whose first child passes with `alpha`: the chance that the
    child of this rank is the one accepted, given the walk reached its parent."""
    if rank == 0:
        return alpha
    missed = 1.0 - alpha
    for c in later[: rank - 1]:
        missed *= 1.0 - c
    return missed * later[rank - 1]


def grow_shape(
    alphas: list[float], later: list[float], nodes: int, width: int = MAX_WIDTH
) -> tuple[list[int], list[float]]:
    """(parents, scores) of the greedy tree of `nodes` nodes at most len(alphas) deep and
    `width` wide, in the order they were added: each prefix is the greedy tree of its
    size. alphas: α_i per depth; later: c_r for ranks 1 .. width - 1."""
    width = min(width, len(later) + 1)
    frontier = [(-alphas[0], 0, -1, 0, 0)] if alphas else []  # (-score, order, parent, rank, depth)
    parents: list[int] = []
    scores: list[float] = []
    order = 1
    while frontier and len(parents) < nodes:
        negative, _, parent, rank, depth = heapq.heappop(frontier)
        node = len(parents)
        parents.append(parent)
        scores.append(-negative)
        above = 1.0 if parent < 0 else scores[parent]
        if rank + 1 < width:
            sibling = above * rank_chance(alphas[depth], later, rank + 1)
            heapq.heappush(frontier, (-sibling, order, parent, rank + 1, depth))
            order += 1
        if depth + 1 < len(alphas):
            child = scores[node] * alphas[depth + 1]
            heapq.heappush(frontier, (-child, order, node, 0, depth + 1))
            order += 1
    return parents, scores
