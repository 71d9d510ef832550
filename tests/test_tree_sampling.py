"""Multi-candidate rejection sampling on trees, alone: the emitted tokens follow the
target's distribution exactly, for trees with 2-4 children at a node whose candidates
are independent draws, draws without replacement, or guesses.

Each case runs N = 100,000 rounds of one tree (vectorised with mx.vmap) over a V = 8
vocabulary, the target's distribution at a node depending on the node's token as a
model's would, and compares the first two emitted tokens (a second drawn from the target
where the round emitted one, as the next round would) with the exact joint p1(a)·p2(b|a)
by a chi-square test at significance 0.001 (cells of expected count < 5 merged). Power:
over at most 64 cells, N = 100,000 rejects with probability > 0.99 any sampler whose
output is a chi-square distance Σ(p' - p)²/p of 9e-4 or more from the exact joint (mass
0.01 moved between two cells of 0.1 is 2e-3); the controls, a sampler that skips the
residual update and siblings drawn without replacement judged without the correction,
are further off than that, and the same check rejects them.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from stats_util import ALPHA, chi_square_pvalue

from specmlx import tree, verify
from specmlx.drafters.treedraft import without_replacement
from specmlx.verify import accept_reject, accept_tree_reject

V, N = 8, 100_000
RNG = np.random.default_rng(11)


def rows(shape, power=2.0):
    x = RNG.random(shape) ** power
    return x / x.sum(-1, keepdims=True)


# The target: p1 at the root, p2[a] after token a, p3[b] after a second token b. The draft:
# d1 at the root, d2[a] after a. Peaked and unlike each other, so that drafts are often
# rejected and later siblings decide much of the output.
P1, P2, P3 = rows(V, 3.0), rows((V, V), 3.0), rows((V, V))
D1, D2 = rows(V, 3.0), rows((V, V), 3.0)
SHAPES = {
    "3 under the root, 2 under its first": [-1, -1, -1, 0, 0, 1],
    "4 under the root, 4 under its first, 2 under its second": [
        *[-1] * 4,
        *[0] * 4,
        1,
        1,
    ],
}
SCHEMES = ("independent draws", "draws without replacement", "guesses")


def draw(probs: np.ndarray, rng) -> np.ndarray:
    """One token per row of probs (N, V)."""
    u = rng.random(len(probs)) * probs.sum(-1)
    return np.minimum((np.cumsum(probs, -1) < u[:, None]).sum(-1), V - 1)


def draft_tree(parents, scheme, corrected=True, seed=0):
    """N trees of the shape `parents`: tokens (N, g), q (N, g, V), the target's p at every
    pass row (N, g + 1, V). `corrected` False: siblings drawn without replacement keep the
    drafter's own q (the wrong variant)."""
    rng = np.random.default_rng(seed)
    g = len(parents)
    tokens = np.zeros((N, g), np.int64)
    q = np.zeros((N, g, V), np.float32)
    for j, parent in enumerate(parents):
        d = np.broadcast_to(D1, (N, V)) if parent < 0 else D2[tokens[:, parent]]
        before = [k for k in range(j) if parents[k] == parent]  # earlier siblings
        if scheme == "guesses":  # the drafter's top choices in order, as point masses
            tokens[:, j] = np.argsort(-d, axis=-1, kind="stable")[:, len(before)]
            q[:, j] = np.eye(V)[tokens[:, j]]
            continue
        if scheme == "independent draws":
            q[:, j] = d
        else:
            tried = mx.array(tokens[:, before]) if before else mx.zeros((N, 0), mx.uint32)
            fixed = mx.vmap(without_replacement)(mx.array(d, mx.float32), tried)
            q[:, j] = np.array(fixed) if corrected else d
            d = np.array(fixed)
        tokens[:, j] = draw(d, rng)
    depth = tree.depths(parents)
    p = [np.broadcast_to(P1, (N, V))]
    p += [P2[tokens[:, j]] if depth[j] == 1 else P3[tokens[:, j]] for j in range(g)]
    return tokens, q, np.stack(p, 1).astype(np.float32)


