"""The CPU dtype policy: quantized models run with float32 scales and activations on the
CPU (MLX's CPU kernels are fast only in float32), with the same results as the
checkpoint's own bfloat16 up to bfloat16's precision."""

import mlx.core as mx
import numpy as np
import pytest

import specmlx
from specmlx.convert.quantize import quantize
from specmlx.cpu import native, quantized
from specmlx.loading import backend

PROMPT = [5, 17, 42, 99, 7, 123]


@pytest.fixture(scope="module")
def bf16_int4(model_dirs, tmp_path_factory):
    """The tiny target as an mlx-community-style checkpoint: INT4, bfloat16 scales."""
    out = tmp_path_factory.mktemp("bf16") / "int4-bf16"
    quantize(model_dirs["target"], out, bits=4, group_size=64, embed_bits=4, dtype="bfloat16")
    return out


def floating_dtypes(model, skip_native_halves=False):
    """The floating dtypes among the model's parameters; with `skip_native_halves`, not
    counting the scales and biases of layers on the native kernel, which it widens to
    float32 exactly as it reads them (kept as stored: quantized.keep_stored_halves)."""
    from mlx.utils import tree_flatten

    native_layers = {
        path
        for path, layer in model.module.named_modules()
        if isinstance(layer, (quantized.NativeQuantizedLinear, quantized.NativeQuantizedEmbedding))
    }

    def on_native(name: str) -> bool:
        path, _, leaf = name.rpartition(".")
        return leaf in quantized.HALF_IN_PLACE and path in native_layers

    return {
        v.dtype
        for name, v in tree_flatten(model.module.parameters())
        if mx.issubdtype(v.dtype, mx.floating) and not (skip_native_halves and on_native(name))
    }


def test_on_the_cpu_auto_runs_a_bf16_checkpoint_in_float32(bf16_int4):
    assert backend() == "cpu"
    model = specmlx.load(bf16_int4)
    assert model.dtype == "float32"
    assert floating_dtypes(model, skip_native_halves=native.available()) == {mx.float32}


def test_an_explicit_dtype_keeps_the_checkpoint_precision(bf16_int4):
    model = specmlx.load(bf16_int4, dtype="bfloat16")
    assert floating_dtypes(model) == {mx.bfloat16}


@pytest.mark.parametrize("native", [False, True])
def test_float32_policy_matches_bf16_logits_within_bf16_precision(bf16_int4, native):
    x = mx.array([PROMPT])
    fp32 = specmlx.load(bf16_int4, native=native).module(x)[0].astype(mx.float32)
    bf16 = specmlx.load(bf16_int4, dtype="bfloat16", native=native).module(x)[0].astype(mx.float32)
    a, b = np.array(fp32), np.array(bf16)
    spread = a.max() - a.min()
    # bfloat16 keeps 8 significant bits: ~0.4% per rounding, a few roundings deep.
    assert np.abs(a - b).max() < 0.03 * spread
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.8
