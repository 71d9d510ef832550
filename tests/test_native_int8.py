"""The native kernel's int8-activation path, for 4-bit layers and 8- or 6-bit ones
(embeddings, heads, mixed recipes): what it computes, independence of batch and threads,
and the mode switch."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import specmlx
from specmlx.convert.quantize import quantize
from specmlx.cpu import native, ops
from specmlx.cpu.quantized import patch_model
from specmlx.errors import SpecmlxError

pytestmark = pytest.mark.skipif(
    not native.available(), reason=f"native kernel not available: {native.reason()}"
)
GROUP_SIZES = [32, 64, 128]
BITS = [4, 6, 8]


def quantized(n, k, group_size=64, bits=4, dtype=mx.float32, seed=0):
    mx.random.seed(seed)
    w, scales, biases = mx.quantize(mx.random.normal((n, k)), group_size=group_size, bits=bits)
    return w, scales.astype(dtype), biases.astype(dtype)


def int8_matmul(x, w, s, b, group_size, isa, bits=4):
    native._ext.set_isa(isa)
    native.set_activations("int8")
    out = ops.quantized_matmul(x, w, s, b, group_size, bits)
    mx.eval(out)  # now: the mode and the ISA are read when the matmul is evaluated
    return out


def quantized_x(x):
    """x's int8 codes and scales, one row per 32-block, computed as the kernel does."""
    xf = np.array(x.astype(mx.float32)).reshape(-1, 32)
    amax = np.abs(xf).max(axis=1, keepdims=True)
    scale = amax / np.float32(127)
    inv = np.where(amax > 0, np.float32(1) / np.where(scale > 0, scale, 1), 0).astype(np.float32)
    return np.clip(np.rint(xf * inv), -127, 127).astype(np.float32), scale


def emulated(x, w, s, b, group_size, bits=4):
    """What the int8 path means, in float64: each 32-block of x replaced by scale * code,
    scale = max|x| / 127, code = x / scale rounded to nearest even (float32 arithmetic, as the
    kernel does), then multiplied exactly by the dequantized weights."""
    codes, scale = quantized_x(x)
    xq = (codes.astype(np.float64) * scale).reshape(x.shape)
    dense = mx.dequantize(
        w, s.astype(mx.float32), b.astype(mx.float32), group_size=group_size, bits=bits
    )
    return xq @ np.array(dense, np.float64).T


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-6)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 17])
def test_int8_is_the_product_with_quantized_x(m, group_size, bits, isas):
    # K = 3 groups: with 32 that is 96 codes, a partial chunk for every vector path
    for k in (3 * group_size, 1536):
        w, s, b = quantized(37, k, group_size, bits)  # odd N: a lone last row
        x = mx.random.normal((m, k), key=mx.random.key(m))
        want = emulated(x, w, s, b, group_size, bits)
        for isa in isas:
            out = int8_matmul(x, w, s, b, group_size, isa, bits)
            assert out.shape == (m, 37) and out.dtype == mx.float32
            assert rel_err(out, want) < 2e-5, (isa, k)  # float32 sums of exact products


