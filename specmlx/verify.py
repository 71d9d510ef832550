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


@lru_cache(maxsize=16)
def make_tree_verifier(params: SamplingParams, vocab_size: int):
    """Compiled: (logits (g+1, V'), drafts, parent_rows, ancestors, depths, row keys) ->
    accept_tree's (n, token, row), over the first `vocab_size` logits of each row, the
    target's token at a row being its argmax (greedy) or its coupled draw with the key
    of the row's position (row keys (g+1, 2))."""
    if params.greedy:

        def chosen(logits, keys):
            return argmax(logits, vocab_size)
    else:

        def chosen(logits, keys):
            return own_draws(probabilities(logits[:, :vocab_size], params), keys)

    def judge(logits, drafts, parent_rows, ancestors, depths, keys):
        return accept_tree(chosen(logits, keys), drafts, parent_rows, ancestors, depths)

    return mx.compile(judge)
