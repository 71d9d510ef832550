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

from .sampling import SamplingParams, probabilities, sample


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


@lru_cache(maxsize=32)  # compiled functions are reused across generate() calls
def make_verifier(params: SamplingParams, vocab_size: int):
    """Compiled: target logits of one round (g+1, V') -> (n accepted, next token).

    Logits beyond `vocab_size` (embedding padding) are dropped before processing, so
    draft and target are compared over the shared tokenizer vocabulary.
    """

    def verify(logits: mx.array, q: mx.array, draft_tokens: mx.array, key: mx.array):
        p = probabilities(logits[:, :vocab_size], params)
        return accept_reject(p, q, draft_tokens, key)

    return mx.compile(verify)


@lru_cache(maxsize=32)
def make_sampler(params: SamplingParams, vocab_size: int):
    """Compiled: logits (1, V') -> (processed distribution (1, V), sampled token (1,))."""

    def draw(logits: mx.array, key: mx.array):
        probs = probabilities(logits[:, :vocab_size], params)
        return probs, sample(probs, key)

    return mx.compile(draw)
