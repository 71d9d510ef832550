"""The native attention op: what it computes, that a query row's bits depend on that row
alone, which calls fall back to mlx-lm's, and that speculation stays exact on it."""

import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

import specmlx
from specmlx import cpu
from specmlx.cpu import attention, native
from specmlx.errors import SpecmlxError

pytestmark = pytest.mark.skipif(
    not attention.available(), reason=f"native attention not available: {native.reason()}"
)

# (batch, KV heads, GQA ratio, query rows, keys, head size): decode and verify shapes of
# Qwen2.5-1.5B (12/2 heads, D 128) and 0.5B (14/2, D 64), MHA, a single KV head, short
# caches (fewer keys than a block) and long ones (past 2048, not a multiple of 16).
SHAPES = [
    (1, 2, 6, 1, 1000, 128),
    (1, 2, 6, 5, 2100, 128),
    (1, 2, 7, 1, 1, 64),
    (1, 2, 7, 9, 700, 64),
    (2, 2, 6, 4, 37, 128),
    (2, 3, 1, 3, 16, 64),
    (1, 1, 7, 8, 9, 128),
    (2, 4, 1, 2, 129, 64),
]


def qkv(b, hkv, ratio, lq, lk, d, spare=0, seed=0):
    """q, and k and v as `[..., :lk, :]` views of buffers `spare` positions longer, as
    mlx-lm's KVCache passes them."""
    mx.random.seed(seed)
    q = mx.random.normal((b, hkv * ratio, lq, d))
    k = mx.random.normal((b, hkv, lk + spare, d))
    v = mx.random.normal((b, hkv, lk + spare, d))
    mx.eval(q, k, v)
    return q, k[..., :lk, :], v[..., :lk, :]


def native_attention(q, k, v, causal, isa=None):
    if isa is not None:
        native._ext.set_isa(isa)
    out = native._ext.scaled_dot_product_attention(q, k, v, q.shape[-1] ** -0.5, causal)
    mx.eval(out)  # the ISA is read when the op is evaluated
    return np.array(out)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / np.abs(b).max()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_equals_mlx_attention(shape, causal, isas):
    q, k, v = qkv(*shape, spare=256)
    want = mx.fast.scaled_dot_product_attention(
        q, k, v, scale=shape[-1] ** -0.5, mask="causal" if causal else None
    )
    for isa in isas:
        out = native_attention(q, k, v, causal, isa)
        assert out.shape == want.shape
        assert rel_err(out, want) < 1e-5, isa


def test_a_key_axis_that_is_not_contiguous_is_read_right(isas):
    # a (B, H, D, L) buffer seen as (B, H, L, D): the op copies it rather than misread it
    q, k, v = qkv(1, 2, 6, 3, 40, 64)
    kt, vt = mx.contiguous(k.swapaxes(2, 3)).swapaxes(2, 3), v
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    for isa in isas:
        assert rel_err(native_attention(q, kt, vt, True, isa), want) < 1e-5, isa


@pytest.mark.parametrize("ratio,d", [(6, 128), (7, 64), (1, 64)])
def test_a_verify_row_is_bitwise_the_decode_step_of_its_position(ratio, d, isas):
    # A verify pass over k rows (causal) against one decode step per position: row i alone,
    # over the cache as it stands at that position, from a buffer of another length.
    length = 300
    for isa in isas:
        for rows in range(1, 10):
            q, k, v = qkv(1, 2, ratio, rows, length, d, spare=256)
            together = native_attention(q, k, v, True, isa)
            for i in range(rows):
                seen = length - rows + i + 1
                kb, vb = mx.array(k[..., :seen, :]), mx.array(v[..., :seen, :])
                alone = native_attention(q[:, :, i : i + 1], kb, vb, False, isa)
                assert np.array_equal(alone[:, :, 0], together[:, :, i]), (isa, rows, i)


def test_a_prefill_chunk_cut_into_parts_keeps_every_rows_bits(isas):
    # 6 x 100 rows of 2100 keys hold more scores than one work item keeps: several parts
    q, k, v = qkv(1, 1, 6, 100, 2100, 64)
    for isa in isas:
        together = native_attention(q, k, v, True, isa)
        for i in (0, 57, 99):
            seen = 2100 - 100 + i + 1
            alone = native_attention(
                q[:, :, i : i + 1], k[..., :seen, :], v[..., :seen, :], False, isa
            )
            assert np.array_equal(alone[:, :, 0], together[:, :, i]), (isa, i)


def test_a_row_does_not_depend_on_the_rows_beside_it(isas):
    # the same rows without the other KV head's, the other batch's or the positions before
    q, k, v = qkv(2, 2, 6, 9, 500, 128)
    for isa in isas:
        full = native_attention(q, k, v, False, isa)
        part = native_attention(q[1:, 6:, 4:], k[1:, 1:], v[1:, 1:], False, isa)
        assert np.array_equal(part, full[1:, 6:, 4:]), isa


