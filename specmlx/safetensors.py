"""A .safetensors file's header, checked against the file before any tensor byte is touched.

The format: 8 bytes of little-endian header length, that many bytes of UTF-8 JSON (tensor
name -> {"dtype", "shape", "data_offsets": [begin, end]}, plus an optional "__metadata__"
object of strings), then the data section the offsets point into. A truncated download
or a corrupt header would otherwise surface as an internal error from mx.load, and in a
loader that maps the file, as a SIGBUS when a page past its end is touched. Everything
the header claims is checked here, from its bytes and the file's size alone, so that a
bad file is refused with one line saying which file, which tensor and what is wrong.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import SpecmlxError
from .wording import human_bytes

# Bytes per element of each dtype the format defines and MLX loads (MLX reads the F8 kinds
# it knows as raw uint8, which is how quantized checkpoints use them).
DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "C64": 8,
}
# Valid safetensors that mx.load refuses: worth a different fix than a re-download.
DTYPES_MLX_CANNOT_LOAD = {"F64", "F8_E5M2", "F4", "F6_E2M3", "F6_E3M2"}
# The reference reader's limit: a larger length field is corruption, not a header.
MAX_HEADER_BYTES = 100_000_000
# MLX keeps each dimension in an int32; a larger one would wrap silently. Real tensors
# have a handful of dimensions; the cap keeps the product of a corrupt shape cheap.
MAX_DIMENSION = 2**31 - 1
MAX_NDIM = 64
FIX = "re-download or re-convert the model"


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes lie in the file, and how to read them."""

    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


@dataclass(frozen=True)
class Header:
    """A validated header: every tensor's range lies inside the file, none overlap."""

    path: Path
    data_start: int  # absolute offset of the data section: 8 + header length
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]


def read_header(path: Path, max_gap: int = 0) -> Header:
    """Read and check `path`'s header, reading nothing past it; SpecmlxError if it is bad.

    `max_gap`: how many bytes before a tensor may belong to none, for a file that pads
    its tensors to an alignment (specmlx.aligned's copies); the format's own files have
    none."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        length_field = f.read(8)
        if len(length_field) < 8:
            raise _bad(path, f"the file is {size} bytes, too short for a header (truncated)")
        (header_bytes,) = struct.unpack("<Q", length_field)
        if header_bytes > MAX_HEADER_BYTES:
            raise _bad(
                path,
                f"header length field says {header_bytes} bytes, "
                f"over {human_bytes(MAX_HEADER_BYTES)}",
            )
        if header_bytes > size - 8:
            raise _bad(
                path,
                f"header length field says {header_bytes} bytes but only {size - 8} follow "
                "it (truncated)",
            )
        raw = f.read(header_bytes)
    header = _parse_json(path, raw)
    data_bytes = size - 8 - header_bytes
    metadata = header.pop("__metadata__", None)
    if metadata is None:  # mx.save_safetensors writes null when it was given no metadata
        metadata = {}
    if not isinstance(metadata, dict) or not all(
        isinstance(v, str) and _is_utf8(k) and _is_utf8(v) for k, v in metadata.items()
    ):
        raise _bad(path, "__metadata__ is not an object of strings")
    tensors = {
        name: _tensor_info(path, name, entry, data_bytes, 8 + header_bytes)
        for name, entry in header.items()
    }
    _check_ranges_tile(path, tensors, 8 + header_bytes, data_bytes, max_gap)
    return Header(path, 8 + header_bytes, tensors, metadata)


def _parse_json(path: Path, raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _bad(path, f"header is not UTF-8 (byte {e.start} of it)") from None
    try:
        # NaN and Infinity are Python's extension, not JSON: MLX's parser refuses them.
        header = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise _bad(path, f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        kind = "null" if header is None else type(header).__name__
        raise _bad(path, f"header is a JSON {kind}, not an object")
    for name in header:
        if not _is_utf8(name):  # a lone surrogate escape: valid to Python's json only
            raise _bad(path, f"tensor name {_quote(name)} is not valid Unicode")
    return header


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON value")


def _tensor_info(path: Path, name: str, entry, data_bytes: int, data_start: int) -> TensorInfo:
    def bad(problem: str) -> SpecmlxError:
        return _bad(path, f"tensor {_quote(name)} {problem}")

    if not isinstance(entry, dict):
        raise bad("is not an object with dtype, shape and data_offsets")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in entry:
            raise bad(f"has no {key}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        raise bad(f"has dtype {_quote(dtype)}, not a name like F32")
    if dtype in DTYPES_MLX_CANNOT_LOAD:
        raise SpecmlxError(
            f"{path}: tensor {_quote(name)} has dtype {dtype}, which MLX cannot load; "
            "convert the model to F32, F16 or BF16"
        )
    if dtype not in DTYPE_SIZES:
        raise bad(f"has unknown dtype {_quote(dtype)}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(_is_count(d) and d <= MAX_DIMENSION for d in shape)
    ):
        raise bad(
            f"has shape {_quote(shape)}, not a list of at most {MAX_NDIM} dimensions "
            f"from 0 to {MAX_DIMENSION}"
        )
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise bad(f"has data_offsets {_quote(offsets)}, not [begin, end] byte counts")
    begin, end = offsets
    if begin > end:
        raise bad(f"has data_offsets [{begin}, {end}], which end before they begin")
    if end > data_bytes:
        raise bad(
            f"ends at byte {end} of the data section, which has {data_bytes} "
            "(a truncated file or a corrupt header)"
        )
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if end - begin != expected:
        raise bad(
            f"spans {end - begin} bytes ({begin}..{end}) but {dtype} {shape} needs {expected}"
        )
    return TensorInfo(dtype, tuple(shape), data_start + begin, data_start + end)


def _check_ranges_tile(
    path: Path, tensors: dict[str, TensorInfo], data_start: int, data_bytes: int, max_gap: int
) -> None:
    """The ranges must cover the data section exactly: no overlap, no hole, nothing after.

    The format requires it, the reference reader (and so every Hugging Face tool) refuses
    files that break it, and writers (safetensors, mx.save_safetensors, specmlx quantize)
    pack tensors back to back. A gap or trailing bytes therefore means a header that no
    longer describes its file (a shard cut short and re-padded, offsets edited). A padded
    file (max_gap > 0) may leave up to max_gap bytes before each tensor, no more.
    """
    position = data_start
    for name, info in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if info.begin < position:
            raise _bad(path, f"tensor {_quote(name)} overlaps the tensor before it")
        if info.begin > position + max_gap:
            raise _bad(
                path, f"{info.begin - position} bytes before tensor {_quote(name)} belong to none"
            )
        position = info.end
    if position != data_start + data_bytes:
        raise _bad(path, f"{data_start + data_bytes - position} bytes after the last tensor")


def _is_count(value) -> bool:
    # bool is an int to Python, but `true` is not a number in JSON
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_utf8(text) -> bool:
    try:
        text.encode("utf-8")
    except (UnicodeEncodeError, AttributeError):
        return False
    return True


def _quote(value, limit: int = 60) -> str:
    """repr, so that a corrupt name cannot break the message's single line; cut when long."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _bad(path: Path, problem: str) -> SpecmlxError:
    return SpecmlxError(f"{path} is not a valid safetensors file: {problem}; {FIX}")
