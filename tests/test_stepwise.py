"""specmlx.stepwise: a short pass of a Mamba-2 model gives each position, and the cache,
the bits one-token steps give them, so speculation decodes what the target alone does."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache

import specmlx
from specmlx import exactness, stepwise
from specmlx.caches import checkpoint, layers, make_cache, prefill, rewind
from specmlx.cpu import native, quantized
from specmlx.mlxlm import model_classes
from specmlx.settings import MAX_GAMMA

ARCHS = ["mamba2", "granitemoehybrid", "falcon_h1"]
PROMPT = (
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\nThe quick brown fox jumps over the lazy dog."
)
N = 32


@pytest.fixture
def chunked():
    """mlx-lm's own chunked form for every pass while the test runs."""
    stepwise.set_enabled(False)
    yield
    stepwise.set_enabled(True)


def arrays(cache: list) -> list[mx.array]:
    """Every array the cache holds: conv and SSM states, the KV caches' stored keys and values."""
    out = []
    for c in layers(cache):
        if isinstance(c, ArraysCache):
            out += [x for x in c.cache if x is not None]
        else:  # a KVCache's buffer past its offset holds what a rewind dropped
            out += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
    return out


def one_pass_and_steps(model: specmlx.Model, tokens: list[int]):
    """(logits, cache arrays) of `tokens` as one pass and as one-token steps, each from the
    same prefilled prompt."""
    cache = make_cache(model.module)
    prefill(model, cache, model.tokenizer.encode(PROMPT))
    saved = checkpoint(cache)
    one = model.module(mx.array([tokens], mx.uint32), cache=cache)[0]
    one_state = arrays(cache)
    mx.eval(one, one_state)
    rewind(model, cache, saved, [], len(tokens))
    steps = mx.concatenate(
        [model.module(mx.array([[t]], mx.uint32), cache=cache)[0] for t in tokens]
    )
    steps_state = arrays(cache)
    mx.eval(steps, steps_state)
    return (one, one_state), (steps, steps_state)


def bitwise_equal(a: list[mx.array], b: list[mx.array]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and mx.array_equal(x, y).item() for x, y in zip(a, b, strict=True)
    )


def test_the_longest_verify_pass_is_stepped():
    assert stepwise.MAX_TOKENS == MAX_GAMMA + 1


@pytest.mark.parametrize("arch", ARCHS)
def test_loading_steps_the_models_mixers_once(arch, tiny_pair):
    model = specmlx.load(tiny_pair(arch)[0])
    assert stepwise.stepped(model.module)
    assert stepwise.patch_model(model.module) == 2  # two Mamba-2 mixers; again a no-op
    ssm = type(stepwise.mixers(model.module)[0])._ssm
    assert not hasattr(ssm.__wrapped__, "__wrapped__")  # wrapped once, however many loads


@pytest.mark.parametrize("arch", ARCHS)
def test_a_pass_over_up_to_max_gamma_plus_one_tokens_equals_one_token_steps(arch, tiny_pair):
    model = specmlx.load(tiny_pair(arch)[0])
    for k in range(2, stepwise.MAX_TOKENS + 1):
        tokens = [(5 + 37 * i) % 200 for i in range(k)]
        (one, one_state), (steps, steps_state) = one_pass_and_steps(model, tokens)
        assert mx.array_equal(one, steps).item(), f"logits, k = {k}"
        assert bitwise_equal(one_state, steps_state), f"cache, k = {k}"


@pytest.mark.parametrize("arch", ARCHS)
def test_mlx_lms_chunked_pass_is_not_bit_exact_without_it(arch, tiny_pair, chunked):
    # Why the module exists: if mlx-lm's multi-token form ever gives a step's bits, it can go.
    model = specmlx.load(tiny_pair(arch)[0])
    (one, _), (steps, _) = one_pass_and_steps(model, [5, 17, 42])
    assert not mx.array_equal(one, steps).item()


@pytest.mark.parametrize("arch", ARCHS)
def test_a_prompt_prefill_keeps_mlx_lms_chunked_form(arch, tiny_pair):
    model = specmlx.load(tiny_pair(arch)[0])
    ids = model.tokenizer.encode(PROMPT)
    assert len(ids) > stepwise.MAX_TOKENS
    results = []
    try:
        for on in (True, False):
            stepwise.set_enabled(on)
            # A short prompt over an empty cache; a long one, then a pass one token too
            # long to be stepped.
            short, long = make_cache(model.module), make_cache(model.module)
            outs = [
                model.module(mx.array([ids[:5]], mx.uint32), cache=short),
                model.module(mx.array([ids], mx.uint32), cache=long),
                model.module(mx.array([ids[: stepwise.MAX_TOKENS + 1]], mx.uint32), cache=long),
            ]
            results.append([*outs, *arrays(short), *arrays(long)])
            mx.eval(results[-1])
    finally:
        stepwise.set_enabled(True)
    assert bitwise_equal(*results)


