"""The native stacked matmul (a layer's q, k and v projections as one op): each output is
bitwise the plain product's, and which attentions get it."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from specmlx.cpu import native, qkv, quantized

needs_stacked = pytest.mark.skipif(
    getattr(native._ext, "stacked_matmul", None) is None,
    reason=f"native kernel not available: {native.reason() or 'a build without stacked_matmul'}",
)


def projections(sizes=(256, 64, 64), k=128, bias=True, dtype=mx.float32, bits=4, seed=0):
    """Layers of one K on the kernel, like an attention's q, k and v."""
    mx.random.seed(seed)
    out = []
    for n in sizes:
        layer = nn.QuantizedLinear(k, n, bias=bias, group_size=64, bits=bits)
        layer.update({name: layer[name].astype(dtype) for name in ("scales", "biases")})
        if bias:
            layer.update({"bias": mx.random.normal((n,)).astype(dtype)})
        quantized.patch_model(layer)
        out.append(layer)
    return out


def stacked(x, layers):
    weights = [layer[p] for layer in layers for p in ("weight", "scales", "biases")]
    biases = [layer["bias"] for layer in layers] if "bias" in layers[0] else []
    return native._ext.stacked_matmul(x, weights, biases, 64, layers[0].bits)


@needs_stacked
@pytest.mark.parametrize("m", [1, 3, 9])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
def test_each_output_is_the_plain_product_to_the_bit(m, bias, bits, forced_isa, activations):
    layers = projections(sizes=(256, 63, 64), bias=bias, bits=bits)  # 63: a lone last row
    x = mx.random.normal((2, m, 128))
    for got, layer in zip(stacked(x, layers), layers, strict=True):
        assert got.shape == (2, m, layer["weight"].shape[0])
        assert mx.array_equal(got, layer(x))


@needs_stacked
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_inputs_and_scales_give_halves_like_the_plain_product(dtype):
    layers = projections(bias=False, dtype=dtype)
    x = mx.random.normal((1, 3, 128)).astype(dtype)
    for got, layer in zip(stacked(x, layers), layers, strict=True):
        assert got.dtype == dtype
        assert mx.array_equal(got, layer(x))


@needs_stacked
def test_matrices_of_different_k_or_scale_types_are_refused():
    q, k = projections(sizes=(64, 64), bias=False)
    (other_k,) = projections(sizes=(64,), k=256, bias=False, seed=1)
    (halves,) = projections(sizes=(64,), bias=False, dtype=mx.float16, seed=2)
    x = mx.random.normal((1, 1, 128))
    for odd in (other_k, halves):
        with pytest.raises(ValueError, match="share K and the scales' type"):
            stacked(x, [q, odd])
    with pytest.raises(ValueError, match="a bias for every matrix or for none"):
        native._ext.stacked_matmul(
            x, [q[p] for p in ("weight", "scales", "biases")] * 2, [mx.zeros((64,))], 64, 4
        )


def test_mlx_lm_attentions_that_make_q_k_v_in_one_line_are_recognised():
    from mlx_lm.models import gemma3_text, llama, qwen2, qwen3

    assert qkv._projects_qkv(llama.Attention)
    assert qkv._projects_qkv(qwen2.Attention)
    assert qkv._projects_qkv(qwen3.Attention)
    assert qkv._projects_qkv(gemma3_text.Attention)


def test_an_attention_that_projects_other_inputs_is_not_recognised():
    from mlx_lm.models import qwen2

    class Cross(qwen2.Attention):
        def __call__(self, x, mask=None, cache=None):
            queries, keys, values = self.q_proj(x), self.k_proj(mask), self.v_proj(mask)
            return queries + keys + values

    assert not qkv._projects_qkv(Cross)


@needs_stacked
def test_load_stacks_a_quantized_qwen2s_projections_without_changing_its_logits(
    quantized_tiny,
):
    plain, stacked_model = quantized_tiny(), quantized_tiny()
    for model in (plain, stacked_model):
        quantized.patch_model(model.module)
    attentions = [m for m in stacked_model.module.modules() if "q_proj" in m]
    assert qkv.patch_projections(stacked_model.module) == len(attentions) > 0
    assert all(isinstance(a.k_proj, qkv.NativeStackedLinear) for a in attentions)
    assert qkv.patch_projections(stacked_model.module) == 0  # already stacked
    tokens = mx.array([[1, 5, 9, 14, 3, 7]])
    assert mx.array_equal(stacked_model.module(tokens), plain.module(tokens))


@needs_stacked
def test_a_projection_called_with_another_x_computes_its_own_product():
    layers = projections()
    stack = qkv._Stack(layers)
    for slot, layer in enumerate(layers):
        layer.__class__ = qkv.NativeStackedLinear
        layer._stack, layer._slot = stack, slot
    plain = projections()  # the same layers (one seed), not stacked
    x, y = mx.random.normal((1, 2, 128)), mx.random.normal((1, 2, 128))
    layers[0](x)  # keeps k's and v's products of x
    assert mx.array_equal(layers[1](y), plain[1](y))  # y's, not x's
    assert mx.array_equal(layers[2](x), plain[2](x))  # x's, as kept