def test_thread_count_does_not_change_a_bit(isas):
    # big enough that 2 and 3 threads are used, and split the KV heads' rows between them
    q, k, v = qkv(1, 2, 6, 4, 1024, 128)
    before = native.threads()
    try:
        for isa in isas:
            results = []
            for n in (1, 2, 3):
                native.set_threads(n)
                results.append(native_attention(q, k, v, True, isa))
            assert all(np.array_equal(results[0], r) for r in results[1:]), isa
    finally:
        native.set_threads(before)


def call_both(q, k, v, cache=None, mask=None, sinks=None):
    """(the patched function's result, mlx-lm's), for the same call. Each gets its own q:
    mlx-lm's quantized path scales its queries in place."""
    kwargs = {"cache": cache, "scale": 0.125, "mask": mask, "sinks": sinks}
    ours = attention.scaled_dot_product_attention(mx.array(q), k, v, **kwargs)
    return ours, attention.mlx_attention(mx.array(q), k, v, **kwargs)


def test_plain_caches_and_causal_masks_take_the_native_op():
    q, k, v = qkv(1, 2, 6, 4, 100, 64)
    for cache in (None, KVCache()):
        for mask in (None, "causal"):
            assert attention.supports(q, k, v, cache, mask)
    ours, theirs = call_both(q, k, v, mask="causal")
    assert np.array_equal(np.array(ours), native_attention(q, k, v, True)) and not mx.array_equal(
        ours, theirs
    )


def test_everything_else_falls_back_to_mlx_lm():
    q, k, v = qkv(1, 2, 6, 4, 100, 64)
    causal = mx.arange(100)[None] <= mx.arange(96, 100)[:, None]
    quantized = QuantizedKVCache(group_size=64, bits=8)
    qk, qv = quantized.update_and_fetch(k, v)
    kept = RotatingKVCache(max_size=512, keep=4)  # mlx-lm's max_kv_size cache
    kk, kv = kept.update_and_fetch(k, v)
    cases = {
        "array mask": call_both(q, k, v, mask=causal),
        "window with kept positions": call_both(q, kk, kv, cache=kept, mask="causal"),
        "float16": call_both(q.astype(mx.float16), k.astype(mx.float16), v.astype(mx.float16)),
        "head size 72": call_both(*qkv(1, 2, 6, 1, 100, 72)),
        "more rows than keys": call_both(*qkv(1, 2, 6, 9, 4, 64), mask="causal"),
        "quantized cache": call_both(q, qk, qv, cache=quantized, mask="causal"),
    }
    for name, (ours, theirs) in cases.items():
        assert mx.array_equal(ours, theirs, equal_nan=True).item(), name


def tree_rows_mask(lk, parents):
    """A tree pass's mask over a cache of lk keys whose last len(parents) + 1 are the
    tree's rows (the root, then each node): the context and each row's own ancestors."""
    rows = len(parents) + 1
    seen = np.eye(rows, dtype=bool)
    for j, p in enumerate(parents):
        seen[j + 1] |= seen[p + 1]
    mask = np.ones((rows, lk), bool)
    mask[:, lk - rows :] = seen
    return mx.array(mask)


@pytest.mark.parametrize("shape", [(1, 2, 6, 5, 300, 128), (2, 2, 7, 7, 40, 64)])
def test_a_tree_mask_leaves_out_what_mlx_leaves_out(shape, isas):
    b, hkv, ratio, lq, lk, d = shape
    q, k, v = qkv(*shape)
    mask = tree_rows_mask(lk, [-1, -1, 0, 1, 2, 2][: lq - 1])
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=d**-0.5, mask=mask)
    for isa in isas:
        native._ext.set_isa(isa)
        out = native._ext.scaled_dot_product_attention(q, k, v, d**-0.5, True, mask=mask)
        assert rel_err(out, want) < 1e-5, isa


def test_a_tree_row_reads_only_its_ancestors(isas):
    # Row 2's parent is the root: the keys of rows 1 (its sibling) and 3, 4 (not its
    # ancestors) can hold anything without changing a bit of it.
    q, k, v = qkv(1, 2, 6, 5, 60, 64)
    mask = tree_rows_mask(60, [-1, -1, 0, 1])
    noise = mx.random.normal(k.shape, key=mx.random.key(9))
    keep = mx.array(np.isin(np.arange(60), [56, 58, 59]))[:, None]
    k2, v2 = mx.where(keep, noise, k), mx.where(keep, noise, v)
    for isa in isas:
        native._ext.set_isa(isa)
        a = native._ext.scaled_dot_product_attention(q, k, v, 0.125, True, mask=mask)
        b = native._ext.scaled_dot_product_attention(q, k2, v2, 0.125, True, mask=mask)
        assert np.array_equal(np.array(a)[:, :, 2], np.array(b)[:, :, 2]), isa


