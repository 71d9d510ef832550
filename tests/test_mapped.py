"""Weights mapped, not copied: safetensors tensors as MLX arrays over a read-only mapping."""

import gc
import hashlib
import json
import shutil
import struct
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import specmlx
from specmlx import loading
from specmlx.cpu import native
from specmlx.errors import SpecmlxError
from specmlx.safetensors import read_header
from specmlx.tiny import ARCHITECTURES, build_tiny_model

pytestmark = pytest.mark.skipif(
    bool(loading.mapping_unavailable()), reason=f"no mapping: {loading.mapping_unavailable()}"
)

NAMES = {
    mx.float32: "F32",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.uint32: "U32",
    mx.int8: "I8",
    mx.uint8: "U8",
    mx.bool_: "BOOL",
}


def write_safetensors(path, tensors: dict[str, mx.array]) -> None:
    """Back to back in the order given, the data section 8-byte aligned (as the format
    recommends and specmlx quantize writes); a tensor is aligned when the ones before it
    add up to a multiple of 8 bytes."""
    header, blobs, position = {}, [], 0
    for name, array in tensors.items():
        data = np.array(array.flatten().view(mx.uint8)).tobytes() if array.size else b""
        header[name] = {
            "dtype": NAMES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [position, position + len(data)],
        }
        blobs.append(data)
        position += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def sample_tensors() -> dict[str, mx.array]:
    mx.random.seed(0)
    return {
        "f32": mx.random.normal((64, 32)),
        "f16": mx.random.normal((4, 6)).astype(mx.float16),
        "bf16": mx.random.normal((8, 4)).astype(mx.bfloat16),
        "u32": mx.arange(12, dtype=mx.uint32),
        "i8": mx.arange(-8, 8, dtype=mx.int8),
        "mask": mx.array([True, False] * 4),
        "empty": mx.zeros((0, 4)),
    }


def mapped_paths() -> list[str]:
    return [line.split()[-1] for line in open("/proc/self/maps") if line.count(" ") >= 5]


def test_mapped_tensors_equal_mx_load(tmp_path):
    file = tmp_path / "w.safetensors"
    write_safetensors(file, sample_tensors())
    weights, mapped, why = loading.map_weights(read_header(file))
    expected = mx.load(str(file))
    assert why == "" and len(mapped) == len(expected)
    assert weights.keys() == expected.keys()
    for name, array in expected.items():
        assert weights[name].dtype == array.dtype and weights[name].shape == array.shape
        assert mx.array_equal(weights[name], array).item(), name


