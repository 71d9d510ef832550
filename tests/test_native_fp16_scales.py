"""fp16 (and bf16) scales and biases on the native kernel: widened exactly, so every ISA gives
bitwise the float32 scales' result, and a loaded INT4 model keeps them in place."""

import mlx.core as mx
import pytest

import specmlx
from specmlx import loading
from specmlx.convert.quantize import quantize
from specmlx.cpu import native, ops, quantized

pytestmark = pytest.mark.skipif(
    not native.available(), reason=f"native kernel not available: {native.reason()}"
)


def half_quantized(n, k, group_size, bits, half, seed=0):
    """Weights with scales and biases that are exact in `half`, in `half` and as float32."""
    mx.random.seed(seed)
    w, scales, biases = mx.quantize(mx.random.normal((n, k)), group_size=group_size, bits=bits)
    scales, biases = scales.astype(half), biases.astype(half)
    return w, (scales, biases), (scales.astype(mx.float32), biases.astype(mx.float32))


@pytest.mark.parametrize("half", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_half_scales_give_the_float32_scales_result_bitwise(
    isas, half, activations, bits, group_size
):
    # odd N: a lone last row; K = 3 * 128: a partial last int8 chunk at group size 32 and 64
    w, halves, widened = half_quantized(37, 384, group_size, bits, half)
    native.set_activations(activations)
    for isa in isas:
        native._ext.set_isa(isa)
        for m in (1, 3, 9):  # one tile, a partial tile, more than one tile
            x = mx.random.normal((m, 384), key=mx.random.key(m))
            got = ops.quantized_matmul(x, w, *halves, group_size, bits)
            want = ops.quantized_matmul(x, w, *widened, group_size, bits)
            assert got.dtype == mx.float32
            assert mx.array_equal(got, want).item(), (isa, m)


@pytest.fixture(scope="module")
def fp16_int4_model(model_dirs, tmp_path_factory):
    """The tiny target quantized to INT4 with fp16 scales, biases and other tensors, its
    head at 8 bits: the native kernel's on float32 x too (a 6-bit head is MLX's there)."""
    out = tmp_path_factory.mktemp("fp16-int4") / "target"
    quantize(model_dirs["target"], out, bits=4, group_size=64, embed_bits=8, dtype="float16")
    return out


def linear_params(model, name):
    return [
        layer[name]
        for _, layer in model.module.named_modules()
        if isinstance(layer, quantized.NativeQuantizedLinear) and name in layer
    ]


@pytest.mark.skipif(
    bool(loading.mapping_unavailable()), reason=f"no mapping: {loading.mapping_unavailable()}"
)
def test_a_loaded_int4_model_keeps_its_fp16_scales_in_place(fp16_int4_model):
    model = specmlx.load(fp16_int4_model)
    assert model.dtype == "float32"
    for name in ("scales", "biases"):
        params = linear_params(model, name)
        assert params and all(p.dtype == mx.float16 for p in params)
    embed = model.module.model.embed_tokens
    assert embed.scales.dtype == mx.float16 and embed.lookup_dtype == mx.float32
    assert embed(mx.array([[1, 2]])).dtype == mx.float32
    assert model.module.model.norm.weight.dtype == mx.float32  # norms keep the dtype policy
    assert model.info["reading"]["copied"] == len(model.module.model.layers) * 2 + 1  # norms


def test_kept_fp16_scales_decode_what_widened_ones_do(fp16_int4_model, monkeypatch):
    from specmlx.engine import encode_prompt, generate

    kept = specmlx.load(fp16_int4_model, lazy=False)
    monkeypatch.setattr(quantized, "keep_stored_halves", lambda module, stored: 0)
    widened = specmlx.load(fp16_int4_model, lazy=False)
    assert all(p.dtype == mx.float32 for p in linear_params(widened, "scales"))
    ids = encode_prompt(kept, "def fibonacci(n):")
    runs = [
        [s.token for s in generate(m, ids, max_tokens=24, temperature=0)] for m in (kept, widened)
    ]
    assert runs[0] == runs[1] and len(runs[0]) > 0
    logits = [m.module(mx.array([ids])) for m in (kept, widened)]
    assert mx.array_equal(*logits).item()