def first_two(parents, tokens, q, p, seed=0) -> np.ndarray:
    """Counts (V, V) of the first two emitted tokens over the N rounds."""
    g = len(parents)
    ranks = tree.ranks(parents)
    structure = (
        mx.array([x + 1 for x in parents], mx.uint32),
        mx.array([[r == k for r in ranks] for k in range(max(ranks) + 1)], mx.float32),
        mx.array([row[1:] for row in tree.ancestry(parents)[1:]], mx.float32),
        mx.array(tree.depths(parents), mx.int32),
    )
    keys = mx.random.split(mx.random.key(seed), N)

    def judge(p, q, d, key):
        return accept_tree_reject(p, q, d, *structure, key)

    n, token, row = (
        np.array(x)
        for x in mx.vmap(judge)(mx.array(p), mx.array(q), mx.array(tokens, mx.uint32), keys)
    )
    paths = [tree.path_to(parents, j) for j in range(g)]
    emitted = [
        [tokens[i, j] for j in (paths[r - 1] if r else [])] + [token[i]] for i, r in enumerate(row)
    ]
    assert all(len(e) == k + 1 for e, k in zip(emitted, n, strict=True))
    rng = np.random.default_rng(seed + 1)
    firsts = np.array([e[0] for e in emitted])
    seconds = np.array([e[1] if len(e) > 1 else -1 for e in emitted])
    alone = seconds < 0  # the round emitted one token: the next round's is the target's
    seconds[alone] = draw(P2[firsts[alone]], rng)
    counts = np.zeros((V, V))
    np.add.at(counts, (firsts, seconds), 1)
    return counts


EXACT = P1[:, None] * P2


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape", SHAPES)
def test_a_trees_first_two_tokens_follow_the_target(shape, scheme):
    parents = SHAPES[shape]
    counts = first_two(parents, *draft_tree(parents, scheme))
    assert chi_square_pvalue(counts, EXACT) > ALPHA


def test_the_check_rejects_a_sampler_that_never_updates_the_residual(monkeypatch):
    # Each sibling judged against p itself: a second candidate passes as often as if the
    # first had never been tried, and its share of the output grows.
    monkeypatch.setattr(verify, "_after_rejection", lambda residual, q, rows: residual)
    parents = SHAPES["3 under the root, 2 under its first"]
    counts = first_two(parents, *draft_tree(parents, "independent draws"))
    assert chi_square_pvalue(counts, EXACT) < ALPHA


def test_the_check_rejects_draws_without_replacement_judged_without_the_correction():
    parents = SHAPES["4 under the root, 4 under its first, 2 under its second"]
    tree_ = draft_tree(parents, "draws without replacement", corrected=False)
    assert chi_square_pvalue(first_two(parents, *tree_), EXACT) < ALPHA


def test_on_a_chain_the_tree_sampler_is_accept_reject():
    # The same uniforms, the same residual: the same n and the same token, round by round.
    rng = np.random.default_rng(3)
    parents = tree.chain(4)
    structure = (
        mx.array([x + 1 for x in parents], mx.uint32),
        mx.ones((1, 4)),
        mx.array([row[1:] for row in tree.ancestry(parents)[1:]], mx.float32),
        mx.array(tree.depths(parents), mx.int32),
    )
    for i in range(50):
        p, q = mx.array(rows((5, V))), mx.array(rows((4, V)))
        d = mx.array(rng.integers(0, V, 4).astype(np.uint32))
        n, token, row = accept_tree_reject(p, q, d, *structure, mx.random.key(i))
        chain_n, chain_token = accept_reject(p, q, d, mx.random.key(i))
        assert (n.item(), token.item(), row.item()) == (
            chain_n.item(),
            chain_token.item(),
            n.item(),
        )


def test_a_rejected_guess_is_never_emitted_at_its_row():
    # Two guesses under the root that the target never emits: neither passes, and the
    # residual has them removed.
    p = mx.array(np.stack([[0, 0, 0.5, 0.5, 0, 0, 0, 0]] + [rows(V)] * 2).astype(np.float32))
    d = mx.array([0, 1], mx.uint32)
    q = mx.array(np.eye(V)[[0, 1]].astype(np.float32))
    for i in range(20):
        n, token, row = accept_tree_reject(
            p,
            q,
            d,
            mx.array([0, 0], mx.uint32),
            mx.array([[1, 0], [0, 1]], mx.float32),
            mx.eye(2),
            mx.array([1, 1], mx.int32),
            mx.random.key(i),
        )
        assert n.item() == 0 and token.item() in (2, 3)
