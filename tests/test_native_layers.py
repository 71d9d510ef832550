"""The native RMSNorm and RoPE (specmlx.cpu.layers): MLX's formulas within float32
rounding, each row's bits its own whatever rows run beside it, views read in place, and
MLX's own code for every call they do not cover."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from specmlx.cpu import layers, native

needs_ops = pytest.mark.skipif(
    native.op("rope") is None,
    reason=f"native kernel not available: {native.reason() or 'a build without rope'}",
)


def native_pair(make):
    """Two layers from make(): MLX's, and one swapped onto the native op."""
    ours = make()
    ours.__class__ = layers.SWAPS[type(ours)]
    return make(), ours


def rope_pair(dims=64, traditional=False):
    return native_pair(lambda: nn.RoPE(dims, traditional=traditional, base=1_000_000.0))


def norm_pair(dims=1536):
    mx.random.seed(3)
    weight = mx.random.normal((dims,))

    def make():
        norm = nn.RMSNorm(dims, eps=1e-6)
        norm.weight = weight
        return norm

    return native_pair(make)


@needs_ops
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims", [64, 32])  # all of D, and a partial rotary part
@pytest.mark.parametrize("offset", [0, 7, 300])
def test_rope_is_mlx_rope_within_float32_rounding(traditional, dims, offset):
    mlx_rope, ours = rope_pair(dims, traditional)
    x = mx.random.normal((1, 4, 9, 64))
    # angles up to ~300 rad: both sides' cos and sin round differently there
    assert mx.allclose(ours(x, offset), mlx_rope(x, offset), atol=1e-4, rtol=1e-4).item()


@needs_ops
def test_rope_rows_are_their_positions_alone():
    _, ours = rope_pair()
    x = mx.random.normal((1, 4, 9, 64))
    together = ours(x, 100)
    for t in range(9):
        assert mx.array_equal(ours(x[:, :, t : t + 1], 100 + t), together[:, :, t : t + 1])


@needs_ops
def test_rope_reads_a_transposed_view_in_place():
    _, ours = rope_pair()
    x = mx.random.normal((1, 9, 4, 64))  # (B, T, H, D) as the projections leave it
    view = x.transpose(0, 2, 1, 3)
    assert mx.array_equal(ours(view, 5), ours(mx.contiguous(view), 5))


@needs_ops
def test_rope_takes_an_array_offset_as_the_compiled_trace_passes_it():
    _, ours = rope_pair()
    x = mx.random.normal((1, 4, 3, 64))
    assert mx.array_equal(ours(x, mx.array(12)), ours(x, 12))


@needs_ops
def test_rope_leaves_calls_it_does_not_cover_to_mlx():
    mlx_rope, ours = rope_pair()
    x = mx.random.normal((2, 4, 3, 64))
    per_sequence = mx.array([3, 9])  # a batch with one offset per sequence
    assert mx.array_equal(ours(x, per_sequence), mlx_rope(x, per_sequence))
    half = x.astype(mx.float16)
    assert mx.array_equal(ours(half, 4), mlx_rope(half, 4))


@needs_ops
@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_rms_norm_is_mlx_rms_norm_within_float32_rounding(isa):
    best = native._ext.isa()
    if isa == "avx2" and best == "scalar":
        pytest.skip("this CPU has no AVX2")
    native._ext.set_isa(isa)
    try:
        mlx_norm, ours = norm_pair()
        x = mx.random.normal((1, 5, 1536)) * 3
        assert mx.allclose(ours(x), mlx_norm(x), rtol=1e-5, atol=1e-5).item()
    finally:
        native._ext.set_isa(best)


@needs_ops
def test_rms_norm_rows_are_their_own():
    _, ours = norm_pair()
    x = mx.random.normal((1, 9, 1536))
    together = ours(x)
    for t in range(9):
        assert mx.array_equal(ours(x[:, t : t + 1]), together[:, t : t + 1])


@needs_ops
def test_rms_norm_reads_a_strided_view():
    _, ours = norm_pair(64)
    x = mx.random.normal((9, 1, 64))
    view = x.transpose(1, 0, 2)
    assert mx.array_equal(ours(view), ours(mx.contiguous(view)))


@needs_ops
def test_rms_norm_leaves_half_inputs_to_mlx():
    mlx_norm, ours = norm_pair(64)
    x = mx.random.normal((1, 3, 64)).astype(mx.bfloat16)
    assert mx.array_equal(ours(x), mlx_norm(x))


@needs_ops
def test_patch_model_swaps_mlxs_own_classes_only():
    class OwnNorm(nn.Module):  # an architecture's own norm keeps its code
        def __init__(self):
            super().__init__()
            self.weight = mx.ones((8,))

        def __call__(self, x):
            return x * self.weight

    model = nn.Sequential(nn.RMSNorm(8), nn.RoPE(8), OwnNorm())
    assert layers.patch_model(model) == 2
    assert isinstance(model.layers[0], layers.NativeRMSNorm)
    assert isinstance(model.layers[1], layers.NativeRoPE)
    assert type(model.layers[2]) is OwnNorm
    assert layers.patch_model(model) == 0
