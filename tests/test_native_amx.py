"""The AMX tile: passes over 16 rows and more of 4-bit weights with int8 activations run on
it where the CPU has AMX-INT8, and must give exactly what the VNNI tiles give, so that a
row's result never depends on how many rows ran with it (speculative greedy equals the
target alone's). Where the CPU has no AMX the same calls run on the vector tiles and these
tests check that row independence across the 16-row boundary instead."""

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from specmlx.cpu import native, ops

pytestmark = pytest.mark.skipif(
    not native.available(), reason=f"native kernel not available: {native.reason()}"
)
needs_amx = pytest.mark.skipif(
    not (native.available() and native._ext.amx_available()), reason="this CPU has no AMX"
)


@pytest.fixture
def int8_avx512():
    """int8 activations on the CPU's best ISA, AMX on where present; restored afterwards."""
    best, mode = native._ext.isa(), native.activations()
    native._ext.set_isa(best)
    native.set_activations("int8")
    yield
    native._ext.set_amx(True)
    native._ext.set_isa(best)
    native.set_activations(mode)


def quantized(n, k, group_size, dtype, seed=1):
    mx.random.seed(seed)
    w, s, b = mx.quantize(mx.random.normal((n, k)), group_size=group_size, bits=4)
    return w, s.astype(dtype), b.astype(dtype)


def matmul(x, w, s, b, group_size, amx):
    native._ext.set_amx(amx)
    out = ops.quantized_matmul(x, w, s, b, group_size, 4)
    mx.eval(out)  # the switch is read when the matmul is evaluated
    return np.array(out.astype(mx.float32))


def rows(m, k, seed):
    return mx.random.normal((m, k), key=mx.random.key(seed)) * mx.arange(1, m + 1).reshape(m, 1)


@needs_amx
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_amx_equals_the_vector_tiles_bitwise(group_size, dtype, int8_avx512):
    # K: a whole number of 128-code steps, and ones with a trailing partial step; M: one
    # tile of 16 rows, a lone 17th row, and a partial second pair of tiles; N = 53: a
    # partial last pair of 16-row weight tiles
    for k in (4 * group_size, 1536, 4 * 128 + group_size):
        w, s, b = quantized(53, k, group_size, dtype)
        for m in (16, 17, 40):
            x = rows(m, k, seed=m)
            assert np.array_equal(
                matmul(x, w, s, b, group_size, amx=True), matmul(x, w, s, b, group_size, amx=False)
            ), (k, m)


@needs_amx
def test_the_kernel_says_when_it_uses_amx(int8_avx512):
    native._ext.set_amx(True)
    assert "amx from 16 rows" in native.describe()
    native._ext.set_amx(False)
    assert "amx" not in native.describe()


@needs_amx
@pytest.mark.parametrize("value, uses_amx", [("0", False), ("1", True)])
def test_specmlx_amx_0_keeps_the_kernel_on_the_vector_tiles(value, uses_amx):
    code = "from specmlx.cpu import native; print(native._ext.q8_kernel())"
    env = dict(os.environ, SPECMLX_AMX=value)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert ("amx" in out.stdout) == uses_amx, out.stdout


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_a_row_alone_equals_the_row_in_a_pass_of_many(group_size, int8_avx512):
    # one row runs on the vector tiles; 16 and more on AMX where the CPU has it
    k = 1536
    w, s, b = quantized(200, k, group_size, mx.bfloat16)
    x = rows(33, k, seed=3)
    together = matmul(x, w, s, b, group_size, amx=True)
    for i in (0, 15, 16, 32):
        alone = matmul(x[i : i + 1], w, s, b, group_size, amx=True)
        assert np.array_equal(alone, together[i : i + 1]), i


def test_the_1_5b_down_projection_shape_agrees_row_by_row(int8_avx512):
    # K = 8960, N = 1536: several weight blocks per thread and all 16 x 32-block x tiles
    w, s, b = quantized(1536, 8960, 64, mx.bfloat16)
    x = rows(24, 8960, seed=5)
    together = matmul(x, w, s, b, 64, amx=True)
    for i in (0, 23):
        assert np.array_equal(matmul(x[i : i + 1], w, s, b, 64, amx=True), together[i : i + 1])
