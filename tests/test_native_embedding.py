"""The native quantized-embedding lookup: mx.dequantize's bits over the gathered rows, for
4, 6 and 8 bits and every scale type, and a model's lookups go through it."""

import mlx.core as mx
import numpy as np
import pytest

from specmlx.cpu import native, quantized

pytestmark = pytest.mark.skipif(
    not hasattr(native._ext, "quantized_rows"), reason=f"not available: {native.reason()}"
)


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
@pytest.mark.parametrize("group_size", [32, 64])
def test_rows_equal_mlxs_dequantize(bits, dtype, group_size):
    mx.random.seed(bits)
    w, scales, biases = mx.quantize(mx.random.normal((300, 128)), group_size=group_size, bits=bits)
    scales, biases = scales.astype(dtype), biases.astype(dtype)
    ids = mx.array([[3, 299, 0], [17, 17, -1]], mx.int32)
    got = native._ext.quantized_rows(ids, w, scales, biases, group_size, bits)
    wide = {"scales": scales[ids].astype(mx.float32), "biases": biases[ids].astype(mx.float32)}
    want = mx.dequantize(w[ids], **wide, group_size=group_size, bits=bits)
    assert got.shape == (2, 3, 128) and got.dtype == mx.float32
    assert np.array_equal(np.array(got), np.array(want))


def test_ids_in_a_lazy_strided_view_are_read_in_their_order():
    w, scales, biases = mx.quantize(mx.random.normal((50, 64)), group_size=32, bits=4)
    ids = mx.array([[1, 2, 9], [3, 4, 7]], mx.int32).T  # not yet evaluated, not contiguous
    got = native._ext.quantized_rows(ids, w, scales, biases, 32, 4)
    want = mx.dequantize(w[ids], scales=scales[ids], biases=biases[ids], group_size=32, bits=4)
    assert np.array_equal(np.array(got), np.array(want))


def test_an_id_past_the_table_reads_nothing_outside_it():
    w, scales, biases = mx.quantize(mx.ones((4, 64)), group_size=64, bits=4)
    got = native._ext.quantized_rows(mx.array([4, 1], mx.uint32), w, scales, biases, 64, 4)
    assert np.isnan(np.array(got[0])).all() and np.allclose(np.array(got[1]), 1.0)


def test_a_quantized_models_lookup_is_one_op(quantized_tiny, monkeypatch):
    model = quantized_tiny()
    plain = np.array(model.module.model.embed_tokens(mx.array([[1, 2, 3]])))
    quantized.patch_model(model.module)
    embed = model.module.model.embed_tokens
    assert isinstance(embed, quantized.NativeQuantizedEmbedding)
    calls = []
    real = native._ext.quantized_rows
    monkeypatch.setattr(native._ext, "quantized_rows", lambda *a: calls.append(1) or real(*a))
    got = np.array(embed(mx.array([[1, 2, 3]], mx.uint32)))
    assert calls == [1] and np.array_equal(got, plain)