def test_a_tree_row_reads_the_bits_of_the_chain_of_its_ancestors(isas):
    # Rows 3 and 4 have a non-ancestor between their ancestors (rows 2 and 3); the chain of
    # each one's ancestors, verified alone, must give it the same bits, or a tree's path
    # could decode other tokens than the target alone at a near tie.
    q, k, v = qkv(1, 2, 6, 5, 60, 64)
    mask = tree_rows_mask(60, [-1, -1, 0, 1])  # rows 55-59: root, a, b, a's child, b's child
    for isa in isas:
        native._ext.set_isa(isa)
        tree = np.array(native._ext.scaled_dot_product_attention(q, k, v, 0.125, True, mask=mask))
        for row, ancestors in ((3, [0, 1, 3]), (4, [0, 2, 4])):
            keep = mx.array(list(range(55)) + [55 + a for a in ancestors])
            chain = native._ext.scaled_dot_product_attention(
                q[:, :, mx.array(ancestors)], k[:, :, keep], v[:, :, keep], 0.125, True
            )
            assert np.array_equal(tree[:, :, row], np.array(chain)[:, :, -1]), (isa, row)


def test_a_tree_pass_mask_takes_the_native_op_and_no_other_array_mask_does():
    q, k, v = qkv(1, 2, 6, 4, 100, 64)
    mask = tree_rows_mask(100, [-1, 0, 0])
    assert not attention.supports(q, k, v, KVCache(), mask)  # outside a tree's pass
    with attention.tree_masks():
        assert attention.supports(q, k, v, KVCache(), mask)
        assert not attention.supports(q, k, v, KVCache(), mask.astype(mx.float32))  # additive
        ours, theirs = call_both(q, k, v, mask=mask)
    assert rel_err(ours, theirs) < 1e-5


def test_mlx_mode_runs_mlx_lm_and_the_description_says_which():
    q, k, v = qkv(1, 2, 6, 1, 100, 64)
    assert attention.mode() == "native" and "; native attention" in cpu.describe()
    attention.set_mode("mlx")
    try:
        assert "mx.fast attention" in cpu.describe()
        assert not attention.supports(q, k, v, None, None)
        ours, theirs = call_both(q, k, v)
        assert mx.array_equal(ours, theirs).item()
    finally:
        attention.set_mode("native")
    with pytest.raises(SpecmlxError, match="unknown attention 'flash'"):
        attention.set_mode("flash")


def test_env_var_chooses_the_mode(monkeypatch):
    monkeypatch.setenv(attention.ENV, "mlx")
    assert attention._env_mode() == ("mlx", "")
    monkeypatch.setenv(attention.ENV, "")
    assert attention._env_mode() == ("native", "")
    monkeypatch.setenv(attention.ENV, "flash")
    assert attention._env_mode() == (
        "native",
        "SPECMLX_ATTENTION must be one of native, mlx, got 'flash'",
    )


def test_a_bad_env_value_stops_loading_in_one_line(monkeypatch, model_dirs):
    monkeypatch.setattr(attention, "_env_problem", "SPECMLX_ATTENTION must be one of ...")
    with pytest.raises(SpecmlxError, match="SPECMLX_ATTENTION"):
        specmlx.load(model_dirs["target"])


class CountingExt:
    """native._ext, counting the attention op's calls."""

    def __init__(self, ext):
        self.ext, self.calls = ext, 0

    def scaled_dot_product_attention(self, *args, **kwargs):
        self.calls += 1
        return self.ext.scaled_dot_product_attention(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.ext, name)


@pytest.mark.parametrize("pair", [("target", "perturbed"), ("llama", "llama_draft")])
def test_greedy_speculation_on_native_attention_equals_the_target_alone(pair, models, monkeypatch):
    target, draft = models[pair[0]], models[pair[1]]
    source = sys.modules[type(target.module.model.layers[0].self_attn).__module__]
    assert source.scaled_dot_product_attention is attention.scaled_dot_product_attention
    assert attention.patch_model(target.module)  # specmlx.load did it; again changes nothing
    counting = CountingExt(native._ext)
    monkeypatch.setattr(native, "_ext", counting)
    ids = target.tokenizer.encode("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):")
    alone = specmlx.generate(target, ids, max_tokens=24, num_draft=0).run().tokens
    assert counting.calls > 0  # the target's layers ran the native op
    for gamma in (1, 3, "auto"):
        gen = specmlx.generate(target, ids, draft=draft, max_tokens=24, num_draft=gamma).run()
        assert gen.tokens == alone, f"gamma {gamma}"
