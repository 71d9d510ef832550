"""Drafting a tree: several candidates at the positions where the drafter is unsure.

`grow` is what every drafter that scores more than one candidate shares: the draft model
(drafters/model.py) calls it with a step that runs the model over a tree's new nodes; a
feature head can call it with a step that runs the head. It expands the tree EAGLE-2
style: level by level, the drafter's own most probable nodes get children, within the
Shape the policy asked for.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from ..cpu import softmax
from ..sampling import sample
from ..tree import Shape
from .protocol import Draw, Proposal

# Nodes run at each level past a shape's own (Shape.depth, at T = 0): the best two, a
# second line where the first choice is unsure (one kept less: bench/results/trees-zen4.md).
PAST_SHAPE = 2

# step(feed, tokens, parents) -> logits (len(feed), V'): the drafter run over the nodes
# `feed` (ids into `tokens` and `parents`, the tree so far, parents first), each row at
# its depth's position seeing the context and its own ancestors; its logits at each,
# over the full vocabulary (-inf where a drafter over fewer tokens has none).
Step = Callable[[list[int], list[int], list[int]], mx.array]


def grow(
    root: mx.array, step: Step, shape: Shape, keys: mx.array, draw: Draw, width: int
) -> tuple[Proposal, list[int]]:
    """A tree of drafts under the last emitted token, within `shape`, and the nodes it
    kept: their ids as `step` saw them, in the proposal's order.

    root (1, V'): the drafter's logits after the last emitted token. keys (g, 2): a key
    per depth (the engine's per-draft keys; coupled sampling keys each position, and
    every node's first child at depth d is drawn with the key of d, as a chain's draft
    there is). draw: the call's sampler (Proposal's Draw). width: the vocabulary the
    verify compares over.

    Level by level: the drafter's distribution at each node run so far (the root first)
    offers its `shape.width` most probable tokens as children; the children kept are the
    best by the drafter's own probability of their whole path (the parent's times the
    child's rank's probability), as many as the shape has at that depth. Then the kept
    children with the most probable paths, as many as the shape has nodes one deeper,
    are run (one `step`) for the next level. At temperature 0 a node's children are its
    top tokens; above it they are drawn without replacement, the first from `draw`, each
    next one from the distribution with the siblings before it removed, which is also the
    q it is judged with (without_replacement).

    Exact at any temperature: which children a node gets, and how many, is decided from
    its distribution and the paths above it, before they are drawn (only their ranks'
    probabilities are read); never by a drawn child's own value, which would bias the
    kept children toward the drafter's likely tokens (EAGLE-2's final rerank does that;
    it is left out where anything is drawn). Which nodes are run next reads the drawn
    children's values, which only decides where deeper children hang.

    At temperature 0 nothing is drawn, so the tree is free to be EAGLE-2's: every node run
    offers its `shape.width` top tokens, and the shape's node count is kept of all the
    levels' offers, the most probable paths (a path is never more probable than its
    parent's, so they form a tree). The drafter then puts its nodes where it is unsure, at
    any depth the shape runs to (`shape.depth` where that is deeper: past its own levels the
    best PAST_SHAPE nodes of each are run): a chain where it is sure, siblings where it is
    not. The passes are the shape's, less the nodes no kept path could pass through.
    """
    tokens: list[int] = []
    parents: list[int] = []
    qs: list[mx.array] = []
    value: list[float] = []  # the drafter's own probability of each node's path
    feed, logits = [-1], root
    at_depth = shape.at_depth
    for depth in itertools.count():  # until the last level (at_depth may grow at the first)
        room = at_depth[depth]
        rows = [draw(logits[i : i + 1], keys[depth]) for i in range(len(feed))]
        greedy = rows[0][0] is None
        if greedy and not depth:  # past the shape's levels, where it allows more
            at_depth += [PAST_SHAPE] * (min(shape.depth, shape.nodes) - len(at_depth))
        if greedy:
            dist = softmax(logits[:, :width].astype(mx.float32))
        else:
            dist = mx.concatenate([probs for probs, _ in rows])
        best, top = _top(dist, shape.width)
        above = [1.0 if v < 0 else value[v] for v in feed]
        extra = mx.random.split(keys[depth], shape.width)
        level = []
        # at temperature 0 every node run offers its top tokens: the final cut keeps some
        shares = [shape.width] * len(feed) if greedy else _shares(above, top, room)
        for i, share in enumerate(shares):
            if not share:
                continue
            if greedy:
                picked = zip(best[i], top[i], strict=True)
                made = [(int(t), None, above[i] * float(p)) for t, p in picked if p > 0]
            else:
                made = _without_replacement(rows[i], share, extra, above[i])
            for token, q, path_value in made:
                level.append(len(tokens))
                tokens.append(token)
                parents.append(feed[i])
                qs.append(q)
                value.append(path_value)
        if depth + 1 == len(at_depth) or not level:
            break
        feed = sorted(sorted(level, key=lambda j: (-value[j], j))[: at_depth[depth + 1]])
        if greedy:  # a node below the cut could only have children below it
            cut = _best(value, shape.nodes)
            feed = [j for j in feed if value[j] >= value[cut[-1]]]
        if not feed:
            break
        logits = step(feed, tokens, parents)
    if qs[0] is not None:  # sampled: every node drawn stays (which stay was never chosen)
        drawn = Proposal(mx.array(tokens, mx.uint32), mx.stack(qs), parents)
        return drawn, list(range(len(tokens)))
    kept = sorted(_best(value, shape.nodes))
    index = {j: i for i, j in enumerate(kept)}
    parents = [-1 if parents[j] < 0 else index[parents[j]] for j in kept]
    return Proposal(mx.array([tokens[j] for j in kept], mx.uint32), None, parents), kept


def _best(value: list[float], n: int) -> list[int]:
    """The n nodes of the most probable paths, most probable first (the earlier node on a
    tie: a parent before its child, which its path can only equal)."""
    return sorted(range(len(value)), key=lambda j: (-value[j], j))[:n]


def _top(dist: mx.array, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, probabilities) (rows, k): each row's k most probable, most probable first
    (read on the host: the level's one sync)."""
    best = mx.argpartition(-dist, k - 1, axis=-1)[:, :k]
    top = np.array(mx.take_along_axis(dist, best, axis=-1))
    order = np.argsort(-top, axis=-1, kind="stable")
    return np.take_along_axis(np.array(best), order, -1), np.take_along_axis(top, order, -1)


