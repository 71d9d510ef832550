"""The padded KV cache (for backends that build kernels per shape) changes no result."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache, trim_prompt_cache

import specmlx
from specmlx import caches
from specmlx.caches import PaddedKVCache


def test_padded_cache_gives_the_logits_of_mlx_lms_cache(models):
    # Prefill across the 256-position step, verify-like passes, and rollbacks.
    module = models["target"].module
    plain, padded = make_prompt_cache(module), [PaddedKVCache() for _ in module.layers]
    rng = np.random.default_rng(0)
    steps = [(250, 0), (5, 2), (9, 0), (1, 0), (4, 4), (3, 1), (300, 0), (2, 0)]
    for new, rollback in steps:
        x = mx.array(rng.integers(0, 200, size=(1, new)), mx.uint32)
        expected, got = module(x, cache=plain), module(x, cache=padded)
        np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-4, atol=1e-4)
        trim_prompt_cache(plain, rollback)
        trim_prompt_cache(padded, rollback)
    assert padded[0].offset == plain[0].offset
    assert padded[0].keys.shape[2] % PaddedKVCache.step == 0


def test_attention_sees_one_kv_length_per_256_positions():
    cache, seen = PaddedKVCache(), set()
    for _ in range(100):
        keys = mx.zeros((1, 2, 3, 8))
        seen.add(cache.update_and_fetch(keys, keys)[0].shape[2])
        cache.trim(1)  # verify-like: 3 in, 1 rolled back
    assert seen == {256}  # 200 positions stored, one shape throughout
    assert cache.make_mask(3).shape == (3, 256)


def test_a_single_query_sees_the_exact_length_without_a_mask():
    cache = PaddedKVCache()
    keys = mx.zeros((1, 1, 4, 8))
    cache.update_and_fetch(keys, keys)
    assert cache.make_mask(1) is None
    assert cache.update_and_fetch(keys[:, :, :1], keys[:, :, :1])[0].shape[2] == 5


def test_the_mask_is_causal_over_stored_positions_and_hides_the_tail():
    cache = PaddedKVCache()
    keys = mx.zeros((1, 1, 4, 8))
    cache.update_and_fetch(keys, keys)
    mask = np.array(cache.make_mask(2))
    assert mask.shape == (2, 256)
    assert mask[0, :5].all() and not mask[0, 5:].any()
    assert mask[1, :6].all() and not mask[1, 6:].any()


@pytest.mark.parametrize("setting, padded", [("1", True), ("0", False)])
def test_the_environment_chooses_the_cache(models, monkeypatch, setting, padded):
    monkeypatch.setenv(caches.ENV, setting)
    made = caches.make_cache(models["target"].module)
    assert all(type(c) is (PaddedKVCache if padded else KVCache) for c in made)


def test_greedy_speculation_with_padded_caches_equals_the_target(models, monkeypatch):
    for m in models.values():
        monkeypatch.setattr(m.tokenizer, "eos_token_ids", set())
    target, draft = models["target"], models["perturbed"]
    baseline = specmlx.generate(target, "def f(x):", max_tokens=40, num_draft=0).run().tokens
    monkeypatch.setenv(caches.ENV, "1")
    session = specmlx.Session(target, draft)
    assert isinstance(session.cache[0], PaddedKVCache)
    gen = specmlx.generate(target, "def f(x):", draft, max_tokens=40, num_draft=3, session=session)
    assert gen.run().tokens == baseline
