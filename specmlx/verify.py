"""Modified rejection sampling: the accept/reject rule of speculative decoding.

Given draft tokens d_1..d_g drawn from the draft's distributions q_1..q_g and the
target's distributions p_1..p_{g+1} at the same positions (one forward pass):

  accept d_i with probability min(1, p_i(d_i) / q_i(d_i)), in order, stopping at the
  first rejection; at a rejection at position i, emit a token from the residual
  norm(max(0, p_i - q_i)); if all g are accepted, emit a bonus token from p_{g+1}.

Each emitted token is then distributed exactly as p (Leviathan et al. 2023, Thm 1;
Chen et al. 2023). Everything happens on the device for the whole round at once.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from .cpu import argmax
from .sampling import SamplingParams, inverse_cdf, probabilities, sample, uniforms


def accept_reject(
    p: mx.array, q: mx.array, draft_tokens: mx.array, key: mx.array
) -> tuple[mx.array, mx.array]:
    """Return (number of accepted drafts n, the token emitted after them).

    p: (g+1, V) target distributions; q: (g, V) draft distributions; draft_tokens: (g,).
    A point-mass q (prompt-lookup drafts) is the special case q_i = onehot(d_i).
    """
    g = draft_tokens.shape[0]
    accept_key, residual_key = mx.random.split(key)
    rows = mx.arange(g)
    p_d = p[rows, draft_tokens]
    q_d = q[rows, draft_tokens]
    # u < p/q written as u*q < p: no division, and p = 0 never accepts.
    u = mx.random.uniform(shape=(g,), key=accept_key)
    accepted = (u * q_d < p_d).astype(mx.int32)
    n = mx.sum(mx.cumprod(accepted))
    # Row i < g: residual after rejecting at i. Row g: the bonus distribution p_{g+1}.
    residual = mx.concatenate([mx.maximum(p[:g] - q, 0.0), p[g:]], axis=0)[n]
    mass = mx.sum(residual)
    # A rejection only happens where p(d) < q(d), so the residual has mass; guard
    # against float underflow anyway by falling back to p itself.
    residual = mx.where(mass > 0, residual / mass, p[n])
    return n, sample(residual, residual_key)


def accept_greedy(
    logits: mx.array, draft_tokens: mx.array, vocab_size: int | None = None
) -> tuple[mx.array, mx.array]:
    """accept_reject's temperature-0 limit, computed from argmaxes alone (over the first
    `vocab_size` logits of each row, all by default).

    With one-hot p and q, d_i is accepted exactly when it is the target's argmax, the
    residual at a rejection is one-hot on that argmax, and so is the bonus. The result is
    the same (tested); it just skips V-sized distributions and random draws, a real share
    of a round on a CPU (MLX's exp and random bits are scalar there).
    """
    best = argmax(logits, vocab_size)
    g = draft_tokens.shape[0]
    n = mx.sum(mx.cumprod((draft_tokens == best[:g]).astype(mx.int32)))
    return n, best[n]


@lru_cache(maxsize=32)  # compiled functions are reused across generate() calls
def make_verifier(params: SamplingParams, vocab_size: int):
    """Compiled: (target logits of one round (g+1, V'), q (g, V), drafts (g,), key) ->
    (n accepted, next token, the target's processed distributions p (g+1, V)). At
    temperature 0, q may be None (it is not needed), and so is p. Coupled (params.coupled),
    q is not needed either and `key` is the positions' keys (g+1, 2): accept_coupled.

    Logits beyond `vocab_size` (embedding padding) are dropped before processing, so
    draft and target are compared over the shared tokenizer vocabulary.
    """
    if params.greedy:
        greedy = mx.compile(lambda logits, drafts: accept_greedy(logits, drafts, vocab_size))
        return lambda logits, q, draft_tokens, key: (*greedy(logits, draft_tokens), None)
    if params.coupled:

        def coupled(logits: mx.array, draft_tokens: mx.array, keys: mx.array):
            p = probabilities(logits[:, :vocab_size], params)
            return (*accept_coupled(p, draft_tokens, keys), p)

        compiled = mx.compile(coupled)
        return lambda logits, q, draft_tokens, keys: compiled(logits, draft_tokens, keys)

    def verify(logits: mx.array, q: mx.array, draft_tokens: mx.array, key: mx.array):
        p = probabilities(logits[:, :vocab_size], params)
        return (*accept_reject(p, q, draft_tokens, key), p)

    return mx.compile(verify)


@lru_cache(maxsize=32)
def make_sampler(params: SamplingParams, vocab_size: int):
    """Compiled: logits (1, V') -> (processed distribution (1, V), sampled token (1,)).

    At temperature 0 the distribution is None: the token is the argmax, and nothing
    downstream needs the one-hot (see accept_greedy).
    """
    if params.greedy:
        best = mx.compile(lambda logits: argmax(logits, vocab_size))
        return lambda logits, key: (None, best(logits))

    def draw(logits: mx.array, key: mx.array):
        probs = probabilities(logits[:, :vocab_size], params)
        return probs, sample(probs, key)

    compiled = mx.compile(draw)
    if not params.coupled:
        return compiled

    def coupled(logits: mx.array, key: mx.array):
        return compiled(logits, key)

    # A draft coupled to the target must draw over the same vocabulary, in the same order:
    # a drafter whose head covers fewer tokens widens its logits for this draw.
    coupled.full_width = True
    return coupled


def top_probability(
    logits: mx.array, probs: mx.array | None, vocab_size: int, scratch: np.ndarray | None = None
) -> float:
    """The top probability of one distribution: at a plain step, what the γ policy reads as
    a forecast of draft acceptance (policy/); at a draft, what ends a round early.
    `probs`: what make_sampler drew from (None at temperature 0, where the top of the
    unprocessed softmax is read instead)."""
    return top_probabilities(logits, probs, 1, vocab_size, scratch)[0]


def top_probabilities(
    logits: mx.array,
    probs: mx.array | None,
    rows: int,
    vocab_size: int,
    scratch: np.ndarray | None = None,
) -> list[float]:
    """The top probability of each of the first `rows` rows: of `probs` (rows, V), the
    distributions sampled from, or, where they are None (temperature 0), of the softmax of
    the first `vocab_size` `logits` (rows, V').

    On the host: MLX's exp and reductions are scalar on a CPU, numpy's vectorised, and
    into a reused `scratch` of vocab_size float32s (fresh memory right after a forward
    pass page-faults, and costs several times the read).
    """
    if probs is not None:
        return np.asarray(probs).reshape(-1, probs.shape[-1])[:rows].max(axis=-1).tolist()
    if logits.dtype != mx.float32:  # numpy has no bfloat16
        logits = logits.astype(mx.float32)
    tops = []
    for x in np.asarray(logits).reshape(-1, logits.shape[-1])[:rows, :vocab_size]:
        shifted = np.subtract(x, x.max(), out=scratch)
        np.exp(shifted, out=shifted)
        # a dot with ones sums in BLAS, faster than numpy's pairwise float32 sum
        tops.append(float(1.0 / shifted.dot(_ones(shifted.size))))
    return tops


@lru_cache(maxsize=4)
def _ones(size: int) -> np.ndarray:
    return np.ones(size, np.float32)


def accept_coupled(
    p: mx.array, draft_tokens: mx.array, keys: mx.array
) -> tuple[mx.array, mx.array]:
    """Coupled sampling's rule (settings.SAMPLINGS): the target draws its own token at each
    of the g+1 positions from its key there (as a plain step does), and a draft passes
    where it equals that draw. Returns (n accepted, the target's draw after them).

    p: (g+1, V) target distributions; keys: (g+1, 2), one per position. Every emitted
    token is the target's own draw, so the output is the target's distribution exactly,
    and the same tokens a plain decode at these keys gives."""
    drawn = own_draws(p, keys)
    g = draft_tokens.shape[0]
    n = mx.sum(mx.cumprod((draft_tokens == drawn[:g]).astype(mx.int32)))
    return n, drawn[n]


def own_draws(p: mx.array, keys: mx.array) -> mx.array:
    """(rows,) the token sample() draws from each row of p with that row's key: what a
    plain step at that position draws (each row's uniforms drawn as sample() draws a
    one-row distribution's, then one inverse CDF over all the rows)."""
    u = mx.concatenate([uniforms(keys[i], (1,)) for i in range(p.shape[0])], axis=1)
    return inverse_cdf(p, u[0], u[1])


def accept_tree(
    chosen: mx.array,
    draft_tokens: mx.array,
    parent_rows: mx.array,
    ancestors: mx.array,
    depths: mx.array,
) -> tuple[mx.array, mx.array, mx.array]:
    """A tree of drafts judged against the target's own token at each pass row, `chosen`
    (g+1,): its argmax (greedy) or its coupled draw. Returns (accepted depth n, the
    target's token after them, the pass row of the deepest accepted node, 0 for none).

    parent_rows (g,): each node's parent's pass row; ancestors (g, g) float, 1 where node
    k is node j or above it; depths (g,). A node passes where its token is the target's
    at its parent and every node above it passed; the deepest passing node wins (the
    first of equals: the drafter's preferred branch). A chain gives the chain rule.
    """
    wrong = (draft_tokens != chosen[parent_rows]).astype(mx.float32)
    passed = (ancestors @ wrong) == 0
    score = mx.where(passed, depths, 0)
    n = mx.max(score)
    row = mx.where(n > 0, mx.argmax(score) + 1, 0)
    return n, chosen[row], row


def accept_tree_reject(
    p: mx.array,
    q: mx.array,
    draft_tokens: mx.array,
    parent_rows: mx.array,
    ranks: mx.array,
    ancestors: mx.array,
    depths: mx.array,
    key: mx.array,
) -> tuple[mx.array, mx.array, mx.array]:
    """Multi-candidate rejection sampling on a tree (SpecInfer's multi-step speculative
    sampling; Recursive Speculative Decoding where siblings are drawn without
    replacement). Returns accept_tree's (accepted depth n, the token emitted after them,
    the pass row of the deepest accepted node, 0 for none).

    The walk starts at the root with p' = p at its row and tries its children in order:
    child x passes with min(1, p'(x) / q_x(x)); on a rejection p' <- norm(max(0, p' - q_x))
    and the next child is tried; the first to pass is taken and the walk goes on from its
    row with p' = p there. Where every child fails (or there is none) the token is drawn
    from p' as it stands: the residual, or at a leaf p itself (the bonus).

    Exact when each node's q row is the distribution its token was drawn from given
    everything drawn before it: one step of rejection sampling of target p' with proposal
    q emits x with min(p', q)(x) and rejects with Σ max(0, p' - q), so if what follows a
    rejection emits norm(max(0, p' - q)), whatever that is drawn from, p' is emitted
    exactly; by induction over the siblings, and over the rows of the walk, every emitted
    token follows the target's p. Siblings that are:
    - independent draws from the drafter's distribution d (with replacement): q = d each;
    - draws without replacement (RSD): the i-th sibling's q is d with the siblings before
      it zeroed, renormalised (drafters.treedraft.without_replacement). A rejected x has
      p'(x) < q(x), so its residual has p'(x) = 0: nothing is lost by never drawing x
      again, and a sibling judged against d instead of its own q would be accepted too
      often (tested: the check rejects that);
    - guesses, not draws (prompt lookup, top-k): point masses, q = onehot(x); a
      rejection then removes x from p'.
    Duplicate siblings waste a node but stay exact (a second x meets p'(x) = 0).

    p (g+1, V): the target's distributions at the pass rows; q (g, V); draft_tokens (g,);
    parent_rows (g,): each node's parent's pass row; ranks (K, g): one-hot of each node's
    place among its siblings (tree.ranks; K the most children of any row); ancestors and
    depths as accept_tree's. Every row's siblings are tried rank by rank at once, so the
    loop runs K times whatever the tree's size, and nothing leaves the device.
    """
    g = draft_tokens.shape[0]
    accept_key, residual_key = mx.random.split(key)
    # u < p'/q written as u*q < p': no division, and p' = 0 never accepts (as accept_reject)
    u = mx.random.uniform(shape=(g,), key=accept_key)
    q_d = q[mx.arange(g), draft_tokens]
    # (g+1, g): 1 where node j is row r's child. The logical ops are mx functions, not
    # operators: MLX 0.32's vmap (the tests' batches) mishandles bitwise ops on booleans.
    child_of = (mx.arange(g + 1)[:, None] == parent_rows[None, :]).astype(mx.float32)
    residual, chosen = p, mx.zeros((g,), mx.float32)
    taken = mx.zeros((g + 1,), mx.float32)  # rows where a child has passed
    for rank in range(ranks.shape[0]):
        at = child_of * ranks[rank][None, :]  # row -> its child of this rank
        tried = mx.logical_and(ranks[rank] > 0, taken[parent_rows] == 0)
        passes = mx.logical_and(tried, u * q_d < residual[parent_rows, draft_tokens])
        chosen = mx.maximum(chosen, passes.astype(mx.float32))
        taken = mx.maximum(taken, at @ passes.astype(mx.float32))
        residual = _after_rejection(residual, at @ q, mx.sum(at, axis=1) > 0)
    passed = (ancestors @ (1 - chosen)) == 0
    score = mx.where(passed, depths, 0)
    n = mx.max(score)
    row = mx.where(n > 0, mx.argmax(score) + 1, 0)
    return n, sample(residual[row], residual_key), row


def _after_rejection(residual: mx.array, q: mx.array, rows: mx.array) -> mx.array:
    """norm(max(0, p' - q)) at `rows` (those that had a child of this rank), p' elsewhere;
    where the residual has no mass (float underflow: a rejection implies mass), p'."""
    left = mx.maximum(residual - q, 0.0)
    mass = mx.sum(left, axis=-1, keepdims=True)
    return mx.where(mx.logical_and(rows[:, None], mass > 0), left / mass, residual)


@lru_cache(maxsize=16)
def make_tree_verifier(params: SamplingParams, vocab_size: int):
    """Compiled: (logits (g+1, V'), q (g, V) or None, drafts, parent_rows, ranks,
    ancestors, depths, key) -> (n, token, row, p) over the first `vocab_size` logits of
    each row. Greedy and coupled: accept_tree, the target's token at a row being its
    argmax or its coupled draw with the key of the row's position (`key`: row keys
    (g+1, 2)); q and ranks are not needed, and greedy p is None. Rejection sampling:
    accept_tree_reject, with one key."""
    if params.greedy:

        def greedy(logits, drafts, parent_rows, ancestors, depths):
            chosen = argmax(logits, vocab_size)
            return accept_tree(chosen, drafts, parent_rows, ancestors, depths)

        judge = mx.compile(greedy)
        return lambda logits, q, d, rows, ranks, anc, depths, key: (
            *judge(logits, d, rows, anc, depths),
            None,
        )
    if params.coupled:

        def coupled(logits, drafts, parent_rows, ancestors, depths, keys):
            p = probabilities(logits[:, :vocab_size], params)
            return (*accept_tree(own_draws(p, keys), drafts, parent_rows, ancestors, depths), p)

        judge = mx.compile(coupled)
        return lambda logits, q, d, rows, ranks, anc, depths, keys: judge(
            logits, d, rows, anc, depths, keys
        )

    def rejection(logits, q, drafts, parent_rows, ranks, ancestors, depths, key):
        p = probabilities(logits[:, :vocab_size], params)
        return (*accept_tree_reject(p, q, drafts, parent_rows, ranks, ancestors, depths, key), p)

    return mx.compile(rejection)
