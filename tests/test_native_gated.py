"""The native gated matmul, silu(x @ gate^T) * (x @ up^T): agreement with MLX's silu over
the kernel's own matmuls, rows independent of the rows beside them, and which MLPs get it."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from specmlx.cpu import mlp, native, quantized

needs_gated = pytest.mark.skipif(
    getattr(native._ext, "gated_matmul", None) is None,
    reason=f"native kernel not available: {native.reason() or 'a build without gated_matmul'}",
)


def layers(n=200, k=256, group_size=64, bits=4, dtype=mx.float32, seed=0):
    """A gate and an up projection on the kernel."""
    mx.random.seed(seed)
    out = []
    for _ in range(2):
        layer = nn.QuantizedLinear(k, n, bias=False, group_size=group_size, bits=bits)
        layer.update(
            {"scales": layer["scales"].astype(dtype), "biases": layer["biases"].astype(dtype)}
        )
        quantized.patch_model(layer)
        out.append(layer)
    return out


@needs_gated
@pytest.mark.parametrize("m", [1, 2, 5, 17])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("activation", ["silu", "gelu_approx"])
def test_is_mlx_activation_of_the_kernels_products(m, bits, activation, forced_isa, activations):
    gate, up = layers(bits=bits)
    x = mx.random.normal((1, m, 256)) * 4
    want = mlp.GATE_ACTIVATIONS[activation](gate(x)) * up(x)
    got = mlp.gated_matmul(x, gate, up, activation)
    # Only the activation's rounding differs (a vector exp against MLX's sigmoid or tanh).
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()


@needs_gated
@pytest.mark.parametrize("activation", ["silu", "gelu_approx"])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(activation, forced_isa, activations):
    gate, up = layers()
    x = mx.random.normal((1, 9, 256))
    together = mlp.gated_matmul(x, gate, up, activation)
    for i in range(9):
        alone = mlp.gated_matmul(x[:, i : i + 1], gate, up, activation)
        assert mx.array_equal(alone, together[:, i : i + 1])


@needs_gated
def test_avx2_and_avx512_agree_to_the_bit():
    if native._ext.isa() != "avx512":
        pytest.skip("needs AVX-512 to compare with")
    gate, up = layers(n=1000)
    x = mx.random.normal((1, 3, 256)) * 8  # large |g|: both tails of the sigmoid
    wide = [mlp.gated_matmul(x, gate, up, a) for a in mlp.GATE_ACTIVATIONS]
    native._ext.set_isa("avx2")
    try:
        narrow = [mlp.gated_matmul(x, gate, up, a) for a in mlp.GATE_ACTIVATIONS]
        assert all(mx.array_equal(a, b) for a, b in zip(narrow, wide, strict=True))
    finally:
        native._ext.set_isa("avx512")


@needs_gated
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_inputs_and_scales(dtype):
    gate, up = layers(dtype=dtype)
    x = mx.random.normal((1, 3, 256)).astype(dtype)
    got = mlp.gated_matmul(x, gate, up)
    want = nn.silu(gate(x).astype(mx.float32)) * up(x).astype(mx.float32)
    assert got.dtype == dtype
    assert mx.allclose(got.astype(mx.float32), want, rtol=1e-2, atol=1e-2).item()


@needs_gated
def test_layers_the_op_cannot_pair_take_the_two_matmuls():
    gate, _ = layers(group_size=64)
    up, _ = layers(group_size=32, seed=1)
    plain = nn.QuantizedLinear(256, 200, bias=False, group_size=64, bits=4)  # not on the kernel
    x = mx.random.normal((1, 2, 256))
    for other in (up, plain):
        assert mx.array_equal(mlp.gated_matmul(x, gate, other), nn.silu(gate(x)) * other(x))


def test_mlx_lm_gated_mlps_are_recognised_with_their_activation():
    from mlx_lm.models import gemma3_text, llama, qwen2, qwen3, starcoder2

    assert mlp._gated_activation(llama.MLP) == "silu"  # nn.silu(gate) * up
    assert mlp._gated_activation(qwen2.MLP) == "silu"  # swiglu(gate, up)
    assert mlp._gated_activation(qwen3.MLP) == "silu"
    assert mlp._gated_activation(gemma3_text.MLP) == "gelu_approx"
    assert mlp._gated_activation(starcoder2.MLP) is None  # not gated


def test_a_variant_of_the_body_is_not_recognised():
    from mlx_lm.models import qwen2

    class Clamped(qwen2.MLP):
        def __call__(self, x):
            return self.down_proj(nn.silu(mx.minimum(self.gate_proj(x), 7.0)) * self.up_proj(x))

    class Scaled(qwen2.MLP):
        def __call__(self, x):
            return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x)) * 2

    assert mlp._gated_activation(Clamped) is None
    assert mlp._gated_activation(Scaled) is None


@needs_gated
def test_load_gives_a_quantized_qwen2_the_gated_op(quantized_tiny):
    plain, patched = quantized_tiny(), quantized_tiny()
    quantized.patch_model(patched.module)
    mlps = [m for m in patched.module.modules() if "gate_proj" in m]
    assert mlp.patch_mlps(patched.module) == len(mlps) > 0
    assert all(isinstance(m, mlp._GatedMLP) for m in mlps)
    assert mlp.patch_mlps(patched.module) == 0  # already patched
    tokens = mx.array([[1, 5, 9, 14, 3, 7]])
    quantized.patch_model(plain.module)  # the same matmuls, MLX's silu
    a, b = patched.module(tokens), plain.module(tokens)
    assert (mx.abs(a - b).max() / mx.abs(b).max()).item() < 1e-4
