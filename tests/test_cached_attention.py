"""The fused cached attention (specmlx.cpu.attention.patch_attentions): the op gives the bits
of the RoPE op, the cache's slice updates and the attention op run one after another; a
model on it gives the logits and cache of the unfused calls; and every call it does not
take runs mlx-lm's code."""

import mlx.core as mx
import numpy as np
import pytest
from cache_util import (
    assert_a_held_cache_array_keeps_its_contents,
    assert_decode_writes_the_cache_in_place,
)
from mlx_lm.models.cache import KVCache, QuantizedKVCache

import specmlx
from specmlx.cpu import attention, native
from specmlx.cpu.layers import NativeRoPE

pytestmark = pytest.mark.skipif(
    not attention.cached_available(), reason=f"cached attention not available: {native.reason()}"
)

# (batch, KV heads, GQA ratio, new rows, cached positions, head size, rope dims, traditional)
SHAPES = [
    (1, 2, 6, 1, 40, 128, 128, False),  # Qwen2.5-1.5B's decode step
    (1, 2, 7, 5, 300, 64, 64, False),  # 0.5B's verify pass
    (2, 2, 1, 3, 0, 64, 32, True),  # an empty cache, partial traditional rotation
    (1, 1, 4, 9, 17, 32, 16, False),
]


def unfused(q, k, v, keys, values, n_heads, offset, dims, traditional, scale, causal):
    """What mlx-lm's attention computes with the native RoPE and attention ops."""
    b, length, _ = q.shape
    hkv, d = keys.shape[1], keys.shape[3]
    at = mx.array(offset, mx.int32)
    qh = q.reshape(b, length, n_heads, d).transpose(0, 2, 1, 3)
    kh = k.reshape(b, length, hkv, d).transpose(0, 2, 1, 3)
    vh = v.reshape(b, length, hkv, d).transpose(0, 2, 1, 3)
    qh = native._ext.rope(qh, dims, traditional, 10000.0, 1.0, at)
    kh = native._ext.rope(kh, dims, traditional, 10000.0, 1.0, at)
    keys[..., offset : offset + length, :] = kh
    values[..., offset : offset + length, :] = vh
    out = native._ext.scaled_dot_product_attention(
        qh, keys[..., : offset + length, :], values[..., : offset + length, :], scale, causal
    )
    return out.transpose(0, 2, 1, 3).reshape(b, length, -1), keys, values


def inputs(b, hkv, ratio, length, offset, d, seed=0):
    mx.random.seed(seed)
    size = offset + length + 7
    q = mx.random.normal((b, length, hkv * ratio * d))
    k, v = mx.random.normal((b, length, hkv * d)), mx.random.normal((b, length, hkv * d))
    keys, values = mx.random.normal((b, hkv, size, d)), mx.random.normal((b, hkv, size, d))
    mx.eval(q, k, v, keys, values)
    return q, k, v, keys, values


@pytest.mark.parametrize("shape", SHAPES)
def test_the_op_gives_the_unfused_calls_bits(shape, isas):
    b, hkv, ratio, length, offset, d, dims, traditional = shape
    causal = length > 1
    for isa in isas:
        native._ext.set_isa(isa)
        q, k, v, keys, values = inputs(b, hkv, ratio, length, offset, d)
        args = (hkv * ratio, offset, dims, traditional)
        out, new_keys, new_values = native._ext.cached_attention(
            q, k, v, keys, values, *args, 10000.0, 1.0, d**-0.5, causal
        )
        mx.eval(out, new_keys, new_values)
        got = [np.array(a) for a in (out, new_keys, new_values)]
        q, k, v, keys, values = inputs(b, hkv, ratio, length, offset, d)
        want = unfused(q, k, v, keys, values, *args, d**-0.5, causal)
        mx.eval(*want)
        for g, w in zip(got, want, strict=True):
            assert np.array_equal(g, np.array(w)), isa


def test_a_buffer_held_elsewhere_is_copied_not_overwritten():
    q, k, v, keys, values = inputs(1, 2, 3, 2, 10, 64)
    before = np.array(keys)
    held = keys  # a second reference: the op must not write into this buffer
    _, new_keys, _ = native._ext.cached_attention(
        q, k, v, keys, values, 6, 10, 64, False, 10000.0, 1.0, 0.125, True
    )
    mx.eval(new_keys)
    assert np.array_equal(np.array(held), before)
    assert not np.array_equal(np.array(new_keys)[..., 10:12, :], before[..., 10:12, :])
    assert np.array_equal(np.array(new_keys)[..., :10, :], before[..., :10, :])


