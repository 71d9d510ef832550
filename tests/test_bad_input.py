"""Bad input, systematically: a corrupt model directory ends in one SpecmlxError line.

Each case copies a tiny model, damages one file (deterministically: a numpy RNG seeded
with the case's kind and number) and loads it with weights read (lazy=False). The load
either raises SpecmlxError, one line naming the directory, or succeeds (a harmless
mutation, e.g. bytes inside tensor data); any other exception, a crash or a hang fails.
tests/README.md lists what each kind of damage gets.
"""

from __future__ import annotations

import faulthandler
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import specmlx
from specmlx import SpecmlxError

SEED = 20240611
CASE_TIMEOUT_S = 60  # a hang kills the run with every thread's traceback, not a stuck CI

# --- the safetensors file as parts ---------------------------------------------------


def split(blob: bytes) -> tuple[dict, bytes]:
    """A valid file's header (as a dict) and data section."""
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def join(header: dict | bytes, data: bytes) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def tensor_names(header: dict) -> list[str]:
    """Names in file order (by offset), so that "the first"/"the last" mean something."""
    entries = [k for k in header if k != "__metadata__"]
    return sorted(entries, key=lambda k: header[k]["data_offsets"])


# --- mutations: (rng, file bytes) -> damaged bytes -----------------------------------


def truncate(rng, blob: bytes) -> bytes:
    """Cut anywhere; a third of the cuts in the length field, the header or just after it,
    some on the boundaries between them."""
    (n,) = struct.unpack("<Q", blob[:8])
    if rng.random() < 0.1:
        return blob[: int(rng.choice([0, 7, 8, 9, 8 + n - 1, 8 + n, len(blob) - 1]))]
    end = 8 + n + 64 if rng.random() < 1 / 3 else len(blob)
    return blob[: int(rng.integers(0, end))]


def header_bytes(rng, blob: bytes) -> bytes:
    """1-8 random bytes anywhere in the length field or the JSON header: half of the
    mutations printable ASCII, which keeps the header UTF-8 and so reaches the JSON."""
    (n,) = struct.unpack("<Q", blob[:8])
    low, high = (32, 127) if rng.random() < 0.5 else (0, 256)
    out = bytearray(blob)
    for position in rng.integers(0, 8 + n, size=int(rng.integers(1, 9))):
        out[position] = int(rng.integers(low, high))
    return bytes(out)


def length_field(rng, blob: bytes) -> bytes:
    """A header length that is off by a little, or absurd."""
    (n,) = struct.unpack("<Q", blob[:8])
    choices = [0, 1, 2, n - 1, n + 1, n + 8, len(blob), len(blob) - 8, 2**63, 2**64 - 1]
    value = int(rng.choice(choices)) if rng.random() < 0.5 else n + int(rng.integers(-n, n))
    return struct.pack("<Q", value) + blob[8:]


def data_bytes(rng, blob: bytes) -> bytes:
    """Random bytes inside tensor data: harmless to the format, the load must succeed."""
    (n,) = struct.unpack("<Q", blob[:8])
    out = bytearray(blob)
    for position in rng.integers(8 + n, len(blob), size=int(rng.integers(1, 65))):
        out[position] = int(rng.integers(0, 256))
    return bytes(out)


ABSURD_SHAPES = [
    [-1],
    [2**40],
    [0, 2**40],
    [2**31],
    [1.5],
    ["64"],
    [[64]],
    [True],
    None,
    "64",
    [],
    [0],
    [1] * 100,
    [2**20, 2**20],
]
ABSURD_DTYPES = ["F33", "", "f32", 5, None, ["F32"], {"F32": 1}, "F64", "F8_E5M2", "I32", "U8"]
ABSURD_OFFSETS = [None, [0], [0, 1, 2], ["0", "4"], [1.0, 2.0], [-4, 0], [True, False], "0-4"]


