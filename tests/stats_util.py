"""Chi-square goodness of fit with small cells merged, and the target's exact joint
distribution of two tokens: shared by the losslessness tests."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from scipy.stats import chisquare

from specmlx.sampling import SamplingParams, probabilities

ALPHA = 0.001  # significance of every goodness-of-fit test in this suite


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of `counts` (observed) against `probs` (exact), merging cells whose
    expected count is below 5 into one cell (the textbook validity condition)."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    probs = probs / probs.sum()
    expected = probs * counts.sum()
    big = expected >= 5
    obs = list(counts[big])
    exp = list(expected[big])
    if (~big).any():
        obs.append(counts[~big].sum())
        exp.append(expected[~big].sum())
    if exp[-1] < 5 and len(exp) > 2:  # a too-small merged cell joins the smallest big one
        i = int(np.argmin(exp[:-1]))
        obs[i] += obs.pop()
        exp[i] += exp.pop()
    exp = np.array(exp)
    return float(chisquare(np.array(obs), exp * (sum(obs) / exp.sum())).pvalue)


def exact_joint(target, settings: dict, prompt: list[int]) -> np.ndarray:
    """P(first = a, second = b) under the target alone, as a (V, V) array (one batched
    forward over every possible first token)."""
    params = SamplingParams(**settings)
    v = target.vocab_size
    p1 = probabilities(target.module(mx.array([prompt]))[0, -1, :v], params)
    batch = mx.concatenate(
        [mx.broadcast_to(mx.array(prompt), (v, len(prompt))), mx.arange(v)[:, None]], 1
    )
    p2 = probabilities(target.module(batch)[:, -1, :v], params)
    return np.array(p1[:, None] * p2)
