"""The CPU weights modes: fp32 expansion of INT4 weights, the auto choice, and `cpu.prepare`."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

import specmlx
from specmlx import cpu
from specmlx.convert.quantize import quantize
from specmlx.cpu import fp32, native, qkv, quantized
from specmlx.exactness import passes_exact

TOKENS = mx.array([[3, 17, 42, 99, 7, 250, 11, 5]])

needs_native = pytest.mark.skipif(
    not native.available(), reason=f"native kernel not available: {native.reason()}"
)


def quantized_layers(module: nn.Module) -> list:
    return [m for m in module.modules() if fp32.is_quantized(m)]


@pytest.fixture(scope="module")
def int4_dir(model_dirs, tmp_path_factory):
    """The tiny qwen2 target in INT4 (embedding and head too), float32 scales."""
    out = tmp_path_factory.mktemp("int4") / "q"
    quantize(model_dirs["target"], out, group_size=32, embed_bits=4, dtype="float32")
    return out


def tiny_qwen2(tied: bool, head_bits: int = 4) -> nn.Module:
    """A one-layer qwen2, quantized to INT4 g32; an untied head at `head_bits`."""
    from mlx_lm.models import qwen2

    args = qwen2.ModelArgs.from_dict(
        {
            "model_type": "qwen2",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6,
            "vocab_size": 256,
            "tie_word_embeddings": tied,
        }
    )
    mx.random.seed(0)
    model = qwen2.Model(args)

    def bits(path: str, layer: nn.Module):
        if not hasattr(layer, "to_quantized"):
            return False
        return {"group_size": 32, "bits": head_bits} if path == "lm_head" else True

    nn.quantize(model, group_size=32, bits=4, class_predicate=bits)
    mx.eval(model.parameters())
    return model


# ---- the expansion ---------------------------------------------------------------------


def test_fp32_expansion_holds_exactly_the_dequantized_weights():
    model = tiny_qwen2(tied=False)
    layers = dict(model.named_modules())
    expected = {
        path: mx.dequantize(
            layer["weight"], layer["scales"], layer["biases"], group_size=32, bits=4
        ).astype(mx.float32)
        for path, layer in layers.items()
        if fp32.is_quantized(layer)
    }
    biases = {path: layers[path]["bias"] for path in expected if "bias" in layers[path]}
    assert biases  # qwen2's q/k/v projections carry one: it must survive the expansion

    assert fp32.expand_quantized(model) == len(expected)
    after = dict(model.named_modules())
    for path, weight in expected.items():
        layer = after[path]
        assert type(layer) in (nn.Linear, nn.Embedding), path
        assert layer.weight.dtype == mx.float32
        assert mx.array_equal(layer.weight, weight).item(), path
        if path in biases:
            assert mx.array_equal(layer.bias, biases[path]).item(), path


def test_fp32_expansion_keeps_logits_and_greedy_tokens(int4_dir):
    int4 = specmlx.load(int4_dir, cpu_weights="int4")
    dense = specmlx.load(int4_dir, cpu_weights="fp32")
    assert int4.weights == "int4" and quantized_layers(int4.module)
    assert dense.weights == "fp32" and not quantized_layers(dense.module)
    assert "expanded to fp32" in dense.describe()
    assert all(v.dtype == mx.float32 for _, v in tree_flatten(dense.module.parameters()))

    a, b = int4.module(TOKENS), dense.module(TOKENS)
    # Same weights, only the summation order differs.
    assert mx.abs(a - b).max().item() < 1e-4 * max(1.0, mx.abs(a).max().item())
    greedy = [
        specmlx.generate(m, "def fibonacci(n):", max_tokens=24, num_draft=0).tokens
        for m in (int4, dense)
    ]
    assert greedy[0] == greedy[1]


def test_fp32_target_speculates_with_an_int4_draft_exactly(int4_dir):
    dense = specmlx.load(int4_dir, cpu_weights="fp32")
    int4 = specmlx.load(int4_dir, cpu_weights="int4")
    alone = specmlx.generate(dense, "class Stack:", max_tokens=16, num_draft=0).tokens
    spec = specmlx.generate(dense, "class Stack:", draft=int4, max_tokens=16, num_draft=3)
    assert spec.tokens == alone


def test_tied_head_expands_and_stays_a_dense_matmul():
    model = tiny_qwen2(tied=True)
    before = model(TOKENS)
    assert fp32.expand_quantized(model) == 8  # 7 linears + the tied embedding
    assert type(model.model.embed_tokens) is nn.Embedding
    assert mx.allclose(model(TOKENS), before, atol=1e-4).item()


def test_expansion_can_leave_8_bit_layers_packed():
    # specmlx's checkpoints keep embeddings and heads at 8 bits: the native kernel runs
    # those faster than a float32 BLAS, so the fp32 mode leaves them packed.
    model = tiny_qwen2(tied=False, head_bits=8)
    before = model(TOKENS)
    assert fp32.expand_quantized(model, keep_bits=(8,)) == 8  # 7 linears + the embedding
    assert isinstance(model.lm_head, nn.QuantizedLinear) and model.lm_head.bits == 8
    assert mx.allclose(model(TOKENS), before, atol=1e-4).item()


def test_dense_params_counts_packed_values(model_dirs, int4_dir):
    dense = specmlx.load(model_dirs["target"])
    int4 = specmlx.load(int4_dir, cpu_weights="int4")
    expected = sum(v.size for _, v in tree_flatten(dense.module.parameters()))
    assert fp32.dense_params(int4.module) == expected


# ---- the choice ------------------------------------------------------------------------


def no_blas_look_up():
    raise AssertionError("auto asked for the BLAS where the native kernel decides")


def test_auto_keeps_int4_where_the_native_kernel_runs_without_asking_the_blas(monkeypatch):
    module = tiny_qwen2(tied=False)
    monkeypatch.setattr(fp32.quantized, "runs_int4", lambda m: True)
    monkeypatch.setattr(fp32, "fast_blas_active", no_blas_look_up)
    monkeypatch.setattr(fp32, "available_memory", lambda: 1 << 40)
    assert fp32.pick_cpu_weights(module, "auto", "cpu") == ("int4", "native INT4 kernel")


@needs_native
def test_auto_loads_int4_on_this_machines_native_kernel(int4_dir, monkeypatch):
    monkeypatch.setattr(fp32, "fast_blas_active", no_blas_look_up)
    model = specmlx.load(int4_dir)
    assert (model.weights, model.weights_why) == ("int4", "native INT4 kernel")
    assert any(isinstance(m, quantized.NativeQuantizedLinear) for m in model.module.modules())


def test_auto_expands_only_without_the_native_kernel_on_a_fast_blas_with_room(monkeypatch):
    module = tiny_qwen2(tied=False)
    monkeypatch.setattr(fp32.quantized, "runs_int4", lambda m: False)
    monkeypatch.setattr(fp32, "fast_blas_active", lambda: True)
    monkeypatch.setattr(fp32, "available_memory", lambda: 1 << 40)
    assert fp32.pick_cpu_weights(module, "auto", "cpu")[0] == "fp32"
    assert fp32.pick_cpu_weights(module, "auto", "gpu") == ("int4", "backend is gpu")
    monkeypatch.setattr(fp32, "available_memory", lambda: fp32.dense_params(module) * 4)
    mode, why = fp32.pick_cpu_weights(module, "auto", "cpu")
    assert mode == "int4" and "available" in why  # 4 bytes/param fit, the 1.3 margin not
    monkeypatch.setattr(fp32, "available_memory", lambda: 1 << 40)
    monkeypatch.setattr(fp32, "fast_blas_active", lambda: False)
    assert fp32.pick_cpu_weights(module, "auto", "cpu")[0] == "int4"
    # Loading without the native kernel: its availability does not count.
    monkeypatch.setattr(fp32, "fast_blas_active", lambda: True)
    monkeypatch.setattr(fp32.quantized, "runs_int4", lambda m: True)
    assert fp32.pick_cpu_weights(module, "auto", "cpu", use_native=False)[0] == "fp32"


def test_an_explicit_mode_is_kept_anywhere(monkeypatch):
    module = tiny_qwen2(tied=False)
    monkeypatch.setattr(fp32, "fast_blas_active", no_blas_look_up)
    for backend in ("cpu", "gpu"):
        assert fp32.pick_cpu_weights(module, "int4", backend) == ("int4", "requested")
        assert fp32.pick_cpu_weights(module, "fp32", backend) == ("fp32", "requested")


def test_dense_checkpoint_and_bad_mode(models):
    assert models["target"].weights == "dense"
    with pytest.raises(specmlx.SpecmlxError, match="auto, int4, fp32"):
        cpu.prepare(models["target"].module, "fp16", "cpu", passes_exact=passes_exact)


# ---- prepare: the choice, the expansion and the kernel, in that order ---------------------


@needs_native
def test_prepare_fp32_leaves_the_8_bit_head_packed_on_the_native_kernel():
    model = tiny_qwen2(tied=False, head_bits=8)
    assert cpu.prepare(model, "fp32", "cpu", passes_exact=passes_exact) == ("fp32", "requested")
    assert type(model.lm_head) is quantized.NativeQuantizedLinear
    assert type(model.model.embed_tokens) is nn.Embedding
    assert not [m for m in model.modules() if fp32.is_quantized(m) and m is not model.lm_head]


def test_prepare_without_the_native_kernel_expands_every_layer():
    model = tiny_qwen2(tied=False, head_bits=8)
    assert cpu.prepare(model, "fp32", "cpu", use_native=False, passes_exact=passes_exact) == (
        "fp32",
        "requested",
    )
    assert not quantized_layers(model)


@needs_native
def test_prepare_int4_routes_every_layer_through_the_native_kernel():
    model = tiny_qwen2(tied=False)
    before = model(TOKENS)
    assert cpu.prepare(model, "int4", "cpu", passes_exact=passes_exact) == ("int4", "requested")
    kinds = {type(m) for m in quantized_layers(model)}
    # q, k and v run stacked (patch_projections): native layers of their own subclass
    assert kinds == {
        quantized.NativeQuantizedLinear,
        qkv.NativeStackedLinear,
        quantized.NativeQuantizedEmbedding,
    }
    assert mx.allclose(model(TOKENS), before, atol=1e-4).item()