def header_edit(rng, blob: bytes) -> bytes:
    """One structural lie in an otherwise well-formed header."""
    header, data = split(blob)
    names = tensor_names(header)
    name = names[int(rng.integers(0, len(names)))]
    entry = header[name]
    begin, end = entry["data_offsets"]
    edit = int(rng.integers(0, 17))
    if edit == 0:  # offsets past the end of the file
        shift = len(data) - begin + int(rng.integers(0, 1000))
        entry["data_offsets"] = [begin + shift, end + shift]
    elif edit == 1:  # overlapping ranges: a tensor moved back over the one before it
        shift = min(begin, int(rng.integers(1, 1000)))
        entry["data_offsets"] = [begin - shift, end - shift]
    elif edit == 2:  # end before begin
        entry["data_offsets"] = [end, begin]
    elif edit == 3:
        entry["shape"] = ABSURD_SHAPES[int(rng.integers(0, len(ABSURD_SHAPES)))]
    elif edit == 4:
        entry["dtype"] = ABSURD_DTYPES[int(rng.integers(0, len(ABSURD_DTYPES)))]
    elif edit == 5:
        entry["data_offsets"] = ABSURD_OFFSETS[int(rng.integers(0, len(ABSURD_OFFSETS)))]
    elif edit == 6:
        del entry[["dtype", "shape", "data_offsets"][int(rng.integers(0, 3))]]
    elif edit == 7:
        header[name] = [5, "x", [], None][int(rng.integers(0, 4))]
    elif edit == 8:  # a tensor missing: a hole in the data, or bytes after the last
        del header[name]
    elif edit == 9:  # a renamed tensor: a valid file the model does not match
        header[name + ".renamed"] = header.pop(name)
    elif edit == 10:  # a transposed shape: same bytes, wrong for the model
        entry["shape"] = entry["shape"][::-1] + ([1] if len(entry["shape"]) == 1 else [])
    elif edit == 11:
        header["__metadata__"] = [{"format": 5}, [], "mlx", None][int(rng.integers(0, 4))]
    elif edit == 12:  # bytes after the last tensor
        data += bytes(int(rng.integers(1, 100)))
    elif edit == 13:  # a non-UTF-8 byte inside a tensor name
        raw = json.dumps(header).encode()
        at = raw.index(name.encode()) + int(rng.integers(0, len(name)))
        return join(raw[:at] + bytes([int(rng.choice([0x80, 0xC3, 0xFF]))]) + raw[at + 1 :], data)
    elif edit == 14:  # JSON's own corruptions: NaN, a lone surrogate, a non-object
        raw = [
            json.dumps(header).replace(f"[{begin}, ", "[NaN, ", 1),
            json.dumps({"\ud800": entry}),
            "[]",
            '"model"',
            "null",
        ][int(rng.integers(0, 5))]
        return join(raw.encode(), data)
    elif edit == 15:  # a header nested too deep for a recursive parser
        return join(b"[" * 100_000 + b"]" * 100_000, data)
    else:  # an empty header, or one padded with spaces (harmless: the reference pads)
        raw = [b"", b"{}", json.dumps(header).encode() + b" " * int(rng.integers(1, 8))]
        return join(raw[int(rng.integers(0, 3))], data)
    return join(header, data)


MUTATIONS = {
    "truncate": (truncate, 80),
    "header_bytes": (header_bytes, 80),
    "length_field": (length_field, 30),
    "data_bytes": (data_bytes, 15),
    "header_edit": (header_edit, 120),
}
CASES = [(kind, i) for kind, (_, count) in MUTATIONS.items() for i in range(count)]


