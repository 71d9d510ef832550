"""Sliding-window attention and attention sinks on the native op: what they compute (mlx-lm's
attention, on a RotatingKVCache before and after its buffer wraps), that a verify row is
bit for bit the decode step of its position whichever order the cache hands its keys in,
and that Gemma 3's and gpt-oss's passes over k tokens therefore equal k steps."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache

import specmlx
from specmlx import exactness
from specmlx.caches import checkpoint, make_cache, prefill, rewind
from specmlx.convert.quantize import quantize
from specmlx.cpu import attention, native, quantized
from specmlx.tiny import build_tiny_model

pytestmark = pytest.mark.skipif(
    not attention.available(), reason=f"native attention not available: {native.reason()}"
)

WINDOW = 40
# Passes over a fresh window cache, as a model makes them: a prompt chunk, then decode
# steps (the buffer fills and wraps), verify passes (after which the buffer is in time
# order and longer than the window) and steps again (the buffer is cut back to the window
# and rotates), and a chunk longer than the window.
SCHEDULE = [7, 1, 1, 5, 30, 1, 1, 1, 3, 1, 50, 1, 1, 4] + [1] * 30 + [6, 1, 1, 2]


def qkv(hkv, ratio, n, d, seed):
    mx.random.seed(seed)
    q = mx.random.normal((1, hkv * ratio, n, d))
    k = mx.random.normal((1, hkv, n, d))
    v = mx.random.normal((1, hkv, n, d))
    return q, k, v


def sinks_for(hq, on):
    mx.random.seed(99)
    return mx.random.normal((hq,)) if on else None


def attend(cache, q, k, v, sinks=None, window=WINDOW):
    """One layer's call: the mask the model builds before the update (mlx-lm's
    create_attention_mask), the cache's update, then the patched attention; with the keys,
    values and mask it passed, for mlx-lm's function."""
    mask = create_attention_mask(mx.zeros((1, q.shape[2], 8)), cache, window_size=window)
    keys, values = cache.update_and_fetch(k, v)
    out = attention.scaled_dot_product_attention(
        q, keys, values, cache=cache, scale=q.shape[-1] ** -0.5, mask=mask, sinks=sinks
    )
    assert attention.supports(q, keys, values, cache, mask, sinks), (q.shape, cache.offset)
    mx.eval(out)
    return out, (keys, values, mask)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / np.abs(b).max()


def held(cache):
    """The cache's state as views: restoring it undoes the passes since."""
    return tuple(x[...] if isinstance(x, mx.array) else x for x in cache.state)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_window_layers_equal_mlx_lm_before_and_after_the_buffer_wraps(with_sinks, isas):
    for isa in isas:
        native._ext.set_isa(isa)
        cache = RotatingKVCache(max_size=WINDOW)
        sinks = sinks_for(6, with_sinks)
        for step, n in enumerate(SCHEDULE):
            q, k, v = qkv(2, 3, n, 64, seed=step)
            ours, (keys, values, mask) = attend(cache, q, k, v, sinks)
            theirs = attention.mlx_attention(
                q, keys, values, cache=cache, scale=0.125, mask=mask, sinks=sinks
            )
            assert rel_err(ours, theirs) < 1e-5, (isa, step, n)


def test_sinks_on_a_full_cache_equal_mlx_lm(isas):
    # gpt-oss's global layers: a plain KV cache, causal, with sinks
    q, k, v = qkv(2, 6, 5, 64, seed=1)
    sinks = sinks_for(12, True)
    cache = KVCache()
    keys, values = cache.update_and_fetch(k, v)
    theirs = attention.mlx_attention(
        q, keys, values, cache, scale=0.125, mask="causal", sinks=sinks
    )
    for isa in isas:
        native._ext.set_isa(isa)
        ours = attention.scaled_dot_product_attention(
            q, keys, values, cache, scale=0.125, mask="causal", sinks=sinks
        )
        assert rel_err(ours, theirs) < 1e-5, isa


