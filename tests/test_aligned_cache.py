"""Files whose tensors are unaligned (mx.save_safetensors', so mlx_lm.convert's) are mapped
through an aligned copy in $SPECMLX_HOME/mapped (specmlx.aligned), made once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest

import specmlx
from specmlx import aligned, loading
from specmlx.safetensors import read_header
from specmlx.tiny import build_tiny_model

pytestmark = pytest.mark.skipif(
    bool(loading.mapping_unavailable()), reason=f"no mapping: {loading.mapping_unavailable()}"
)


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMLX_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(aligned.ENV_LIMIT, raising=False)
    return tmp_path / "home"


def save_unaligned(file, tensors: dict[str, mx.array]) -> None:
    """As mx.save_safetensors writes them, its header's length made not a multiple of 8,
    so that (tensor sizes being multiples of 8 here) no tensor is aligned."""
    for pad in range(8):
        mx.save_safetensors(str(file), tensors, metadata={"format": "mlx", "pad": "x" * pad})
        if all(t.begin % 8 for t in read_header(file).tensors.values()):
            return
    raise AssertionError("no padding left every tensor unaligned")


def tiny_unaligned(path, seed: int):
    """A tiny model whose file has no aligned tensor, whatever its header's length."""
    path = build_tiny_model(path, seed=seed)
    file = path / "model.safetensors"
    save_unaligned(file, mx.load(str(file)))
    return path


def sample(seed: int = 0, rows: int = 64) -> dict[str, mx.array]:
    mx.random.seed(seed)
    return {
        "w": mx.random.normal((rows, 32)),
        "scales": mx.random.normal((rows, 4)).astype(mx.bfloat16),
        "codes": mx.random.randint(0, 2**31, (rows, 8)).astype(mx.uint32),
        "norm": mx.ones((8,), dtype=mx.float16),
    }


def copies(home) -> list:
    return sorted((home / "mapped").glob("*.safetensors"))


def test_an_unaligned_file_is_mapped_through_an_aligned_copy_equal_to_mx_load(tmp_path, home):
    file = tmp_path / "w.safetensors"
    save_unaligned(file, sample())
    weights, mapped, why = loading.map_weights(read_header(file))
    assert why == "" and len(mapped) == len(weights) == 4  # every tensor in place
    (copy,) = copies(home)
    tensors = read_header(copy, aligned.MAX_GAP).tensors.values()
    assert all(t.begin % aligned.ALIGNMENT == 0 for t in tensors)
    expected = mx.load(str(file))
    assert weights.keys() == expected.keys()
    for name, array in expected.items():
        assert weights[name].dtype == array.dtype and weights[name].shape == array.shape
        assert mx.array_equal(weights[name], array).item(), name


def test_mapping_an_aligned_copy_makes_no_page_private(tmp_path, home):
    """Its tensors' sizes are in the file, where MLX's buffers keep theirs: nothing is
    written into the mapping, so every page stays the page cache's, shared."""
    file = tmp_path / "w.safetensors"
    save_unaligned(file, sample(rows=4096))
    weights, mapped, _ = loading.map_weights(read_header(file))
    mx.eval(*mapped)
    (copy,) = copies(home)
    dirty, inside = 0, False
    for line in open("/proc/self/smaps"):
        if line[0] in "0123456789abcdef" and " " in line:  # a mapping's first line
            inside = line.rstrip().endswith(str(copy))
        elif inside and line.startswith("Private_Dirty:"):
            dirty += int(line.split()[1])
    assert dirty == 0


def test_a_second_load_reuses_the_copy(tmp_path, home):
    file = tmp_path / "w.safetensors"
    save_unaligned(file, sample())
    loading.map_weights(read_header(file))
    (copy,) = copies(home)
    written = copy.stat()
    weights, mapped, _ = loading.map_weights(read_header(file))
    assert copies(home) == [copy]
    assert (copy.stat().st_mtime_ns, copy.stat().st_ino) == (written.st_mtime_ns, written.st_ino)
    assert len(mapped) == 4


def test_a_truncated_copy_is_written_again_not_trusted(tmp_path, home):
    file = tmp_path / "w.safetensors"
    tensors = sample()
    save_unaligned(file, tensors)
    loading.map_weights(read_header(file))
    (copy,) = copies(home)
    copy.write_bytes(copy.read_bytes()[:-100])
    weights, mapped, why = loading.map_weights(read_header(file))
    assert why == "" and len(mapped) == 4
    assert read_header(copy, aligned.MAX_GAP)  # whole again
    for name, array in tensors.items():
        assert mx.array_equal(weights[name], array).item(), name