def identity(k, group_size, bits):
    """Weights that dequantize exactly to the k x k identity: code 1 on the diagonal,
    scales 1, biases 0, in MLX's packing (each row one little-endian bit stream of codes)."""
    codes = np.eye(k, dtype=np.uint8)
    stream = np.unpackbits(codes[..., None], axis=-1, bitorder="little")[..., :bits]
    packed = np.packbits(stream.reshape(k, k * bits), axis=-1, bitorder="little")
    groups = (k, k // group_size)
    return mx.array(packed.view(np.uint32)), mx.ones(groups), mx.zeros(groups)


@pytest.mark.parametrize("bits", BITS)
def test_every_isa_sees_the_same_int8_x(bits, isas):
    # An identity matrix hands back each x as the kernel quantized it: d * q, one product
    # rounded once, plus exact zeros. Blocks of varied scale, an all-zero block, and K = 160
    # (a partial last chunk on every vector path).
    k = 160
    w, s, b = identity(k, 32, bits)
    x = mx.random.normal((3, k), key=mx.random.key(7)) * mx.repeat(mx.arange(15), 32)[:k]
    codes, scale = quantized_x(x)
    want = (codes * scale).reshape(x.shape)
    for isa in isas:
        assert np.array_equal(np.array(int8_matmul(x, w, s, b, 32, isa, bits)), want), isa


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_int8_is_close_to_float_activations(group_size, bits, isas):
    # Gaussian x and weights: int8 x costs well under 1% of the output's scale
    w, s, b = quantized(64, 1536, group_size, bits)
    x = mx.random.normal((4, 1536))
    ref = np.array(
        mx.quantized_matmul(x, w, s, b, transpose=True, group_size=group_size, bits=bits)
    )
    for isa in isas:
        out = np.array(int8_matmul(x, w, s, b, group_size, isa, bits))
        assert rel_err(out, ref) < 2e-2, isa
        assert np.sqrt(((out - ref) ** 2).mean() / (ref**2).mean()) < 1e-2, isa


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(group_size, bits, isas):
    w, s, b = quantized(29, 4 * group_size, group_size, bits)
    x = mx.random.normal((7, 4 * group_size)) * mx.arange(1, 8).reshape(7, 1)  # varied scales
    for isa in isas:
        together = int8_matmul(x, w, s, b, group_size, isa, bits)
        for i in (0, 3, 6):
            alone = int8_matmul(x[i : i + 1], w, s, b, group_size, isa, bits)
            assert mx.array_equal(alone, together[i : i + 1]).item(), (isa, i)
        pair = int8_matmul(x[2:4], w, s, b, group_size, isa, bits)
        assert mx.array_equal(pair, together[2:4]).item(), isa


@pytest.mark.parametrize("bits", BITS)
def test_rows_match_across_cache_blocks(bits, isas):
    # K = 8960 (the 1.5B's down projection): 200 output rows make several L2 blocks of
    # weights, 20 rows of x several tiles, each tile sweeping one block at a time
    w, s, b = quantized(200, 8960, bits=bits)
    x = mx.random.normal((20, 8960))
    for isa in isas:
        together = int8_matmul(x, w, s, b, 64, isa, bits)
        for i in (0, 17, 19):
            alone = int8_matmul(x[i : i + 1], w, s, b, 64, isa, bits)
            assert mx.array_equal(alone, together[i : i + 1]).item(), (isa, i)


@pytest.mark.parametrize("bits", BITS)
def test_int8_threads_agree(bits, isas):
    w, s, b = quantized(1030, 2048, bits=bits)  # big enough to be split across threads
    x = mx.random.normal((3, 2048))
    before = native.threads()
    try:
        for isa in isas:
            native.set_threads(1)
            one = int8_matmul(x, w, s, b, 64, isa, bits)
            for n in (3, 2):
                native.set_threads(n)
                again = int8_matmul(x, w, s, b, 64, isa, bits)
                assert mx.array_equal(one, again).item(), (isa, n)
    finally:
        native.set_threads(before)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("x_dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_int8_dtypes(x_dtype, scale_dtype, bits, isas):
    w, s, b = quantized(40, 256, bits=bits, dtype=scale_dtype)
    x = mx.random.normal((3, 256)).astype(x_dtype)
    want = emulated(x, w, s, b, 64, bits)
    expected = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=bits).dtype
    for isa in isas:
        out = int8_matmul(x, w, s, b, 64, isa, bits)
        assert out.dtype == expected, isa
        assert rel_err(out.astype(mx.float32), want) < (2e-5 if expected == mx.float32 else 1e-2)


@pytest.mark.parametrize("bits", BITS)
def test_each_mode_is_selectable(bits, isas):
    w, s, b = quantized(48, 512, bits=bits)
    x = mx.random.normal((3, 512))
    ref = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=bits)
    native.set_activations("float32")
    assert native.activations() == "float32" and "float32 activations" in native.describe()
    fp32 = ops.quantized_matmul(x, w, s, b, 64, bits)
    mx.eval(fp32)  # the mode is read when the matmul is evaluated
    assert rel_err(fp32, ref) < 2e-5
    native.set_activations("int8")
    assert native.activations() == "int8" and "int8 activations" in native.describe()
    int8 = ops.quantized_matmul(x, w, s, b, 64, bits)
    mx.eval(int8)
    assert rel_err(int8, emulated(x, w, s, b, 64, bits)) < 2e-5
    assert not mx.array_equal(int8, fp32).item()
    with pytest.raises(SpecmlxError, match="unknown activations 'int4'"):
        native.set_activations("int4")