def _shares(above: list[float], top: np.ndarray, room: int) -> list[int]:
    """How many children each node run at this level gets: the `room` best offers, an
    offer being a node's path probability (`above`) times one of its top probabilities.
    A rank without probability (top-k or top-p cut the rest) gets no child: there is
    nothing left to draw it from."""
    offers = sorted(
        (-above[i] * p, i) for i in range(len(above)) for p in top[i].tolist() if p > 0
    )[:room]
    return [sum(1 for _, i in offers if i == row) for row in range(len(above))]


def _without_replacement(row: tuple, count: int, keys: mx.array, above: float) -> list[tuple]:
    """`count` children drawn without replacement from a node's distribution: the first is
    draw's, each next one from the distribution with the earlier ones removed. Returns
    (token, the q it was drawn from, its path's probability) for each."""
    probs, first = row
    probs = probs[0]
    tried = [first.reshape(1)]
    made = [(first, probs)]
    for r in range(1, count):
        q = without_replacement(probs, mx.concatenate(tried))
        token = sample(q, keys[r]).reshape(1)
        tried.append(token)
        made.append((token, q))
    drawn = mx.concatenate(tried)
    at = np.array(probs[drawn]).tolist()
    return [(int(t), q, above * p) for (_, q), t, p in zip(made, drawn.tolist(), at, strict=True)]


def without_replacement(probs: mx.array, tried: mx.array) -> mx.array:
    """`probs` (V,) with the tokens `tried` (k,) zeroed and the rest renormalised: the
    distribution the next sibling is drawn from when siblings are drawn without
    replacement, and so the q the verify must judge it with (Recursive Speculative
    Decoding; verify.accept_tree_reject says why it stays exact)."""
    left = mx.where(mx.any(mx.arange(probs.shape[-1])[None] == tried[:, None], axis=0), 0.0, probs)
    return left / mx.sum(left)


def pass_widths(at_depth: list[int]) -> list[int]:
    """The tokens of each draft pass `grow` makes for a shape of `at_depth` nodes at each
    depth (Shape.at_depth): the first over the last emitted token, then at each level as
    many nodes as the next depth has room for, of those the level has."""
    return [1] + [min(at_depth[d - 1], at_depth[d]) for d in range(1, len(at_depth))]