def test_a_changed_source_gets_a_new_copy_and_the_old_one_goes(tmp_path, home):
    file = tmp_path / "w.safetensors"
    save_unaligned(file, sample(seed=0))
    loading.map_weights(read_header(file))
    (old,) = copies(home)
    changed = sample(seed=1)
    save_unaligned(file, changed)
    os.utime(file, ns=(1, 2))  # a new mtime even on a coarse clock
    weights, _, _ = loading.map_weights(read_header(file))
    (new,) = copies(home)
    assert new != old
    assert mx.array_equal(weights["w"], changed["w"]).item()


def test_the_cache_stays_within_its_bound_dropping_the_least_recently_used(
    tmp_path, home, monkeypatch
):
    files = []
    for i in range(4):
        files.append(tmp_path / f"m{i}" / "model.safetensors")
        files[-1].parent.mkdir()
        save_unaligned(files[-1], sample(seed=i, rows=256))
    loading.map_weights(read_header(files[0]))
    (one,) = copies(home)
    size = one.stat().st_size
    monkeypatch.setenv(aligned.ENV_LIMIT, str(2.5 * size / 1e9))  # room for two
    for file in files[1:]:
        loading.map_weights(read_header(file))
        assert sum(c.stat().st_size for c in copies(home)) <= 2.5 * size
    kept = {read_header(c, aligned.MAX_GAP).metadata[aligned.SOURCES] for c in copies(home)}
    assert kept == {json.dumps([aligned.identity(f)]) for f in files[2:]}


def test_by_default_the_bound_is_twice_the_largest_model(tmp_path, home):
    largest = 0
    for i, rows in enumerate((256, 64, 64, 64, 64)):
        file = tmp_path / f"m{i}" / "model.safetensors"
        file.parent.mkdir()
        save_unaligned(file, sample(seed=i, rows=rows))
        loading.map_weights(read_header(file))
        largest = largest or copies(home)[0].stat().st_size
    sizes = [c.stat().st_size for c in copies(home)]
    assert sum(sizes) <= 2 * largest and len(sizes) < 5


@pytest.mark.parametrize("limit", ["0", "0.000001"])  # none at all; 1000 bytes
def test_a_copy_that_would_not_fit_the_bound_is_not_made(tmp_path, home, monkeypatch, limit):
    file = tmp_path / "w.safetensors"
    save_unaligned(file, sample())
    monkeypatch.setenv(aligned.ENV_LIMIT, limit)
    weights, mapped, why = loading.map_weights(read_header(file))
    assert (weights, mapped) == ({}, []) and aligned.ENV_LIMIT in why
    assert copies(home) == []


def test_models_rm_removes_the_models_copies(home):
    target = tiny_unaligned(home / "models" / "doomed", seed=0)
    kept = tiny_unaligned(home / "models" / "kept", seed=1)
    for path in (target, kept):
        assert specmlx.load(path).info["reading"]["how"] == "mapped"
    assert len(copies(home)) == 2
    run = subprocess.run(
        [sys.executable, "-m", "specmlx", "models", "rm", "doomed", "--yes"],
        capture_output=True,
        text=True,
        env={**os.environ, "SPECMLX_HOME": str(home)},
    )
    assert run.returncode == 0, run.stderr
    (left,) = copies(home)
    assert str(kept) in read_header(left, aligned.MAX_GAP).metadata[aligned.SOURCES]