def test_without_an_aligned_copy_an_unaligned_tensor_is_read_by_copy_with_the_same_values(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("SPECMLX_MAPPED_CACHE_GB", "0")  # as where the cache cannot be written
    file = tmp_path / "w.safetensors"
    mx.random.seed(1)
    tensors = {"odd": mx.arange(3, dtype=mx.uint8), "after": mx.random.normal((5, 4))}
    write_safetensors(file, tensors)  # "after" starts 3 bytes into the data section
    weights, mapped, _ = loading.map_weights(read_header(file))
    assert len(mapped) == 1  # "odd" only: its offset is the aligned data start
    assert weights["odd"] is mapped[0]
    for name, array in tensors.items():
        assert mx.array_equal(weights[name], array).item(), name


def test_a_file_with_no_aligned_tensor_and_no_aligned_copy_is_read_by_mx_load_and_says_why(
    model_dirs, monkeypatch
):
    """mx.save_safetensors (the tiny models') starts the data where the header ends; with
    no aligned copy allowed (tests/test_aligned_cache.py has them) nothing can be mapped."""
    monkeypatch.setenv("SPECMLX_MAPPED_CACHE_GB", "0")
    headers = [read_header(model_dirs["target"] / "model.safetensors")]
    misaligned = {n: t for n, t in headers[0].tensors.items() if t.begin % 8}
    if len(misaligned) < len(headers[0].tensors):
        pytest.skip("this tiny model happens to have aligned tensors")
    weights, mapped, why = loading.map_weights(headers[0])
    assert (weights, mapped) == ({}, [])
    assert why.startswith("no tensor lies at an 8-byte-aligned offset")
    assert "SPECMLX_MAPPED_CACHE_GB=0" in why


def test_arrays_outlive_the_loader_and_the_mapping_goes_with_the_last(tmp_path):
    file = tmp_path / "kept.safetensors"
    tensors = sample_tensors()
    write_safetensors(file, tensors)
    weights, mapped, _ = loading.map_weights(read_header(file))
    kept = weights["f32"]
    del weights, mapped
    gc.collect()
    assert str(file) in mapped_paths()
    total = mx.sum(kept @ kept.T)
    mx.eval(total)
    assert total.item() == mx.sum(tensors["f32"] @ tensors["f32"].T).item()
    view = kept[2:4]  # a view shares the buffer, so the mapping too
    del kept, total
    gc.collect()
    assert str(file) in mapped_paths()
    assert mx.array_equal(view, tensors["f32"][2:4]).item()
    del view
    gc.collect()
    assert str(file) not in mapped_paths()


def test_a_mapped_tensor_is_never_written_through(tmp_path):
    """Ops may donate an input's buffer to their output when nothing else holds it; a
    mapped buffer is not the allocator's, so they must not (the mapping is read-only: a
    write would fault) and the file keeps its bytes."""
    file = tmp_path / "w.safetensors"
    tensors = sample_tensors()
    write_safetensors(file, tensors)
    before = hashlib.sha256(file.read_bytes()).hexdigest()
    weights, mapped, _ = loading.map_weights(read_header(file))
    del mapped
    out = mx.exp(weights.pop("f32"))  # the graph holds the only reference
    doubled = weights.pop("u32") * 2
    flipped = mx.contiguous(weights.pop("bf16").T)
    mx.eval(out, doubled, flipped)
    assert mx.allclose(out, mx.exp(tensors["f32"])).item()
    assert mx.array_equal(doubled, tensors["u32"] * 2).item()
    assert mx.array_equal(flipped, tensors["bf16"].T).item()
    assert hashlib.sha256(file.read_bytes()).hexdigest() == before


def test_a_mapped_tensor_made_contiguous_is_shared_not_copied(tmp_path):
    """mx.contiguous (which the native kernel calls on its weights) shares a row-contiguous
    buffer only when the buffer's recorded size fits the output: a mapped tensor must
    carry its true size, or every call would copy the weight."""
    file = tmp_path / "w.safetensors"
    mx.random.seed(2)
    write_safetensors(file, {"w": mx.random.normal((1024, 1024))})  # 4 MiB
    weights, _, _ = loading.map_weights(read_header(file))
    mx.eval(mx.zeros((1,)))
    before = mx.get_active_memory()
    shared = mx.contiguous(weights["w"])
    mx.eval(shared)
    assert mx.get_active_memory() - before < weights["w"].nbytes // 4
    assert mx.array_equal(shared, weights["w"]).item()


def test_a_range_past_the_end_of_the_file_is_refused_not_faulted(tmp_path):
    file = tmp_path / "w.safetensors"
    write_safetensors(file, sample_tensors())
    size = file.stat().st_size
    with pytest.raises(ValueError, match="lies outside"):
        native._ext.map_tensors(str(file), [(size - 8, [4], mx.float32)])


def test_a_file_cut_after_its_header_was_read_is_one_line(tmp_path):
    file = tmp_path / "w.safetensors"
    write_safetensors(file, sample_tensors())
    header = read_header(file)
    file.write_bytes(file.read_bytes()[: header.data_start + 100])
    with pytest.raises(SpecmlxError, match="truncated") as refused:
        loading.map_weights(header)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda raw, begin, end: raw[: len(raw) - 16], "truncated"),
        (lambda raw, begin, end: (begin + 4096, end + 4096), "data section"),
        (lambda raw, begin, end: (begin - 8, end - 8), "overlaps"),
    ],
    ids=["truncated", "offset past the end", "overlapping"],
)
def test_a_bad_file_is_refused_in_one_line_before_anything_is_mapped(tmp_path, corrupt, message):
    """In a fresh process: a SIGBUS would kill it rather than fail the test."""
    tensors = {"a": mx.ones((8,)), "b": mx.zeros((8,))}
    file = tmp_path / "w.safetensors"
    write_safetensors(file, tensors)
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    begin, end = header["b"]["data_offsets"]
    changed = corrupt(raw, begin, end)
    if isinstance(changed, bytes):
        file.write_bytes(changed)
    else:
        header["b"]["data_offsets"] = list(changed)
        text = json.dumps(header).encode()
        file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])
    code = (
        "import sys; from pathlib import Path; from specmlx import loading\n"
        "from specmlx.errors import SpecmlxError; from specmlx.safetensors import read_header\n"
        f"try: loading.map_weights(read_header(Path({str(file)!r})))\n"
        "except SpecmlxError as e: print(e); sys.exit(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 3, done.stderr
    assert message in done.stdout and done.stdout.count("\n") == 1


@pytest.fixture(scope="module")
def aligned_model(model_dirs, tmp_path_factory):
    """The tiny target with its weights rewritten so that every tensor is 8-byte aligned
    (mx.save_safetensors starts the data section wherever the header ends)."""
    path = tmp_path_factory.mktemp("aligned") / "target"
    shutil.copytree(model_dirs["target"], path)
    weights = mx.load(str(path / "model.safetensors"))
    assert all(w.nbytes % 8 == 0 for w in weights.values())
    write_safetensors(path / "model.safetensors", weights)
    return path


def test_a_loaded_model_uses_its_aligned_weights_in_place(aligned_model):
    model = specmlx.load(aligned_model)
    reading = model.info["reading"]
    assert reading["how"] == "mapped"
    assert reading["copied"] == 0 and reading["in_place"] > 0  # float32 already: none cast


def test_a_mapped_model_generates_what_a_copied_one_does(aligned_model, monkeypatch):
    from specmlx.engine import encode_prompt, generate

    mapped = specmlx.load(aligned_model, lazy=False)
    monkeypatch.setenv("SPECMLX_MMAP", "0")
    copied = specmlx.load(aligned_model, lazy=False)
    assert copied.info["reading"]["how"] == "lazy-copy"
    ids = encode_prompt(mapped, "def fibonacci(n):")
    runs = [
        [s.token for s in generate(m, ids, max_tokens=24, temperature=0)] for m in (mapped, copied)
    ]
    assert runs[0] == runs[1] and len(runs[0]) > 0


def test_mapping_turned_off_reads_with_mx_load_and_says_why(aligned_model, monkeypatch):
    monkeypatch.setenv("SPECMLX_MMAP", "0")
    reading = specmlx.load(aligned_model).info["reading"]
    assert reading["how"] == "lazy-copy" and reading["in_place"] == 0
    assert "SPECMLX_MMAP=0" in loading.describe_reading(reading)


def test_a_mapping_that_fails_falls_back_to_mx_load(aligned_model, monkeypatch):
    def refuse(path, tensors):
        raise ValueError(f"cannot map {path}: No such device")

    monkeypatch.setattr(native._ext, "map_tensors", refuse)
    model = specmlx.load(aligned_model, lazy=False)
    reading = model.info["reading"]
    assert reading["how"] == "lazy-copy" and "No such device" in reading["why"]
    assert reading["copied"] > 0


def realigned(path):
    """Rewrite a model's weights so that every tensor is 8-byte aligned."""
    weights = mx.load(str(path / "model.safetensors"))
    order = sorted(weights, key=lambda name: weights[name].nbytes % 8)  # whole 8s first
    write_safetensors(path / "model.safetensors", {name: weights[name] for name in order})
    return path


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_every_architecture_loads_mapped_as_it_loads_copied(arch, tmp_path, monkeypatch):
    """Through mlx-lm's own loader, each model's sanitize included (some change the model,
    so it must run once), a mapped model decodes what a copied one does."""
    from specmlx.engine import encode_prompt, generate

    path = realigned(build_tiny_model(tmp_path / arch, arch=arch, seed=0))
    mapped = specmlx.load(path, lazy=False)
    monkeypatch.setenv("SPECMLX_MMAP", "0")
    copied = specmlx.load(path, lazy=False)
    assert mapped.info["reading"]["in_place"] > 0
    ids = encode_prompt(mapped, "def fibonacci(n):")
    runs = [
        [s.token for s in generate(m, ids, max_tokens=8, temperature=0, num_draft=0)]
        for m in (mapped, copied)
    ]
    assert runs[0] == runs[1]
