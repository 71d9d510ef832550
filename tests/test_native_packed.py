"""The packed layout of 4-bit weights (packing.pack_layers): the four-row tiles (AVX-512 VNNI
and AVX2) stream each tile's codes, scales and biases from one buffer, and every product
they give is bitwise the one they give from the separate arrays, and each other's."""

from pathlib import Path

import mlx.core as mx
import pytest

import specmlx
from specmlx.convert.quantize import quantize
from specmlx.cpu import native, packing

pytestmark = pytest.mark.skipif(
    not native.available() or not native._ext.reads_packed(),
    reason="the packed layout is read by the AVX2 and AVX-512 tiles, which this CPU lacks",
)
SCALE_TYPES = [mx.float32, mx.float16, mx.bfloat16]
# the vector ISAs whose four-row tiles read the layout (forced_isa skips one the CPU lacks)
each_quad_isa = pytest.mark.parametrize("forced_isa", ["avx2", "avx512"], indirect=True)


def quantized(n, k, group_size, dtype, seed=0):
    mx.random.seed(seed)
    w, scales, biases = mx.quantize(mx.random.normal((n, k)), group_size=group_size, bits=4)
    return w, scales.astype(dtype), biases.astype(dtype)


def product(x, w, s, b, group_size, packed=None):
    out = native._ext.quantized_matmul(x, w, s, b, group_size, 4, None, packed)
    mx.eval(out)
    return out


@pytest.mark.parametrize("dtype", SCALE_TYPES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 20])
@each_quad_isa
def test_packed_products_equal_the_unpacked_bitwise(
    m, group_size, dtype, forced_isa, int8_activations
):
    # K = 3 * 64 codes ends in half a 128-code chunk; 520 rows make several ranges a thread;
    # K = 8960 (a 1.5B's down projection) overflows L1, so its tiles prefetch into L2 only
    for n, k in ((20, 3 * max(group_size, 64)), (520, 1536), (20, 8960)):
        w, s, b = quantized(n, k, group_size, dtype)
        x = mx.random.normal((m, k), key=mx.random.key(m))
        packed = native._ext.pack_quad(w, s, b, group_size)
        assert packed.dtype == mx.uint8
        unpacked = product(x, w, s, b, group_size)
        assert mx.array_equal(product(x, w, s, b, group_size, packed), unpacked)


@each_quad_isa
def test_packed_gated_and_stacked_products_equal_the_unpacked(forced_isa, int8_activations):
    gate, up = quantized(256, 512, 64, mx.bfloat16, 1), quantized(256, 512, 64, mx.bfloat16, 2)
    packs = [native._ext.pack_quad(*gate, 64), native._ext.pack_quad(*up, 64)]
    x = mx.random.normal((5, 512))
    gated = [native._ext.gated_matmul(x, *gate, *up, 64, 4, "silu", p) for p in (packs, [])]
    stacked = [native._ext.stacked_matmul(x, [*gate, *up], [], 64, 4, p) for p in (packs, [])]
    mx.eval(gated, stacked)
    assert mx.array_equal(*gated)
    assert all(mx.array_equal(a, b) for a, b in zip(*stacked, strict=True))


def vnni512() -> bool:
    return native._ext.isa() == "avx512" and native._ext.q8_kernel().startswith("vnni512")


