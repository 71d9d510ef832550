"""The fused decoder layer (specmlx.cpu.blocks): a block of mlx-lm's plain pre-norm kind
whose parts are all native runs its step as one op, with the logits and cache contents of
the nine ops it replaces, bit for bit; every call or block it does not take runs mlx-lm's
code."""

import mlx.core as mx
import numpy as np
import pytest
from cache_util import (
    assert_a_held_cache_array_keeps_its_contents,
    assert_decode_writes_the_cache_in_place,
)
from mlx_lm.models.cache import KVCache

import specmlx
from specmlx import batch as batching
from specmlx.caches import make_cache
from specmlx.convert.quantize import quantize
from specmlx.cpu import attention, blocks, native

pytestmark = pytest.mark.skipif(
    not blocks.available(), reason=f"fused layers not available: {native.reason()}"
)

# A prefill, decode steps, a 4-token verify pass, a step after it.
ROUNDS = [list(range(5, 30)), [7], [8], [3, 4, 5, 6], [9]]


@pytest.fixture(scope="module")
def int4_models(model_dirs, tmp_path_factory):
    """The tiny qwen2 (q, k, v biases; fp16 scales, as checkpoints keep them) and llama (no
    biases; float32 scales) in INT4 g32, on the native kernel."""
    root = tmp_path_factory.mktemp("fused-layers")
    quantize(model_dirs["target"], root / "qwen2", group_size=32, dtype="float16")
    quantize(model_dirs["llama"], root / "llama", group_size=32, dtype="float32")
    return {"qwen2": specmlx.load(root / "qwen2"), "llama": specmlx.load(root / "llama")}


@pytest.fixture
def unfused():
    """The fused layers turned off for the test's duration (on again after)."""
    blocks.set_enabled(False)
    yield
    blocks.set_enabled(True)


def run_model(module, rounds=ROUNDS):
    """Logits of each round, and every layer's cache contents after the last."""
    cache = make_cache(module)
    outs = []
    for tokens in rounds:
        logits = module(mx.array([tokens]), cache=cache)
        mx.eval(logits)
        outs.append(np.array(logits))
    kept = [np.array(a[..., : c.offset, :]) for c in cache for a in (c.keys, c.values)]
    return outs, kept


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_plain_blocks_are_fused(arch, int4_models):
    layers = int4_models[arch].module.model.layers
    assert all(isinstance(layer, blocks._FusedBlock) for layer in layers)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_fused_model_gives_the_unfused_logits_and_caches(arch, int4_models, isas):
    module = int4_models[arch].module
    for isa in isas:
        native._ext.set_isa(isa)
        fused = run_model(module)
        blocks.set_enabled(False)
        try:
            plain = run_model(module)
        finally:
            blocks.set_enabled(True)
        for got, want in zip(fused[0] + fused[1], plain[0] + plain[1], strict=True):
            assert np.array_equal(got, want), isa


def test_a_decode_step_is_one_op_a_layer(int4_models, monkeypatch):
    calls = []
    real = native._ext.decoder_layer
    monkeypatch.setattr(native._ext, "decoder_layer", lambda *a: calls.append(1) or real(*a))
    module = int4_models["qwen2"].module
    cache = make_cache(module)
    mx.eval(module(mx.array([[1, 2, 3]]), cache=cache))  # the caches' first buffers: mlx-lm's
    assert not calls
    mx.eval(module(mx.array([[4]]), cache=cache))
    assert len(calls) == len(module.model.layers)


def test_unfused_runs_the_blocks_own_code(int4_models, unfused, monkeypatch):
    monkeypatch.setattr(native._ext, "decoder_layer", None)  # any call would fail
    module = int4_models["qwen2"].module
    run_model(module, [[1, 2, 3], [4]])


def test_decode_steps_write_the_cache_in_place(int4_models):
    assert_decode_writes_the_cache_in_place(int4_models["llama"].module)


def test_a_cache_array_held_elsewhere_keeps_its_contents(int4_models):
    assert_a_held_cache_array_keeps_its_contents(int4_models["llama"].module, "values")


def test_calls_it_does_not_take_run_the_blocks_code(int4_models):
    module = int4_models["qwen2"].module
    block = module.model.layers[0]
    x = mx.zeros((1, 1, module.args.hidden_size))
    assert blocks._fused_call(block, x, None, None) is None  # no cache
    assert blocks._fused_call(block, x, None, KVCache()) is None  # no buffers yet
    cache = make_cache(module)
    mx.eval(module(mx.array([[1, 2, 3]]), cache=cache))
    assert blocks._fused_call(block, x.astype(mx.float16), None, cache[0]) is None
    attention.set_mode("mlx")  # the attention on mlx-lm's path: the block must be too
    try:
        assert blocks._fused_call(block, x, None, cache[0]) is None
    finally:
        attention.set_mode("native")


