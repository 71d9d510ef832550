"""The processed distribution that both models sample from."""

import mlx.core as mx
import numpy as np
import pytest

from specmlx.errors import SpecmlxError
from specmlx.sampling import SamplingParams, probabilities

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
