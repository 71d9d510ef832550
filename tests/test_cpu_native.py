"""The native INT4/INT8 CPU kernel: agreement with MLX, layouts and threads, the fallbacks."""

import json
import os
import platform
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import specmlx
from specmlx.cpu import native, ops
from specmlx.cpu.quantized import NativeQuantizedLinear, patch_model
from specmlx.errors import SpecmlxError

needs_native = pytest.mark.skipif(
    not native.available(), reason=f"native kernel not available: {native.reason()}"
)
linux_x86 = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"),
    reason="the native kernel is built only on Linux x86_64",
)
FLOATS = [mx.float32, mx.bfloat16, mx.float16]


def quantized(n, k, group_size=64, bits=4, dtype=mx.float32, seed=0):
    mx.random.seed(seed)
    w, scales, biases = mx.quantize(mx.random.normal((n, k)), group_size=group_size, bits=bits)
    return w, scales.astype(dtype), biases.astype(dtype)


def truth(x, w, scales, biases, group_size, bits=4):
    """x @ dequant(w).T in float32 from float32 operands: what both kernels approximate."""
    f32 = mx.float32
    s, b = scales.astype(f32), biases.astype(f32)
    dense = mx.dequantize(w, s, b, group_size=group_size, bits=bits)
    return x.astype(f32) @ dense.T


def rel_err(a, b):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.abs(a - b).max() / mx.maximum(mx.abs(b).max(), 1e-6)).item()


def tol(dtype):
    """Relative tolerance: float32 sums differ only in order; halves round the output."""
    return 2e-5 if dtype == mx.float32 else 1e-2


@pytest.fixture
def each_isa():
    """Run a test body under every ISA this CPU has; restore the best afterwards."""
    best = native._ext.isa()
    names = ["scalar", "avx2", "avx512"]
    yield names[: names.index(best) + 1]
    native._ext.set_isa(best)


@needs_native
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("m", range(1, 18))
def test_matches_mlx_every_row_count(m, group_size, bits, each_isa):
    w, s, b = quantized(37, 3 * group_size, group_size, bits)  # odd N: a lone last row
    x = mx.random.normal((m, 3 * group_size))
    ref = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=group_size, bits=bits)
    for isa in each_isa:
        native._ext.set_isa(isa)
        out = ops.quantized_matmul(x, w, s, b, group_size, bits)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert rel_err(out, ref) < 2e-5, isa


@needs_native
@pytest.mark.parametrize("n,k", [(1, 64), (2, 128), (3, 192), (129, 320)])
def test_odd_shapes(n, k):
    w, s, b = quantized(n, k)
    x = mx.random.normal((5, k))
    ref = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4)
    assert rel_err(ops.quantized_matmul(x, w, s, b, 64), ref) < 2e-5


@needs_native
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("x_dtype", FLOATS)
@pytest.mark.parametrize("scale_dtype", FLOATS)
def test_dtypes(x_dtype, scale_dtype, bits, each_isa):
    w, s, b = quantized(40, 256, 64, bits, dtype=scale_dtype)
    x = mx.random.normal((3, 256)).astype(x_dtype)
    expected = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=bits).dtype
    want = truth(x, w, s, b, 64, bits)
    for isa in each_isa:
        native._ext.set_isa(isa)
        out = ops.quantized_matmul(x, w, s, b, 64, bits)
        assert out.dtype == expected  # promote_types(x, scales), as MLX does
        assert rel_err(out, want) < tol(out.dtype), isa


@needs_native
def test_non_contiguous_and_batched_inputs():
    w, s, b = quantized(48, 256)
    big = mx.random.normal((4, 6, 512))
    cases = {
        "3-D": big[:, :, :256],
        "strided": big[:, ::2, ::2],
        "transposed": mx.random.normal((256, 5)).T,
        "broadcast": mx.broadcast_to(mx.random.normal((1, 256)), (3, 256)),
        "1-D": mx.random.normal((256,)),
    }
    for name, x in cases.items():
        ref = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4)
        out = ops.quantized_matmul(x, w, s, b, 64)
        assert out.shape == ref.shape, name
        assert rel_err(out, ref) < 2e-5, name
    # weights sliced out of a larger matrix (every other output row)
    w2, s2, b2 = quantized(96, 256, seed=1)
    x = mx.random.normal((2, 256))
    ref = mx.quantized_matmul(x, w2[::2], s2[::2], b2[::2], transpose=True, group_size=64, bits=4)
    assert rel_err(ops.quantized_matmul(x, w2[::2], s2[::2], b2[::2], 64), ref) < 2e-5