@pytest.mark.parametrize("arch", ARCHS)
def test_rows_exact_says_exact_only_while_the_mixers_step(arch, tiny_pair):
    model = specmlx.load(tiny_pair(arch)[0])
    assert exactness.rows_exact(model.module)
    stepwise.set_enabled(False)
    try:
        assert not exactness.rows_exact(model.module)
    finally:
        stepwise.set_enabled(True)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_speculation_equals_the_target_alone(arch, tiny_pair):
    target, draft = (specmlx.load(path) for path in tiny_pair(arch))
    for m in (target, draft):
        m.tokenizer.eos_token_ids = set()  # every run decodes N tokens
    ids = target.tokenizer.encode(PROMPT)
    alone = specmlx.generate(target, ids, max_tokens=N, num_draft=0).run().tokens
    rewinds = 0
    for gamma in (1, 3, 8, "auto"):
        gen = specmlx.generate(target, ids, draft=draft, max_tokens=N, num_draft=gamma).run()
        assert gen.tokens == alone, f"gamma {gamma}"
        rewinds += gen.stats.rewinds
    assert rewinds > 0  # rejected drafts were rolled back and their accepted part re-run


def quantize_int4(source, dest, bits: int = 4):
    """An INT4 (group 32) copy of a tiny model, every layer mlx-lm can quantize quantized:
    what the native kernel runs (`bits`: another width for every layer)."""
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    model_class, args_class = model_classes(config)
    module = model_class(args_class.from_dict(config))
    module.load_weights(str(source / "model.safetensors"))
    nn.quantize(module, group_size=32, bits=bits)
    weights = dict(tree_flatten(module.parameters()))
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    config["quantization"] = {"group_size": 32, "bits": bits}
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


@pytest.mark.parametrize("arch", [*ARCHS, *exactness.RECURRENT_EXACT])
def test_int4_models_keep_int8_activations_and_speculate_exactly(
    arch, tiny_pair, int8_activations, tmp_path
):
    models = []
    for name, source in zip(("target", "draft"), tiny_pair(arch), strict=True):
        models.append(specmlx.load(quantize_int4(source, tmp_path / name)))
        models[-1].tokenizer.eos_token_ids = set()
    target, draft = models
    assert quantized.runs_int4(target.module)
    assert native.activations() == "int8"  # prepare found its passes exact
    (one, one_state), (steps, steps_state) = one_pass_and_steps(target, list(range(5, 14)))
    assert mx.array_equal(one, steps).item()
    assert bitwise_equal(one_state, steps_state)
    ids = target.tokenizer.encode(PROMPT)
    alone = specmlx.generate(target, ids, max_tokens=N, num_draft=0).run().tokens
    for gamma in (1, 3, "auto"):
        gen = specmlx.generate(target, ids, draft=draft, max_tokens=N, num_draft=gamma).run()
        assert gen.tokens == alone, f"gamma {gamma}"


def test_six_bit_layers_stay_on_mlx_where_passes_are_not_exact(
    tiny_pair, chunked, int8_activations, tmp_path
):
    # Chunked Mamba-2 passes are not bit-exact, so the load puts the kernel on float32 x;
    # 6-bit layers have int8-x tiles only, so they must be left to MLX's kernel, or they
    # would carry int8 x's rounding into the target's passes.
    models = []
    for name, source in zip(("target", "draft"), tiny_pair("mamba2"), strict=True):
        models.append(specmlx.load(quantize_int4(source, tmp_path / name, bits=6)))
        models[-1].tokenizer.eos_token_ids = set()
    target, draft = models
    assert native.activations() == "float32"
    six = [m for m in target.module.modules() if getattr(m, "bits", None) == 6]
    assert six and not any(isinstance(m, quantized.NativeQuantizedLinear) for m in six)
    ids = target.tokenizer.encode(PROMPT)
    alone = specmlx.generate(target, ids, max_tokens=N, num_draft=0).run().tokens
    gen = specmlx.generate(target, ids, draft=draft, max_tokens=N, num_draft=3).run()
    assert gen.tokens == alone
