"""The processed distribution that both models sample from."""

import mlx.core as mx
import numpy as np
import pytest
from stats_util import ALPHA, chi_square_pvalue

from specmlx.errors import SpecmlxError
from specmlx.sampling import (
    BLOCK,
    SMALLEST_TOP_P,
    SamplingParams,
    inverse_cdf,
    probabilities,
    sample,
)

LOGITS = mx.array([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def test_greedy_is_a_one_hot_on_the_argmax():
    p = probabilities(LOGITS, SamplingParams(temperature=0))
    assert p.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0, 0.0]]


def test_temperature_one_is_the_softmax():
    p = probabilities(LOGITS, SamplingParams(temperature=1.0))
    np.testing.assert_allclose(np.array(p), np.array(mx.softmax(LOGITS, axis=-1)), rtol=1e-6)


def test_temperature_scales_logits():
    p = probabilities(LOGITS, SamplingParams(temperature=0.5))
    np.testing.assert_allclose(np.array(p), np.array(mx.softmax(LOGITS * 2, axis=-1)), rtol=1e-5)


def test_top_k_keeps_exactly_the_k_most_likely():
    p = np.array(probabilities(LOGITS, SamplingParams(temperature=1.0, top_k=2)))[0]
    assert (p[2:] == 0).all() and p[:2].sum() == pytest.approx(1.0)
    assert p[0] / p[1] == pytest.approx(np.e, rel=1e-5)


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    full = np.array(mx.softmax(LOGITS, axis=-1))[0]  # 0.58, 0.21, 0.13, 0.08, ...
    p = np.array(probabilities(LOGITS, SamplingParams(temperature=1.0, top_p=0.7)))[0]
    assert (p[:2] > 0).all() and (p[2:] == 0).all()  # 0.58 < 0.7 <= 0.58 + 0.21
    np.testing.assert_allclose(p[:2], full[:2] / full[:2].sum(), rtol=1e-5)


def test_top_p_of_one_changes_nothing():
    a = probabilities(LOGITS, SamplingParams(temperature=0.7, top_p=1.0))
    b = probabilities(LOGITS, SamplingParams(temperature=0.7))
    assert mx.array_equal(a, b)


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1)],
)
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(SpecmlxError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("top_p", [1e-46, 1e-40, 1e-39])
def test_a_top_p_float32_sampling_cannot_tell_from_0_is_refused_in_one_line(top_p):
    # 1e-46 rounds to 0 in float32: no token was kept and token 0 was sampled forever.
    with pytest.raises(SpecmlxError) as refused:
        SamplingParams(temperature=1.0, top_p=top_p)
    assert str(refused.value) == (
        f"top-p {top_p:g} is below 1.2e-38, the least float32 sampling can tell from 0; "
        "give a larger one (any top-p this small keeps just the most likely token)"
    )


def test_the_smallest_top_p_allowed_keeps_just_the_most_likely_token():
    p = probabilities(LOGITS, SamplingParams(temperature=1.0, top_p=SMALLEST_TOP_P))
    assert p.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0, 0.0]]


def _uneven_distribution() -> np.ndarray:
    """600 tokens (two full blocks and a padded one): the second block all zero, zeros
    at block edges and at the very end, masses from 1e-5 to ~0.1."""
    p = np.random.default_rng(7).dirichlet(np.full(600, 0.5))
    p[BLOCK : 2 * BLOCK] = 0.0
    p[[0, BLOCK - 1, 2 * BLOCK, 599]] = 0.0
    return (p / p.sum()).astype(np.float32)


def test_samples_follow_the_distribution_and_never_draw_a_zero():
    # 60,000 draws; chi-square at ALPHA. Power: a sampler that moved 0.005 of mass onto or
    # off any one token shifts its count by 300 against a standard deviation below 80
    # (p <= 0.1): rejected with probability > 0.99.
    p = _uneven_distribution()
    rows = mx.broadcast_to(mx.array(p), (10_000, p.size))
    draws = np.concatenate([np.array(sample(rows, mx.random.key(seed))) for seed in range(6)])
    counts = np.bincount(draws, minlength=p.size)
    assert counts.size == p.size  # nothing drawn from the padding past the vocabulary
    assert counts[p == 0].sum() == 0
    assert chi_square_pvalue(counts[p > 0], p[p > 0]) > ALPHA


def test_one_row_or_many_each_get_one_token():
    p = mx.array(_uneven_distribution())
    assert sample(p, mx.random.key(0)).shape == ()
    assert sample(mx.stack([p, p, p]), mx.random.key(0)).shape == (3,)


@pytest.mark.parametrize("u", [1.0, 2.0**-24])
def test_the_extreme_uniform_draws_land_on_tokens_with_mass(u):
    # u = 1 reaches the whole mass: the last token with any, not the zeros or padding after
    # it; the smallest u the first token with any, not the zeros before it.
    p = _uneven_distribution()
    token = inverse_cdf(mx.array(p), mx.array(u), mx.array(u)).item()
    nonzero = np.flatnonzero(p)
    assert token == (nonzero[-1] if u == 1.0 else nonzero[0])