def test_the_op_refuses_a_cache_without_room():
    q, k, v, keys, values = inputs(1, 2, 3, 4, 0, 64)
    with pytest.raises(ValueError, match="room"):
        native._ext.cached_attention(
            q, k, v, keys, values, 6, keys.shape[2] - 3, 64, False, 10000.0, 1.0, 0.125, True
        )


def run_model(model, rounds):
    """Logits of a prefill, decode steps and a 4-token pass, and the first layer's cache."""
    from specmlx.caches import make_cache

    cache = make_cache(model.module)
    outs = []
    for tokens in rounds:
        logits = model.module(mx.array([tokens]), cache=cache)
        mx.eval(logits)
        outs.append(np.array(logits))
    c = cache[0]
    return outs, np.array(c.keys[..., : c.offset, :]), np.array(c.values[..., : c.offset, :])


ROUNDS = [list(range(5, 30)), [7], [8], [3, 4, 5, 6], [9]]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_model_on_the_fused_op_gives_the_unfused_logits_and_cache(arch, model_dirs, monkeypatch):
    model = specmlx.load(model_dirs["target" if arch == "qwen2" else "llama"])
    attn = model.module.model.layers[0].self_attn
    assert isinstance(attn, attention._CachedAttention)
    fused = run_model(model, ROUNDS)
    monkeypatch.setattr(attention, "_cached_call", lambda *a: None)
    plain = run_model(model, ROUNDS)
    for got, want in zip(fused[0], plain[0], strict=True):
        assert np.array_equal(got, want)
    assert np.array_equal(fused[1], plain[1]) and np.array_equal(fused[2], plain[2])


def test_the_fused_op_takes_a_decode_step(models, monkeypatch):
    calls = []
    real = native._ext.cached_attention
    monkeypatch.setattr(native._ext, "cached_attention", lambda *a: calls.append(1) or real(*a))
    model = models["target"]
    from specmlx.caches import make_cache

    cache = make_cache(model.module)
    mx.eval(model.module(mx.array([[1, 2, 3]]), cache=cache))  # the cache's first buffers
    assert not calls
    mx.eval(model.module(mx.array([[4]]), cache=cache))
    assert len(calls) == len(model.module.model.layers)


def test_calls_it_does_not_take_run_mlx_lms_code(models):
    module = models["target"].module
    attn = module.model.layers[0].self_attn
    x = mx.zeros((1, 1, module.args.hidden_size))
    full = KVCache()  # 256 positions, all taken
    head_dim = module.args.hidden_size // module.args.num_attention_heads
    kv = mx.zeros((1, attn.n_kv_heads, 256, head_dim))
    full.update_and_fetch(kv, kv)
    assert attention._cached_call(attn, x, None, None) is None  # no cache
    assert attention._cached_call(attn, x, None, KVCache()) is None  # no buffers yet
    assert attention._cached_call(attn, x, None, full) is None  # no room
    assert attention._cached_call(attn, x, None, QuantizedKVCache()) is None
    assert attention._cached_call(attn, x, mx.zeros((1, 1), mx.bool_), KVCache()) is None
    attention.set_mode("mlx")
    try:
        assert attention._cached_call(attn, x, None, full) is None
    finally:
        attention.set_mode("native")
    assert type(attn.rope) is NativeRoPE


def test_only_the_plain_body_is_fused():
    from mlx_lm.models import llama, qwen2, qwen3

    assert attention._has_cached_body(qwen2.Attention)
    assert attention._has_cached_body(llama.Attention)
    assert not attention._has_cached_body(qwen3.Attention)  # q and k norms before RoPE

    class Scaled(qwen2.Attention):
        def __call__(self, x, mask=None, cache=None):
            return super().__call__(x * 2, mask, cache)

    assert not attention._has_cached_body(Scaled)


def test_decode_steps_write_the_cache_in_place(models):
    assert_decode_writes_the_cache_in_place(models["target"].module)


def test_a_cache_array_held_elsewhere_keeps_its_contents(models):
    assert_a_held_cache_array_keeps_its_contents(models["target"].module, "keys")