# (passes before the verify pass, shape (KV heads, GQA ratio, head size, window)): before
# the buffer fills, a first chunk longer than the window, a ring that has wrapped (its
# newest key mid-buffer), right after a verify pass (time order, longer than the window),
# and at sizes where two threads share a pass: a KV head each, or one KV head's rows cut
# in two parts.
CONTEXTS = [
    ([10], (2, 3, 64, WINDOW)),
    ([60], (2, 3, 64, WINDOW)),
    ([30] + [1] * 25, (2, 3, 64, WINDOW)),
    ([30] + [1] * 20 + [5], (1, 4, 16, WINDOW)),
    ([300] + [1] * 37, (2, 6, 128, 256)),
    ([300] + [1] * 37, (1, 8, 128, 256)),
]


@pytest.mark.parametrize("context,shape", CONTEXTS)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_a_verify_row_is_bitwise_the_decode_step_of_its_position(context, shape, with_sinks, isas):
    hkv, ratio, d, window = shape
    sinks = sinks_for(hkv * ratio, with_sinks)
    before = native.threads()
    try:
        for isa in isas:
            native._ext.set_isa(isa)
            for threads in (1, 2):
                native.set_threads(threads)
                cache = RotatingKVCache(max_size=window)
                for step, n in enumerate(context):
                    attend(cache, *qkv(hkv, ratio, n, d, seed=step), sinks, window)
                saved = held(cache)
                for rows in (2, 3, 5):
                    q, k, v = qkv(hkv, ratio, rows, d, seed=100 + rows)
                    cache.state = saved
                    together, _ = attend(cache, q, k, v, sinks, window)
                    cache.state = saved
                    for i in range(rows):
                        one = slice(i, i + 1)
                        alone, _ = attend(
                            cache, q[:, :, one], k[:, :, one], v[:, :, one], sinks, window
                        )
                        assert np.array_equal(
                            np.array(alone[:, :, 0]), np.array(together[:, :, i])
                        ), (isa, threads, rows, i)
    finally:
        native.set_threads(before)


PROMPT = (
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\nThe quick brown fox jumps over the lazy dog."
)


@pytest.mark.parametrize("arch", ["gemma3_text", "gpt_oss"])
def test_a_k_token_pass_equals_k_steps_on_window_models(arch, tmp_path):
    # bench/row_exactness.py's check: the prompt (past the tiny window of 16) prefilled,
    # then tokens as one pass and as steps from the same cache, for every k a verify takes
    model = specmlx.load(build_tiny_model(tmp_path / arch, arch=arch, seed=0))
    assert exactness.rows_exact(model.module, exactness.windows_exact(model.module))
    cache = make_cache(model.module)
    assert RotatingKVCache in {type(c) for c in cache}
    prefill(model, cache, model.tokenizer.encode(PROMPT))
    for k in range(2, 7):
        tokens = [5 + 7 * j for j in range(k)]
        saved = checkpoint(cache)
        one_pass = model.module(mx.array([tokens], mx.uint32), cache=cache)[0]
        mx.eval(one_pass)
        rewind(model, cache, saved, [], k)
        for i, t in enumerate(tokens):
            step = model.module(mx.array([[t]], mx.uint32), cache=cache)[0, -1]
            assert mx.array_equal(step, one_pass[i]).item(), (k, i)
        rewind(model, cache, saved, [], k)


@pytest.mark.parametrize("attention_mode,activations", [("native", "int8"), ("mlx", "float32")])
def test_a_quantized_gemma3_keeps_int8_activations_only_on_native_attention(
    attention_mode, activations, int8_activations, tmp_path
):
    source = build_tiny_model(tmp_path / "gemma3", arch="gemma3_text", seed=0)
    quantize(source, tmp_path / "int4", group_size=32, dtype="float32")
    attention.set_mode(attention_mode)
    try:
        model = specmlx.load(tmp_path / "int4")
        assert quantized.runs_int4(model.module)
        assert exactness.windows_exact(model.module) == (attention_mode == "native")
        assert native.activations() == activations
    finally:
        attention.set_mode("native")