def test_only_plain_blocks_of_native_parts_are_fused(models, int4_models):
    import mlx.nn as nn
    from mlx_lm.models import qwen2

    assert blocks._has_block_body(qwen2.TransformerBlock)

    class Scaled(qwen2.TransformerBlock):
        def __call__(self, x, mask=None, cache=None):
            return super().__call__(x * 2, mask, cache)

    assert not blocks._has_block_body(Scaled)
    # float weights: the projections are not on the kernel, so the block keeps its code
    assert not isinstance(models["target"].module.model.layers[0], blocks._FusedBlock)
    assert blocks._linears(models["target"].module.model.layers[0]) is None
    # a norm of its own (Gemma's adds 1 to its weight) keeps the block's code too
    norm = int4_models["qwen2"].module.model.layers[0].input_layernorm
    native_class, norm.__class__ = norm.__class__, nn.RMSNorm
    try:
        assert blocks._linears(int4_models["qwen2"].module.model.layers[0]) is None
    finally:
        norm.__class__ = native_class


def test_speculative_greedy_equals_the_target_alone(int4_models, model_dirs, isas):
    target = int4_models["llama"]
    draft = specmlx.load(model_dirs["llama_draft"])
    for isa in isas:
        native._ext.set_isa(isa)
        alone = specmlx.generate(target, "def f(x):", max_tokens=20, num_draft=0).run().tokens
        for gamma in (2, 4):
            spec = specmlx.generate(
                target, "def f(x):", draft=draft, max_tokens=20, num_draft=gamma
            ).run()
            assert spec.tokens == alone, (isa, gamma)


def test_the_op_refuses_a_cache_without_room(int4_models):
    module = int4_models["llama"].module
    cache = make_cache(module)
    mx.eval(module(mx.array([[1, 2, 3]]), cache=cache))
    block, c = module.model.layers[0], cache[0]
    parts = block._fused_parts
    w = [[layer[p] for p in ("weight", "scales", "biases")] for layer in parts.layers]
    x = mx.zeros((1, 1, module.args.hidden_size))
    attn = parts.attn
    with pytest.raises(ValueError, match="room"):
        native._ext.decoder_layer(
            x, parts.norms[0]["weight"], 1e-6, w[0] + w[1] + w[2], [], w[3],
            parts.norms[1]["weight"], 1e-6, w[4] + w[5], w[6], c.keys, c.values, 32, 4, "silu",
            attn.n_heads, c.keys.shape[2], attn.rope.dims, False, 10000.0, 1.0, attn.scale, False,
        )  # fmt: skip


@pytest.mark.skipif(not blocks.rows_available(), reason="the rows op is not in this build")
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("prompt_lengths", [(4, 3), (4, 254)], ids=["room", "a-cache-full"])
def test_a_batched_pass_is_one_op_a_layer_with_each_rows_own_bits(
    arch, prompt_lengths, int4_models, isas, monkeypatch
):
    """Rows of 1 and 3 new tokens, each on its own cache (specmlx.batch): the layer runs
    as one op over both, and each row's logits and cache are its own pass's, bit for bit.
    A row whose cache has no room for its tokens (254 + 3 past a 256-slot step) sends the
    layer down its own path."""
    model = int4_models[arch]
    calls = []
    real = native._ext.decoder_layer_rows
    monkeypatch.setattr(native._ext, "decoder_layer_rows", lambda *a: calls.append(1) or real(*a))
    prompts = [[(7 * i + j) % 50 + 3 for j in range(n)] for i, n in enumerate(prompt_lengths)]
    news = [[11], [12, 13, 14]]
    for isa in isas:
        native._ext.set_isa(isa)
        calls.clear()
        own, rows = [], []
        for prompt, new in zip(prompts, news, strict=True):
            caches = []
            for _ in range(2):
                cache = make_cache(model.module)
                mx.eval(model.module(mx.array([prompt]), cache=cache))
                caches.append(cache)
            logits = model.module(mx.array([new]), cache=caches[0])[0]
            own.append((logits, caches[0]))
            rows.append((caches[1], mx.array(new, mx.uint32)))
        together = batching.batched_pass(model, rows)
        for (logits, cache), got, (row_cache, _) in zip(own, together, rows, strict=True):
            assert np.array_equal(np.array(logits), np.array(got)), isa
            for mine, theirs in zip(cache, row_cache, strict=True):
                n = mine.offset
                assert theirs.offset == n
                for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
                    assert np.array_equal(np.array(a[..., :n, :]), np.array(b[..., :n, :]))
        layers = len(model.module.model.layers)
        assert len(calls) == (layers if prompt_lengths == (4, 3) else 0), isa