@pytest.mark.skipif(
    not (native.available() and native._ext.vbmi_available()), reason="this CPU has no AVX-512 VBMI"
)
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_six_bit_codes_widen_alike_with_and_without_vbmi(group_size, scale_dtype, isas):
    # K: five groups (a partial last chunk at 32; a row's last 6-bit chunk is always a
    # masked load), 1536, and 8960 (the 1.5B's down); M one, two and one past the largest
    # tile; N odd (a lone last row)
    native._ext.set_isa("avx512")
    native.set_activations("int8")
    try:
        for k in (5 * group_size, 1536, 8960):
            w, s, b = quantized(37, k, group_size, bits=6, dtype=scale_dtype)
            x = mx.random.normal((9, k), key=mx.random.key(k))
            products = []
            for on in (True, False):
                native._ext.set_vbmi(on)
                assert ("vbmi" in native._ext.q8_kernel()) == on
                for m in (1, 2, 9):
                    out = ops.quantized_matmul(x[:m], w, s, b, group_size, 6)
                    mx.eval(out)  # the switch is read when the matmul is evaluated
                    products.append(np.array(out.astype(mx.float32)))
            half = len(products) // 2
            for vbmi, plain in zip(products[:half], products[half:], strict=True):
                assert np.array_equal(vbmi, plain), k
    finally:
        native._ext.set_vbmi(True)


def test_six_bit_products_run_on_int8_x_only(isas):
    # the float32-x tiles read 4 and 8 bits: under float32 x a 6-bit product is MLX's, and
    # the native op refuses to be built rather than compute with the wrong tiles
    w, s, b = quantized(48, 512, bits=6)
    x = mx.random.normal((3, 512))
    native.set_activations("float32")
    assert not ops.supports(x, w, s, b, 64, 6)
    with pytest.raises(ValueError, match="6-bit weights take int8 activations"):
        native._ext.quantized_matmul(x, w, s, b, 64, 6)
    ref = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=6)
    assert mx.array_equal(ops.quantized_matmul(x, w, s, b, 64, 6), ref).item()
    native.set_activations("int8")
    assert ops.supports(x, w, s, b, 64, 6)


def test_env_var_chooses_the_mode(monkeypatch):
    monkeypatch.setenv(native.ENV_ACTIVATIONS, "int8")
    assert native._env_activations() == ("int8", "")
    monkeypatch.setenv(native.ENV_ACTIVATIONS, "")
    assert native._env_activations() == (native.DEFAULT_ACTIVATIONS, "")
    monkeypatch.setenv(native.ENV_ACTIVATIONS, "fp8")
    mode, problem = native._env_activations()
    assert mode == native.DEFAULT_ACTIVATIONS
    assert problem == "SPECMLX_ACTIVATIONS must be one of int8, float32, got 'fp8'"


def test_a_bad_env_var_stops_model_preparation(monkeypatch):
    monkeypatch.setattr(native, "_env_problem", "SPECMLX_ACTIVATIONS must be one of ...")
    with pytest.raises(SpecmlxError, match="SPECMLX_ACTIVATIONS"):
        patch_model(nn.QuantizedLinear(128, 16))


@pytest.fixture(scope="module", params=[8, 6], ids=["8-bit head", "6-bit head"])
def int4_pair(request, model_dirs, tmp_path_factory):
    """The tiny qwen2 target and its perturbed draft in INT4 g32 (K = 64: one partial
    chunk per row) with an 8-bit (specmlx quantize's default) or 6-bit embedding and head,
    loaded onto the native kernel."""
    root = tmp_path_factory.mktemp("int8-activations")
    for name, out in (("target", "target"), ("perturbed", "draft")):
        quantize(
            model_dirs[name], root / out, group_size=32, embed_bits=request.param, dtype="float32"
        )
    return specmlx.load(root / "target"), specmlx.load(root / "draft")


def test_speculative_greedy_equals_the_target_alone(int4_pair, isas):
    # verify passes run k rows, plain steps one: with rows independent, the tokens agree
    # (the 8- or 6-bit head too)
    target, draft = int4_pair
    for isa in isas:
        native._ext.set_isa(isa)
        native.set_activations("int8")
        alone = specmlx.generate(target, "def f(x):", max_tokens=24, num_draft=0).run().tokens
        assert len(alone) == 24, isa  # a Generation is lazy: run() decodes
        for gamma in (1, 3, 4):
            spec = specmlx.generate(
                target, "def f(x):", draft=draft, max_tokens=24, num_draft=gamma
            ).run()
            assert spec.tokens == alone, (isa, gamma)
