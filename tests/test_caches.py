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
    assert isinstance(session.target.cache[0], PaddedKVCache)
    gen = specmlx.generate(target, "def f(x):", draft, max_tokens=40, num_draft=3, session=session)
    assert gen.run().tokens == baseline


# --- rollback: trim, cut or rewind, and the cache is as if the rejected never ran ------


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory):
    from specmlx.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("rollback")
    return {
        arch: specmlx.load(build_tiny_model(root / arch, arch=arch, seed=0))
        for arch in ("gemma3_text", "mamba2", "qwen3_next", "qwen3")
    }


CASES = [  # (architecture, how rollback is done after one pass over the round)
    ("gemma3_text", "cut"),  # a sliding window just after a pass over several tokens
    ("mamba2", "rewind"),
    ("qwen3_next", "rewind"),
    ("qwen3", "trim"),
]


@pytest.mark.parametrize("arch, how", CASES)
@pytest.mark.parametrize("one_pass", [True, False], ids=["verify-pass", "draft-passes"])
def test_a_rolled_back_round_leaves_the_cache_a_fresh_prefill_makes(
    arch_models, arch, how, one_pass
):
    # The round's tokens go in as one pass (the target's verify) or one at a time (the
    # draft's proposals); 2 of 5 are kept. Then the next token's logits must be those of
    # a cache that only ever saw the kept history.
    model = arch_models[arch]
    rng = np.random.default_rng(1)
    history = rng.integers(0, 250, size=30).tolist()  # past the window of 16
    round_tokens = rng.integers(0, 250, size=5).tolist()
    cache = caches.make_cache(model.module)
    caches.prefill(model, cache, history)
    saved = caches.checkpoint(cache)
    passes = [round_tokens] if one_pass else [[t] for t in round_tokens]
    for tokens in passes:
        mx.eval(model.module(mx.array([tokens], mx.uint32), cache=cache))
    rerun = caches.rewind(model, cache, saved, round_tokens[:2], dropped=3)
    assert (rerun > 0) == (how == "rewind" or (how == "cut" and not one_pass))
    fresh = caches.make_cache(model.module)
    caches.prefill(model, fresh, history + round_tokens[:2])
    x = mx.array([[7]], mx.uint32)
    np.testing.assert_allclose(
        np.array(model.module(x, cache=cache)),
        np.array(model.module(x, cache=fresh)),
        rtol=1e-4,
        atol=1e-4,
    )


def test_a_timed_pass_leaves_a_recurrent_cache_as_it_was(arch_models):
    model = arch_models["mamba2"]
    cache, fresh = caches.make_cache(model.module), caches.make_cache(model.module)
    for c in (cache, fresh):
        caches.prefill(model, c, [1, 2, 3, 4, 5])
    caches.timed_pass(model, cache, [6])
    x = mx.array([[7]], mx.uint32)
    assert mx.allclose(model.module(x, cache=cache), model.module(x, cache=fresh), atol=1e-5)


def test_a_quantized_kv_cache_trims_exactly():
    from mlx_lm.models.cache import QuantizedKVCache

    rng = np.random.default_rng(2)
    kv = [mx.array(rng.normal(size=(1, 2, n, 64)), mx.float32) for n in (20, 5, 2)]
    rolled, fresh = QuantizedKVCache(group_size=32, bits=8), QuantizedKVCache(32, 8)
    rolled.update_and_fetch(kv[0], kv[0])
    rolled.update_and_fetch(kv[1], kv[1])
    caches.rewind(None, [rolled], caches.checkpoint([rolled]), [], dropped=3)
    kept = mx.concatenate([kv[0], kv[1][:, :, :2]], axis=2)
    fresh.update_and_fetch(kept, kept)
    a = rolled.update_and_fetch(kv[2], kv[2])[0]
    b = fresh.update_and_fetch(kv[2], kv[2])[0]
    assert all(mx.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_chunked_kv_cache_is_rewound_to_what_a_fresh_prefill_makes(models):
    # llama4's attention cache, which drops its front past a chunk: rewound, not trimmed.
    from mlx_lm.models.cache import ChunkedKVCache

    model = models["llama"]
    rng = np.random.default_rng(3)
    history, round_tokens = rng.integers(0, 250, size=30).tolist(), [5, 9, 11, 2, 40]

    def chunked() -> list:
        return [ChunkedKVCache(chunk_size=16) for _ in model.module.layers]

    cache, fresh = chunked(), chunked()
    caches.prefill(model, cache, history)
    saved = caches.checkpoint(cache)
    mx.eval(model.module(mx.array([round_tokens], mx.uint32), cache=cache))
    assert caches.rewind(model, cache, saved, round_tokens[:2], dropped=3) == 2
    caches.prefill(model, fresh, history + round_tokens[:2])
    x = mx.array([[7]], mx.uint32)
    assert mx.allclose(model.module(x, cache=cache), model.module(x, cache=fresh), atol=1e-5)


def test_a_pass_built_and_taken_back_out_leaves_the_cache_as_it_was(models):
    # The engine builds a plain round's successor before it knows the next round is plain;
    # where it drafts instead, set_state takes the built pass back out before it runs.
    module = models["target"].module
    taken, fresh = make_prompt_cache(module), make_prompt_cache(module)
    prompt = mx.array([[5, 17, 42, 99, 7]], mx.uint32)
    mx.eval(module(prompt, cache=taken), module(prompt, cache=fresh))
    before = caches.state_of(taken)
    module(mx.array([[3]], mx.uint32), cache=taken)  # built, never evaluated
    caches.set_state(taken, before)
    assert taken[0].offset == fresh[0].offset == 5
    verify = mx.array([[11, 12, 13]], mx.uint32)
    np.testing.assert_array_equal(
        np.array(module(verify, cache=taken)), np.array(module(verify, cache=fresh))
    )
