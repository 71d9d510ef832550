"""Compiled norms, RoPE and MLPs (specmlx.compiled): which modules a loaded model compiles,
which passes take them, that they change no bit here, and that speculation stays exact."""

import platform

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

import specmlx
from specmlx import compiled
from specmlx.caches import checkpoint, make_cache, prefill, rewind, trim
from specmlx.cpu import layers as cpu_layers
from specmlx.cpu import native
from specmlx.errors import SpecmlxError
from specmlx.tiny import build_tiny_model

PROMPT = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):"
# MLX builds its fused CPU kernels with `g++ -O3` and no -march: on x86-64 nothing is
# contracted into a multiply-add, so they round as the ops they replace.
X86 = platform.machine().lower() in ("x86_64", "amd64")


@pytest.fixture
def compile_on():
    before = compiled.enabled()
    compiled.set_enabled(True)
    yield
    compiled.set_enabled(before)


def logits(model, cache, tokens: list[int], on: bool) -> mx.array:
    """The model's logits over `tokens` after the cache, compiled or not; the cache is
    left as it was."""
    compiled.set_enabled(on)
    saved = checkpoint(cache)
    out = model.module(mx.array([tokens], mx.uint32), cache=cache)
    mx.eval(out)
    rewind(model, cache, saved, [], len(tokens))
    return out


def prefilled(model, n: int = 40) -> list:
    cache = make_cache(model.module)
    prefill(model, cache, [(7 * i) % 200 + 3 for i in range(n)])
    return cache


@pytest.mark.parametrize("name", ["target", "llama"])
def test_loading_compiles_every_norm_rope_and_mlp_the_native_ops_do_not_take(name, model_dirs):
    model = specmlx.load(model_dirs[name])
    reference = specmlx.load(model_dirs[name], native=False)  # prepared for MLX alone
    layers = model.module.model.layers
    swapped = [m for m in model.module.modules() if isinstance(m, compiled._CompiledModule)]
    native_layers = [m for m in model.module.modules() if type(m) in cpu_layers.SWAPS.values()]
    # Per layer 2 norms, a RoPE and an MLP, and the final norm: the native ops take the
    # norms and RoPEs where the kernel is built, compiled.py everything left.
    assert len(swapped) + len(native_layers) == 4 * len(layers) + 1
    assert len(native_layers) == (3 * len(layers) + 1 if native.available() else 0)
    assert not any(isinstance(m, compiled._CompiledModule) for m in reference.module.modules())
    assert isinstance(layers[0].mlp, type(reference.module.model.layers[0].mlp))
    assert [k for k, _ in tree_flatten(model.module.parameters())] == [
        k for k, _ in tree_flatten(reference.module.parameters())
    ]
    assert compiled.patch_model(model.module) == 0  # once is enough


def test_a_model_on_a_gpu_is_compiled_only_when_asked(monkeypatch, model_dirs):
    model = specmlx.load(model_dirs["llama"], native=False)
    monkeypatch.setattr(compiled.mx, "default_device", lambda: mx.gpu)
    assert compiled.patch_model(model.module) == 0
    assert not any(isinstance(m, compiled._CompiledModule) for m in model.module.modules())
    # 2 norms, a RoPE and an MLP a layer, and the final norm
    assert compiled.patch_model(model.module, cpu_only=False) == 4 * len(model.module.layers) + 1


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """A tiny Gemma 3: its own RMSNorm class (scaled by 1 + weight), sliding windows."""
    path = build_tiny_model(tmp_path_factory.mktemp("gemma") / "gemma3", arch="gemma3_text")
    return specmlx.load(path)


def test_an_architectures_own_rmsnorm_is_compiled_and_changes_no_bit(gemma, compile_on):
    norms = [m for m in gemma.module.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all(isinstance(m, compiled._CompiledModule) for m in norms)
    assert not isinstance(norms[0], nn.RMSNorm)  # Gemma's own class
    cache = prefilled(gemma)
    tokens = [11, 42, 7]
    on = logits(gemma, cache, tokens, on=True)
    if X86:
        assert mx.array_equal(on, logits(gemma, cache, tokens, on=False))


def test_only_passes_of_at_most_max_tokens_take_the_compiled_modules(models, compile_on):
    model = models["target"]
    mlp = model.module.model.layers[-1].mlp
    traced, calls = mlp._compiled, []

    def counting(x):
        calls.append(x.shape[1])
        return traced(x)

    object.__setattr__(mlp, "_compiled", counting)
    try:
        cache = prefilled(model)
        for n in (1, compiled.MAX_TOKENS, compiled.MAX_TOKENS + 1):
            logits(model, cache, list(range(10, 10 + n)), on=True)
        logits(model, cache, [5], on=False)
    finally:
        object.__setattr__(mlp, "_compiled", traced)
    assert calls == [1, compiled.MAX_TOKENS]


@pytest.mark.skipif(not X86, reason="MLX's kernels may contract multiply-adds elsewhere")
@pytest.mark.parametrize("name", ["target", "llama"])
@pytest.mark.parametrize("n", [1, 4])
def test_compiled_logits_equal_uncompiled_bit_for_bit(name, n, models, compile_on):
    model = models[name]
    cache = prefilled(model)
    tokens = list(range(20, 20 + n))
    assert mx.array_equal(
        logits(model, cache, tokens, on=True), logits(model, cache, tokens, on=False)
    )


@pytest.mark.parametrize("name", ["target", "llama"])
def test_a_compiled_verify_row_is_bitwise_its_compiled_step(name, models, compile_on):
    model = models[name]
    cache = prefilled(model)
    tokens = [11, 42, 7, 99]
    full = logits(model, cache, tokens, on=True)
    steps = []
    for t in tokens:
        steps.append(model.module(mx.array([[t]], mx.uint32), cache=cache))
        mx.eval(steps[-1])
    trim(cache, len(tokens))
    assert mx.array_equal(full, mx.concatenate(steps, axis=1))


@pytest.mark.parametrize("pair", [("target", "perturbed"), ("llama", "llama_draft")])
def test_greedy_speculation_with_compiled_modules_equals_the_target_alone(pair, models, compile_on):
    target, draft = models[pair[0]], models[pair[1]]
    ids = target.tokenizer.encode(PROMPT)
    alone = specmlx.generate(target, ids, max_tokens=24, num_draft=0).run().tokens
    for gamma in (1, 3, "auto"):
        gen = specmlx.generate(target, ids, draft=draft, max_tokens=24, num_draft=gamma).run()
        assert gen.tokens == alone, f"gamma {gamma}"


def test_env_var_turns_it_off_and_a_bad_value_is_one_line(monkeypatch):
    monkeypatch.setenv(compiled.ENV, "0")
    assert compiled._env() == (False, "")
    monkeypatch.setenv(compiled.ENV, "")
    assert compiled._env() == (True, "")
    monkeypatch.setenv(compiled.ENV, "yes")
    assert compiled._env() == (True, "SPECMLX_COMPILE must be 0 or 1, got 'yes'")


def test_a_bad_env_value_stops_loading_in_one_line(monkeypatch, model_dirs):
    monkeypatch.setattr(compiled, "_env_problem", "SPECMLX_COMPILE must be 0 or 1, got 'yes'")
    with pytest.raises(SpecmlxError, match="SPECMLX_COMPILE must be 0 or 1"):
        specmlx.load(model_dirs["target"])