@pytest.mark.skipif(
    not native.available() or not vnni512(), reason="needs AVX-512 VNNI to compare with"
)
@pytest.mark.parametrize("dtype", SCALE_TYPES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_the_avx2_four_row_tile_gives_the_avx512_tiles_bits(group_size, dtype, int8_activations):
    # the same integer sums and float sequence: an AVX2-only CPU decodes what this one does.
    # Rows 1..9 (one and several tiles of x), K ending in half a chunk and K overflowing L1,
    # packed and not
    try:
        for n, k in ((20, 3 * max(group_size, 64)), (520, 1536), (20, 8960)):
            w, s, b = quantized(n, k, group_size, dtype)
            packed = native._ext.pack_quad(w, s, b, group_size)
            for m in (1, 2, 3, 4, 5, 9):
                x = mx.random.normal((m, k), key=mx.random.key(m))
                outs = []
                for isa in ("avx512", "avx2"):
                    native._ext.set_isa(isa)
                    outs += [product(x, w, s, b, group_size, p) for p in (None, packed)]
                assert all(mx.array_equal(o, outs[0]) for o in outs[1:]), (n, k, m)
    finally:
        native._ext.set_isa("avx512")


def test_a_packed_array_of_another_matrix_is_refused(int8_activations):
    w, s, b = quantized(64, 512, 64, mx.float16)
    other = native._ext.pack_quad(*quantized(64, 256, 64, mx.float16), 64)
    with pytest.raises(ValueError, match="pack_quad's uint8 array"):
        native._ext.quantized_matmul(mx.zeros((1, 512)), w, s, b, 64, 4, None, other)
    with pytest.raises(ValueError, match="multiple of 4 rows"):
        native._ext.pack_quad(*quantized(6, 512, 64, mx.float16), 64)


@each_quad_isa
def test_a_loaded_model_is_packed_and_decodes_as_unpacked(
    model_dirs, tmp_path, forced_isa, int8_activations, monkeypatch
):
    # every 4-bit linear layer packed at load; logits of a 9-token pass (two row tiles) and
    # greedy tokens exactly those of the same model unpacked
    quantize(model_dirs["target"], tmp_path / "int4", group_size=32, dtype="float32")
    packed = specmlx.load(tmp_path / "int4")
    monkeypatch.setenv(packing.ENV_PACK, "0")
    plain = specmlx.load(tmp_path / "int4")
    count = [
        sum(getattr(m, "packed_tiles", None) is not None for m in model.module.modules())
        for model in (packed, plain)
    ]
    assert count[0] > 0 and count[1] == 0
    ids = mx.array([[5, 9, 2, 7, 1, 3, 8, 4, 6]])
    logits = [model.module(ids) for model in (packed, plain)]
    mx.eval(logits)
    assert mx.array_equal(*logits)
    tokens = [
        specmlx.generate(model, "def f(x):", max_tokens=16, num_draft=0).run().tokens
        for model in (packed, plain)
    ]
    assert tokens[0] == tokens[1]


def test_a_layer_whose_weights_are_replaced_stops_reading_its_packed_copy(
    model_dirs, tmp_path, int8_activations
):
    quantize(model_dirs["target"], tmp_path / "int4", group_size=32, dtype="float32")
    model = specmlx.load(tmp_path / "int4")
    layer = next(m for m in model.module.modules() if getattr(m, "packed_tiles", None) is not None)
    layer.scales = layer.scales * 2
    assert layer.packed_tiles is None  # the op then reads the new arrays themselves


def transparent_huge_pages() -> str | None:
    """Linux's THP mode ("always", "madvise" or "never"), None where it cannot be read."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        Path("/proc/self/smaps_rollup").stat()
    except OSError:
        return None
    return text.split("[")[1].split("]")[0]


def anonymous_huge_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(
    transparent_huge_pages() != "madvise",
    reason="huge pages are only asked for where Linux gives them on request (THP madvise)",
)
def test_packed_copies_ask_for_huge_pages():
    # ~17 MiB packed into a fresh mapping that starts on a huge page: all but its last
    # partial 2 MiB page are huge ones
    w, s, b = quantized(4096, 8192, 64, mx.float16)
    before = anonymous_huge_kib()
    packed = native._ext.pack_quad(w, s, b, 64)
    mx.eval(packed)
    assert anonymous_huge_kib() - before >= 8 * 2048


def test_copies_packed_together_equal_those_packed_alone_and_outlive_each_other(int8_activations):
    # one mapping holds all three (different K, scale types alike within one call); each
    # array must stay readable after the others are gone
    mats = [quantized(n, k, 64, mx.float16, seed=n) for n, k in ((8, 128), (36, 1536), (20, 8960))]
    together = native._ext.pack_quads([list(m) for m in mats], 64)
    alone = [native._ext.pack_quad(*m, 64) for m in mats]
    for t, a in zip(together, alone, strict=True):
        assert t.dtype == mx.uint8 and mx.array_equal(t, a).item()
    last = together[-1]
    del together
    x = mx.random.normal((1, 8960), key=mx.random.key(2))
    assert mx.array_equal(product(x, *mats[-1], 64, last), product(x, *mats[-1], 64)).item()