@needs_native
def test_inside_compile_and_lazy_graphs():
    w, s, b = quantized(64, 128)

    def layer(x):
        return mx.maximum(ops.quantized_matmul(x * 2.0, w, s, b, 64), 0.0) + 1.0

    x = mx.random.normal((3, 128))
    eager = layer(x)
    compiled = mx.compile(layer)
    assert rel_err(compiled(x), eager) < 1e-6
    assert rel_err(compiled(x + 1.0), layer(x + 1.0)) < 1e-6  # retraced input, same graph
    shapeless = mx.compile(layer, shapeless=True)
    for m in (1, 4):
        x = mx.random.normal((m, 128))
        assert rel_err(shapeless(x), layer(x)) < 1e-6
    # nothing evaluated yet: weights and x are both outputs of pending computations
    lazy = ops.quantized_matmul(mx.ones((2, 128)) * 0.5, w + 0, s * 1.0, b * 1.0, 64)
    ref = mx.quantized_matmul(mx.full((2, 128), 0.5), w, s, b, transpose=True, group_size=64)
    assert rel_err(lazy, ref) < 2e-5


@needs_native
def test_threads_agree():
    w, s, b = quantized(1030, 2048)  # big enough to be split across threads
    x = mx.random.normal((3, 2048))
    before = native.threads()
    try:
        native.set_threads(1)
        one = ops.quantized_matmul(x, w, s, b, 64)
        mx.eval(one)
        for n in (3, 2, 3):  # fresh workers are handed work at once: no lost wake-ups
            native.set_threads(n)
            assert native.threads() == n
            many = ops.quantized_matmul(x, w, s, b, 64)
            assert mx.array_equal(one, many).item()  # rows are split, sums are not: bit-equal
    finally:
        native.set_threads(before)


@needs_native
def test_empty_rows():
    w, s, b = quantized(8, 64)
    out = ops.quantized_matmul(mx.zeros((0, 64)), w, s, b, 64)
    assert out.shape == (0, 8)


@needs_native
def test_bad_operands_raise():
    w, s, b = quantized(8, 128)
    with pytest.raises(ValueError):
        native._ext.quantized_matmul(mx.zeros((2, 64)), w, s, b, 64)  # wrong K
    with pytest.raises(ValueError):
        native._ext.quantized_matmul(mx.zeros((2, 128)), w, s, b, 48)  # group size
    with pytest.raises(ValueError):
        native._ext.quantized_matmul(mx.zeros((2, 128)), w, s, b, 64, 5)  # bits


def test_unsupported_calls_fall_back_to_mlx():
    x = mx.random.normal((3, 128))
    for bits in (2, 3, 5):  # (6 under float32 x: tests/test_native_int8.py)
        w, s, b = quantized(16, 128, bits=bits)
        assert not ops.supports(x, w, s, b, 64, bits)
        ref = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=bits)
        assert mx.array_equal(ops.quantized_matmul(x, w, s, b, 64, bits), ref).item()
    w, s, b = quantized(16, 128)
    assert not ops.supports(x, w, s, None, 64, 4)  # no biases: not affine
    assert not ops.supports(x, w, s, b, 64, 4, mode="mxfp4")
    assert not ops.supports(x, w, s, b, 64, 4, transpose=False)


def test_gpu_streams_fall_back(monkeypatch):
    w, s, b = quantized(16, 128)
    x = mx.random.normal((2, 128))
    monkeypatch.setattr(native.mx, "default_device", lambda: mx.gpu)
    assert not ops.supports(x, w, s, b, 64, 4)
    assert patch_model(nn.QuantizedLinear(128, 16)) == 0