def test_without_the_native_extension_nothing_is_copied(tmp_path, home):
    """Where nothing can be mapped (SPECMLX_NATIVE=0, as on a Mac) mx.load reads the
    weights, as before, and no copy is made."""
    path = tiny_unaligned(tmp_path / "tiny", seed=0)
    code = f"import sys, specmlx\nprint(specmlx.load({str(path)!r}).info['reading']['how'])\n"
    env = {**os.environ, "SPECMLX_HOME": str(home), "SPECMLX_NATIVE": "0"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "lazy-copy"
    assert not (home / "mapped").exists()


def test_a_model_through_its_copy_generates_what_a_copied_one_does(tmp_path, monkeypatch):
    from specmlx.engine import encode_prompt, generate

    path = tiny_unaligned(tmp_path / "tiny", seed=0)
    mapped = specmlx.load(path, lazy=False)
    monkeypatch.setenv("SPECMLX_MMAP", "0")
    copied = specmlx.load(path, lazy=False)
    assert mapped.info["reading"]["how"] == "mapped"
    assert copied.info["reading"]["how"] == "lazy-copy"
    ids = encode_prompt(mapped, "def fibonacci(n):")
    runs = [
        [s.token for s in generate(m, ids, max_tokens=16, temperature=0, num_draft=0)]
        for m in (mapped, copied)
    ]
    assert runs[0] == runs[1] and len(runs[0]) > 0


def tiny_int4(path, seed: int = 0):
    """A tiny qwen2 quantized to INT4 g32 and saved as mlx_lm.convert saves one."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    path = build_tiny_model(path, seed=seed)
    model = specmlx.load(path, native=False)
    nn.quantize(model.module, group_size=32, bits=4)
    save_unaligned(path / "model.safetensors", dict(tree_flatten(model.module.parameters())))
    config = json.loads((path / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    return path


def packed_layers(model) -> list:
    from specmlx.cpu.quantized import NativeQuantizedLinear

    layers = [m for m in model.module.modules() if isinstance(m, NativeQuantizedLinear)]
    if not layers or any(m.packed_tiles is None for m in layers):
        pytest.skip("no packed tiles here (they need int8 x on AVX-512 VNNI or AVX2)")
    return layers


def packed_files(home) -> list:
    kinds = {c: read_header(c, aligned.MAX_GAP).metadata for c in copies(home)}
    return [c for c, meta in kinds.items() if meta.get(aligned.KIND, "").startswith("packed")]


def test_packed_tiles_are_mapped_from_the_cache_equal_to_a_fresh_pack(
    tmp_path, home, int8_activations
):
    from specmlx.cpu import native

    layers = packed_layers(specmlx.load(tiny_int4(tmp_path / "q"), lazy=False))
    (packed,) = packed_files(home)
    assert str(packed) in {line.split()[-1] for line in open("/proc/self/maps")}
    pack = native.op("pack_quads")
    for m in layers:
        fresh = pack([[m["weight"], m["scales"], m["biases"]]], m.group_size)[0]
        assert mx.array_equal(m.packed_tiles, fresh).item()


def test_a_second_load_packs_nothing(tmp_path, home, int8_activations, monkeypatch):
    from specmlx.cpu import native

    path = tiny_int4(tmp_path / "q")
    specmlx.load(path, lazy=False)

    def refuse(*args):
        raise AssertionError("packed again")

    monkeypatch.setattr(native._ext, "pack_quads", refuse)
    assert len(packed_layers(specmlx.load(path, lazy=False))) > 0


def test_tiles_from_the_cache_decode_what_tiles_packed_in_memory_do(
    tmp_path, home, int8_activations, monkeypatch
):
    from specmlx.engine import encode_prompt, generate

    path = tiny_int4(tmp_path / "q")
    cached = specmlx.load(path, lazy=False)
    packed_layers(cached)
    monkeypatch.setenv(aligned.ENV_LIMIT, "0")  # no cache: packed in private memory
    in_memory = specmlx.load(path, lazy=False)
    packed_layers(in_memory)
    ids = encode_prompt(cached, "def fibonacci(n):")
    runs = [
        [s.token for s in generate(m, ids, max_tokens=16, temperature=0, num_draft=0)]
        for m in (cached, in_memory)
    ]
    assert runs[0] == runs[1] and len(runs[0]) > 0


def test_another_build_of_the_extension_packs_its_own_tiles(
    tmp_path, home, int8_activations, monkeypatch
):
    """A rebuilt kernel may lay its tiles out otherwise: it never reads another build's."""
    from specmlx.cpu import native

    path = tiny_int4(tmp_path / "q")
    specmlx.load(path, lazy=False)
    (first,) = packed_files(home)
    monkeypatch.setattr(native, "build_id", lambda: "another")
    packed_layers(specmlx.load(path, lazy=False))
    assert len(packed_files(home)) == 2 and first in packed_files(home)


def test_forgetting_a_model_removes_its_packed_tiles_too(tmp_path, home, int8_activations):
    path = tiny_int4(tmp_path / "q")
    packed_layers(specmlx.load(path, lazy=False))
    assert len(copies(home)) == 2  # the aligned copy and the packed tiles
    aligned.forget(path)
    assert copies(home) == []


def test_packed_tiles_that_would_not_fit_the_bound_are_packed_in_memory(
    tmp_path, home, int8_activations, monkeypatch
):
    path = tiny_int4(tmp_path / "q")
    packed_layers(specmlx.load(path, lazy=False))
    (tiles,) = packed_files(home)
    sizes = {c: c.stat().st_size for c in copies(home)}
    for c in copies(home):
        c.unlink()
    bound = sizes[tiles] // 2 + sum(size for c, size in sizes.items() if c != tiles)
    monkeypatch.setenv(aligned.ENV_LIMIT, str(bound / 1e9))
    packed_layers(specmlx.load(path, lazy=False))
    assert packed_files(home) == [] and len(copies(home)) == 1
    assert sum(c.stat().st_size for c in copies(home)) <= bound
