"""The native argmax (greedy sampling, greedy verification): mx.argmax's index on every ISA,
ties, NaN and infinities included, and the samplers' tokens unchanged."""

import mlx.core as mx
import numpy as np
import pytest

from specmlx import cpu
from specmlx.cpu import native
from specmlx.sampling import SamplingParams
from specmlx.verify import accept_greedy, make_sampler

pytestmark = pytest.mark.skipif(
    not hasattr(native._ext, "argmax"), reason=f"native argmax not available: {native.reason()}"
)


def rows(seed: int) -> tuple[np.ndarray, int]:
    """A few rows of small integers (many ties), some with NaN, +-inf or all -inf."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 4, size=(int(rng.integers(1, 4)), int(rng.integers(1, 300))))
    x = x.astype(np.float32)
    kind = seed % 5
    if kind == 1:
        x[rng.random(x.shape) < 0.2] = np.nan
    elif kind == 2:
        x[:, 0] = np.nan
    elif kind == 3:
        x[:] = -np.inf
    elif kind == 4:
        x[rng.random(x.shape) < 0.3] = np.inf
    return x, int(rng.integers(1, x.shape[1] + 1))


def test_the_index_is_mlx_argmaxs(isas):
    for isa in isas:
        native._ext.set_isa(isa)
        for seed in range(300):
            x, n = rows(seed)
            got = np.array(native._ext.argmax(mx.array(x), n))
            want = np.array(mx.argmax(mx.array(x)[:, :n], axis=-1))
            assert np.array_equal(got, want), (isa, seed)


def test_a_vocabulary_row_gives_mlx_argmaxs_token(isas):
    mx.random.seed(0)
    logits = mx.random.normal((3, 151936))
    want = np.array(mx.argmax(logits[:, :151665], axis=-1))
    for isa in isas:
        native._ext.set_isa(isa)
        assert np.array_equal(np.array(cpu.argmax(logits, 151665)), want), isa


def test_the_greedy_sampler_and_verifier_use_it(monkeypatch):
    calls = []
    real = native._ext.argmax
    monkeypatch.setattr(native._ext, "argmax", lambda x, n: calls.append(n) or real(x, n))
    make_sampler.cache_clear()
    logits = mx.array([[0.0, 5.0, 1.0, 9.0]])
    assert make_sampler(SamplingParams(), 3)(logits, None)[1].tolist() == [1]
    n, token = accept_greedy(mx.array([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]]), mx.array([1]))
    assert (int(n), int(token)) == (1, 0)
    assert calls == [3, 3]
    make_sampler.cache_clear()