@pytest.fixture(autouse=True)
def no_hang():
    faulthandler.dump_traceback_later(CASE_TIMEOUT_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def original(model_dirs) -> Path:
    return model_dirs["target"]


def damaged_copy(original: Path, tmp_path: Path, name: str, content: bytes) -> Path:
    model = tmp_path / "model"
    shutil.copytree(original, model)
    (model / name).write_bytes(content)
    return model


def assert_loads_or_says_why(model: Path) -> str:
    """'loaded', or the SpecmlxError's message (checked to be one line naming `model`)."""
    try:
        specmlx.load(model, lazy=False)
    except SpecmlxError as e:
        message = str(e)
        assert "\n" not in message and str(model) in message, message
        return message
    return "loaded"


@pytest.mark.parametrize(("kind", "number"), CASES, ids=[f"{k}-{i}" for k, i in CASES])
def test_damaged_safetensors_is_refused_or_loads(original, tmp_path, kind, number):
    mutate, _ = MUTATIONS[kind]
    rng = np.random.default_rng([SEED, list(MUTATIONS).index(kind), number])
    blob = (original / "model.safetensors").read_bytes()
    model = damaged_copy(original, tmp_path, "model.safetensors", mutate(rng, blob))
    outcome = assert_loads_or_says_why(model)
    if kind == "data_bytes":
        assert outcome == "loaded"


# --- the other files, and the command line --------------------------------------------

CONFIG = {
    "not JSON": lambda c: b'{"model_type": "qwen2",',
    "not UTF-8": lambda c: b"\xff\xfe\xfa" + json.dumps(c).encode(),
    "not an object": lambda c: json.dumps([c]).encode(),
    "no model_type": lambda c: json.dumps({k: v for k, v in c.items() if k != "model_type"}),
    "unknown model_type": lambda c: json.dumps({**c, "model_type": "qwen99"}),
    "no hidden_size": lambda c: json.dumps({k: v for k, v in c.items() if k != "hidden_size"}),
    "hidden_size a string": lambda c: json.dumps({**c, "hidden_size": "64"}),
}
TOKENIZER = {
    "truncated": lambda t: t[: len(t) // 2],
    "empty": lambda t: b"",
    "not UTF-8": lambda t: b"\xff" + t,
    "a list": lambda t: b"[]",
    "an empty object": lambda t: b"{}",
}
SPECMLX_JSON = {"truncated": lambda s: b'{"bits": 4,', "not UTF-8": lambda s: b"\xff\xfe"}
OTHER_FILES = [
    *[("config.json", name, make) for name, make in CONFIG.items()],
    *[("tokenizer.json", name, make) for name, make in TOKENIZER.items()],
    *[("specmlx.json", name, make) for name, make in SPECMLX_JSON.items()],
]


def damage(original: Path, file: str, make) -> bytes:
    if file == "config.json":
        content = make(json.loads((original / file).read_text()))
    elif file == "tokenizer.json":
        content = make((original / file).read_bytes())
    else:  # specmlx.json: written by `specmlx quantize`, absent from the tiny models
        content = make(b"")
    return content if isinstance(content, bytes) else content.encode()


@pytest.mark.parametrize(
    ("file", "name", "make"), OTHER_FILES, ids=[f"{f}-{n}" for f, n, _ in OTHER_FILES]
)
def test_damaged_json_file_is_refused_on_one_line(original, tmp_path, file, name, make):
    model = damaged_copy(original, tmp_path, file, damage(original, file, make))
    outcome = assert_loads_or_says_why(model)
    if file == "specmlx.json":  # provenance only: specmlx checks it exists, never reads it
        assert outcome == "loaded"
    else:
        assert outcome != "loaded"
        assert file in outcome, outcome


def generate(model: Path) -> subprocess.CompletedProcess:
    """The command a user runs (conftest points $SPECMLX_HOME at a scratch directory)."""
    return subprocess.run(
        [sys.executable, "-m", "specmlx", "generate", "-m", str(model), "-p", "hi"]
        + ["--max-tokens", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )


CLI_CASES = [
    ("model.safetensors", "truncated", lambda b: b[: len(b) * 2 // 3]),
    ("model.safetensors", "header length too big", lambda b: struct.pack("<Q", 2**40) + b[8:]),
    ("config.json", "not JSON", CONFIG["not JSON"]),
    ("config.json", "unknown model_type", CONFIG["unknown model_type"]),
    ("tokenizer.json", "an empty object", TOKENIZER["an empty object"]),
]


@pytest.mark.parametrize(
    ("file", "name", "make"), CLI_CASES, ids=[f"{f}-{n}" for f, n, _ in CLI_CASES]
)
def test_cli_exits_2_with_one_error_line(original, tmp_path, file, name, make):
    if file == "model.safetensors":
        content = make((original / file).read_bytes())
    else:
        content = damage(original, file, make)
    run = generate(damaged_copy(original, tmp_path, file, content))
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and file in lines[0], run.stderr


def without_tokenizer_files(original: Path, tmp_path: Path) -> Path:
    model = tmp_path / "model"
    shutil.copytree(original, model)
    (model / "tokenizer.json").unlink()
    (model / "tokenizer_config.json").unlink()
    return model


def test_a_model_without_tokenizer_files_is_refused_at_load_naming_them(original, tmp_path):
    # transformers builds a tokenizer from no files at all, one that encodes every text
    # to no tokens: the user heard "the prompt is empty", about a prompt that was not.
    model = without_tokenizer_files(original, tmp_path)
    said = assert_loads_or_says_why(model)
    assert said.startswith(f"{model} has no tokenizer files: it needs tokenizer.json and "), said
    assert said.endswith("copy them in from the model it was converted from, or re-download it")


def test_cli_without_tokenizer_files_exits_2_with_one_error_line(original, tmp_path):
    run = generate(without_tokenizer_files(original, tmp_path))
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "has no tokenizer files" in lines[0], run.stderr


def test_cli_generates_despite_a_corrupt_specmlx_json(original, tmp_path):
    model = damaged_copy(original, tmp_path, "specmlx.json", b'{"bits": 4,')
    run = generate(model)
    assert run.returncode == 0, run.stderr


def test_a_model_path_with_glob_characters_is_one_line(model_dirs, tmp_path):
    # mlx-lm looks its weights up with a glob pattern built from the path.
    odd = tmp_path / "qwen[int4]"
    shutil.copytree(model_dirs["target"], odd)
    with pytest.raises(SpecmlxError, match=r"rename the directory"):
        specmlx.load(odd)


# --- a GGUF file: the same promise, for `specmlx quantize FILE.gguf` ---------------------


def gguf_sections(blob: bytes, path: Path) -> int:
    """Where a valid GGUF file's tensor data begins (the metadata and tensor infos end)."""
    from gguf import GGUFReader

    return int(GGUFReader(path).data_offset)


def gguf_truncate(rng, blob: bytes, data_at: int) -> bytes:
    """Cut anywhere; most cuts in the header, the metadata or the tensor infos."""
    if rng.random() < 0.1:
        return blob[: int(rng.choice([0, 3, 4, 8, 16, 24, data_at - 1, data_at]))]
    end = data_at if rng.random() < 2 / 3 else len(blob)
    return blob[: int(rng.integers(0, end))]


def gguf_header_bytes(rng, blob: bytes, data_at: int) -> bytes:
    """1-8 random bytes in the metadata and tensor infos (the magic left alone half the
    time, so that most reach the reader's parsing)."""
    out = bytearray(blob)
    start = 4 if rng.random() < 0.5 else 0
    for position in rng.integers(start, data_at, size=int(rng.integers(1, 9))):
        out[position] = int(rng.integers(0, 256))
    return bytes(out)


def gguf_count_field(rng, blob: bytes, data_at: int) -> bytes:
    """The version, tensor count or metadata count off by a little, or absurd."""
    offset, size = [(4, 4), (8, 8), (16, 8)][int(rng.integers(0, 3))]
    (value,) = struct.unpack_from("<I" if size == 4 else "<Q", blob, offset)
    choices = [0, 1, value - 1, value + 1, value * 2, 2**31, 2 ** (8 * size) - 1]
    new = int(rng.choice(choices)) % 2 ** (8 * size)
    out = bytearray(blob)
    struct.pack_into("<I" if size == 4 else "<Q", out, offset, new)
    return bytes(out)


GGUF_MUTATIONS = {
    "truncate": (gguf_truncate, 35),
    "header_bytes": (gguf_header_bytes, 45),
    "count_field": (gguf_count_field, 20),
}
GGUF_CASES = [(kind, i) for kind, (_, count) in GGUF_MUTATIONS.items() for i in range(count)]


@pytest.fixture(scope="module")
def tiny_gguf(original, tmp_path_factory) -> Path:
    from test_gguf import write_gguf

    return write_gguf(original, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.mark.parametrize(
    ("kind", "number"), GGUF_CASES, ids=[f"gguf-{k}-{i}" for k, i in GGUF_CASES]
)
def test_damaged_gguf_is_refused_on_one_line_or_opens(tiny_gguf, tmp_path, kind, number):
    from specmlx.convert.gguf import open_gguf

    mutate, _ = GGUF_MUTATIONS[kind]
    rng = np.random.default_rng([SEED, 100 + list(GGUF_MUTATIONS).index(kind), number])
    blob = tiny_gguf.read_bytes()
    path = tmp_path / "damaged.gguf"
    path.write_bytes(mutate(rng, blob, gguf_sections(blob, tiny_gguf)))
    try:
        open_gguf(path)
    except SpecmlxError as e:
        message = str(e)
        assert "\n" not in message and str(path) in message, message
        assert "Error" not in message, message  # no exception's name or message leaks


def test_a_gguf_the_reader_cannot_read_says_whether_it_is_one(tiny_gguf, tmp_path):
    from specmlx.convert.gguf import open_gguf

    blob = tiny_gguf.read_bytes()
    for content, says in [
        (blob[:100], "is truncated or corrupt"),
        (b"GGUX" + blob[4:], "is not a GGUF file"),
    ]:
        path = tmp_path / "bad.gguf"
        path.write_bytes(content)
        with pytest.raises(SpecmlxError) as refused:
            open_gguf(path)
        assert str(refused.value) == f"{path} {says}"
        assert refused.value.__cause__ is not None  # chained, for --debug


def test_a_file_mlx_saved_without_metadata_reads(tmp_path):
    # mx.save_safetensors writes "__metadata__": null when it is given none.
    from specmlx.safetensors import read_header

    path = tmp_path / "model.safetensors"
    mx.save_safetensors(str(path), {"a": mx.zeros((2, 2))})
    assert read_header(path).metadata == {}