def test_unavailable_kernel_falls_back(monkeypatch):
    monkeypatch.setattr(native, "_ext", None)
    monkeypatch.setattr(native, "_reason", "not built")
    w, s, b = quantized(16, 128)
    x = mx.random.normal((2, 128))
    ref = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4)
    assert mx.array_equal(ops.quantized_matmul(x, w, s, b, 64), ref).item()
    assert patch_model(nn.QuantizedLinear(128, 16)) == 0
    assert not native.available() and "not built" in native.describe()


@linux_x86
def test_version_guard(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECMLX_NATIVE", raising=False)  # its refusal would come first
    (tmp_path / native.BUILD_INFO).write_text(json.dumps({"mlx": "0.31.2"}))
    ext, why = native._load(tmp_path, mlx_version="0.32.4")
    assert ext is None
    assert "built for mlx 0.31.2 but mlx 0.32.4 is installed" in why


@linux_x86
def test_missing_or_broken_build(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECMLX_NATIVE", raising=False)  # set later, by this test
    ext, why = native._load(tmp_path)
    assert ext is None and "not built" in why
    (tmp_path / native.BUILD_INFO).write_text(json.dumps({"mlx": mx.__version__}))
    ext, why = native._load(tmp_path, module="specmlx.cpu._native._no_such_ext")
    assert ext is None and "failed to import" in why
    monkeypatch.setenv("SPECMLX_NATIVE", "0")
    assert native._load(tmp_path) == (None, "disabled by SPECMLX_NATIVE=0")


@needs_native
def test_specmlx_isa_avx2_runs_the_avx2_code_on_the_packed_layout():
    # the AVX2 four-row tile reads pack_quad's layout too; SPECMLX_ISA=scalar packs nothing
    code = "from specmlx.cpu import native; print(native._ext.isa(), native._ext.reads_packed())"
    for isa, packs in (("avx2", "True"), ("scalar", "False")):
        env = dict(os.environ, SPECMLX_ISA=isa)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [isa, packs]


@needs_native
@pytest.mark.parametrize("value", ["amx", "AVX2"])
def test_an_unknown_specmlx_isa_stops_model_preparation_in_one_line(value, monkeypatch):
    monkeypatch.setenv(native.ENV_ISA, value)
    best = native._ext.isa()
    problem = native._env_isa()
    assert problem == f"SPECMLX_ISA must be one of avx512, avx2, scalar, got {value!r}"
    assert native._ext.isa() == best
    monkeypatch.setattr(native, "_env_problem", problem)
    with pytest.raises(SpecmlxError, match="SPECMLX_ISA"):
        patch_model(nn.QuantizedLinear(128, 16))


def test_a_specmlx_isa_above_the_cpus_best_names_the_best(monkeypatch):
    class AvxTwoOnly:
        def set_isa(self, name):
            raise ValueError(f"[specmlx] this CPU does not support {name} (best: avx2)")

        def isa(self):
            return "avx2"

    monkeypatch.setattr(native, "_ext", AvxTwoOnly())
    monkeypatch.setenv(native.ENV_ISA, "avx512")
    assert native._env_isa() == (
        "SPECMLX_ISA=avx512: this CPU's best is avx2; unset it or choose a lower one"
    )


@needs_native
def test_patch_model_keeps_outputs(quantized_tiny):
    plain, patched = quantized_tiny(), quantized_tiny()
    layers = [m for m in patched.module.modules() if isinstance(m, nn.QuantizedLinear)]
    embeds = [m for m in patched.module.modules() if isinstance(m, nn.QuantizedEmbedding)]
    assert patch_model(patched.module) == len(layers) + len(embeds)
    assert all(isinstance(m, NativeQuantizedLinear) for m in layers)
    assert patch_model(patched.module) == 0  # already patched
    tokens = mx.array([[1, 5, 9, 14, 3, 7]])
    assert rel_err(patched.module(tokens), plain.module(tokens)) < 1e-5
    run = specmlx.generate
    assert run(patched, "def f(x):", max_tokens=12).run().tokens == (
        run(plain, "def f(x):", max_tokens=12).run().tokens
    )


@needs_native
def test_patch_model_skips_other_layers():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    nn.quantize(model, group_size=64, bits=3)
    assert patch_model(model) == 0
    embed = nn.QuantizedEmbedding(100, 64, group_size=64, bits=4)
    assert patch_model(embed) == 1
    x = mx.random.normal((3, 64))
    ref = mx.quantized_matmul(
        x, embed["weight"], embed["scales"], embed["biases"], transpose=True, group_size=64
    )
    assert rel_err(embed.as_linear(x), ref) < 2e-5  # tied output heads use as_linear


@needs_native
def test_a_tensor_splits_layers_run_on_the_kernel_and_keep_their_sum():
    # mlx-lm's shard() makes these; MLX's own CPU product over them was ~25x the kernel's.
    # A group of one rank: the all-sum is the identity, the layers otherwise as on two.
    from mlx.nn.layers.distributed import (
        QuantizedAllToShardedLinear,
        QuantizedShardedToAllLinear,
    )

    mx.random.seed(3)
    pair = nn.Sequential(
        QuantizedAllToShardedLinear(128, 256, bias=True, group_size=64),
        QuantizedShardedToAllLinear(256, 128, bias=True, group_size=64),
    )
    pair.layers[1].bias = mx.random.normal((128,))
    x = mx.random.normal((3, 128))
    want = pair(x)
    assert patch_model(pair) == 2
    assert [type(m).__name__ for m in pair.layers] == [
        "NativeAllToShardedLinear",
        "NativeShardedToAllLinear",
    ]
    assert rel_err(pair(x), want) < 2e-5


@needs_native
def test_load_patches_int4_models_on_cpu(quantized_tiny, model_dirs, tmp_path):
    """specmlx.load(native=True, the default) routes an INT4 checkpoint through the kernel."""
    from mlx.utils import tree_flatten

    model = quantized_tiny()
    for f in model_dirs["target"].iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((model_dirs["target"] / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = dict(tree_flatten(model.module.parameters()))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)

    def native_layers(m):
        return sum(isinstance(x, NativeQuantizedLinear) for x in m.module.modules())

    assert native_layers(specmlx.load(tmp_path, native=False)) == 0
    assert native_layers(specmlx.load(tmp_path)) > 0


@needs_native
@pytest.mark.parametrize("size", [1, 15, 16, 17, 63, 64, 65, 1000, 151_665])
def test_softmax_is_the_exact_softmax_within_float32_rounding(size, each_isa):
    # Against float64. MLX's own softmax sums a row in one float32 pass: 5e-5 off over
    # 152k logits; the kernel's partial sums stay within 1e-5 (AVX-512, AVX2) and 3e-6 (scalar).
    x = mx.random.normal((3, size), key=mx.random.key(size)) * 6.0
    exact = np.exp(np.array(x, np.float64) - np.array(x, np.float64).max(-1, keepdims=True))
    exact /= exact.sum(-1, keepdims=True)
    for isa in each_isa:
        native._ext.set_isa(isa)
        out = ops.softmax(x)
        assert out.shape == x.shape and out.dtype == mx.float32
        np.testing.assert_allclose(np.array(out, np.float64), exact, rtol=1e-5, atol=1e-30)


@needs_native
def test_softmax_gives_masked_tokens_exactly_zero(each_isa):
    # top-k and top-p mask tokens with -inf: a masked token must never be drawn
    x = mx.array([[2.0, -mx.inf, 0.5, -200.0] + [-mx.inf] * 13 + [1.0]])
    for isa in each_isa:
        native._ext.set_isa(isa)
        out = ops.softmax(x)[0].tolist()
        assert [i for i, p in enumerate(out) if p == 0.0] == [1, 3] + list(range(4, 17)), isa


def hard_rows(size):
    """Rows that stress the exp and the tail handling: -inf (masked) entries, values far below
    the max (a denormal or zero exp, down to -3.4e38), logits around 1e4 (exp overflows unless
    the max is taken off first), and all -inf but one entry. float32, shape (4, size)."""
    rng = np.random.default_rng(size)
    base = rng.standard_normal(size).astype(np.float32) * 6.0
    masked = base.copy()
    masked[1::3] = -np.inf
    far = base.copy()
    extremes = np.array([-88.0, -100.0, -103.9, -104.1, -150.0, -1e30, -3.4e38], np.float32)
    far[2::3] = np.resize(extremes, far[2::3].shape)
    lone = np.full(size, -np.inf, np.float32)
    lone[size // 2] = 2.5
    return np.stack([masked, far, base + 1e4, lone])


@needs_native
@pytest.mark.parametrize("size", [1, 7, 8, 9, 1000, 151_936])
def test_softmax_on_masked_and_extreme_rows(size, forced_isa):
    x = hard_rows(size)
    x64 = x.astype(np.float64)
    exact = np.exp(x64 - x64.max(-1, keepdims=True))
    exact /= exact.sum(-1, keepdims=True)
    out = np.array(ops.softmax(mx.array(x)), np.float64)
    assert not np.isnan(out).any()
    # the same tolerance as the Gaussian rows above; atol only for denormal outputs
    np.testing.assert_allclose(out, exact, rtol=1e-5, atol=1e-30)
    assert (out[x == -np.inf] == 0.0).all()  # a masked token can never be drawn
    assert out[3, size // 2] == 1.0


@needs_native
@pytest.mark.parametrize("size", [7, 9, 1000, 151_936])
def test_softmax_avx2_is_close_to_avx512(size):
    # The AVX2 exp computes AVX-512's to the bit; only the order of the float32 sums differs.
    best = native._ext.isa()
    if best != "avx512":
        pytest.skip(f"needs both avx2 and avx512 (best: {best})")
    x = mx.array(np.concatenate([hard_rows(size), np.random.default_rng(0).normal(size=(2, size))]))
    x = x.astype(mx.float32)
    try:
        native._ext.set_isa("avx2")
        avx2 = np.array(ops.softmax(x))
        native._ext.set_isa("avx512")
        avx512 = np.array(ops.softmax(x))
    finally:
        native._ext.set_isa(best)
    np.testing.assert_allclose(avx2, avx512, rtol=1e-6, atol=1e-37)
    assert ((avx2 == 0.0) == (avx512 == 0.0)).all()


@needs_native
def test_softmax_inside_compile_on_a_lazy_input():
    fn = mx.compile(lambda logits: ops.softmax(logits / 0.7) * 2.0)
    x = mx.random.normal((2, 300)) + 1.0  # not evaluated yet
    assert mx.allclose(fn(x), mx.softmax(x / 0.7, axis=-1) * 2.0, rtol=2e-6).item()


def test_softmax_falls_back_to_mlx(monkeypatch):
    x = mx.random.normal((2, 50))
    for dtype in (mx.float16, mx.bfloat16):  # the kernel takes float32 only
        assert mx.array_equal(ops.softmax(x.astype(dtype)), mx.softmax(x.astype(dtype), axis=-1))
    monkeypatch.setattr(native, "_ext", None)
    assert mx.array_equal(ops.softmax(x), mx.softmax(x, axis=-1)).item()


@needs_native
@pytest.mark.parametrize("dtype", FLOATS)
def test_a_bias_in_the_op_is_bitwise_mlxs_add(dtype):
    w, scales, biases = quantized(96, 128, dtype=dtype)
    bias = mx.random.normal((96,)).astype(dtype)
    x = mx.random.normal((2, 3, 128))  # float32 x: a float32 product whatever the scales
    fused = native._ext.quantized_matmul(x, w, scales, biases, 64, 4, bias)
    apart = native._ext.quantized_matmul(x, w, scales, biases, 64, 4) + bias
    assert fused.dtype == mx.float32
    assert mx.array_equal(fused, apart)


@needs_native
def test_a_bias_on_a_half_product_is_refused_and_the_layer_adds_it_apart():
    w, scales, biases = quantized(96, 128, dtype=mx.float16)
    bias = mx.random.normal((96,)).astype(mx.float16)
    x = mx.random.normal((3, 128)).astype(mx.float16)
    with pytest.raises(ValueError, match="float32 product"):
        native._ext.quantized_matmul(x, w, scales, biases, 64, 4, bias)
    layer = nn.QuantizedLinear(128, 96, bias=True, group_size=64, bits=4)
    layer.update({"weight": w, "scales": scales, "biases": biases, "bias": bias})
    patch_model(layer)
    want = native._ext.quantized_matmul(x, w, scales, biases, 64, 4) + bias
    assert mx.array_equal(layer(x), want)
