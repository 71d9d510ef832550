"""Safetensors read row by row and written tensor by tensor, never a whole model in memory.

A safetensors file is an 8-byte header length, a JSON header (name → dtype, shape, byte
range) and the raw tensors. Because the quantized shapes are known before any tensor is
computed, every shard's header can be written first and each tensor streamed into its
place as soon as it exists: peak memory is one chunk of one tensor, not one shard.
Reads use plain file reads rather than mmap so that pages already quantized do not stay
resident (mapped pages count towards the process's RSS).
"""

from __future__ import annotations

import errno
import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import SpecmlxError

# safetensors dtype name → (numpy dtype the bytes are read as, mlx dtype they mean)
DTYPES = {
    "F32": (np.float32, mx.float32),
    "F16": (np.float16, mx.float16),
    "BF16": (np.uint16, mx.bfloat16),  # numpy has no bfloat16: read the bits, view in mlx
    "U32": (np.uint32, mx.uint32),
}
NAMES = {mlx_dtype: name for name, (_, mlx_dtype) in DTYPES.items()}
ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4}


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor of a safetensors file lies: enough to read any range of its rows."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the tensor's first element in the file
    nbytes: int

    def read_rows(self, start: int, stop: int) -> mx.array:
        np_dtype, mlx_dtype = DTYPES[self.dtype]
        row_elems = int(np.prod(self.shape[1:], dtype=np.int64))
        with open(self.file, "rb") as f:
            f.seek(self.offset + start * row_elems * ITEMSIZE[self.dtype])
            data = np.fromfile(f, dtype=np_dtype, count=(stop - start) * row_elems)
        array = mx.array(data.reshape((stop - start, *self.shape[1:])))
        return array.view(mlx_dtype) if self.dtype == "BF16" else array


def read_header(file: Path) -> tuple[dict[str, StoredTensor], bytes]:
    """The tensors a safetensors file holds, and its raw header (for fingerprinting).

    Everything the header claims is checked against the file's size, so a truncated or
    corrupt file is refused here, before any output is written.
    """
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SpecmlxError(f"{file} is truncated: too short to be a safetensors file")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(size - 8, 100 << 20):
            raise SpecmlxError(f"{file} is truncated or not a safetensors file (bad header size)")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise SpecmlxError(f"{file} has a corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise SpecmlxError(f"{file} has a corrupt safetensors header")
    base = 8 + header_len
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = entry["dtype"], tuple(entry["shape"])
            begin, end = entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SpecmlxError(f"{file} has a corrupt safetensors entry for {name}") from None
        if dtype not in ITEMSIZE:
            raise SpecmlxError(f"{file}: tensor {name} has dtype {dtype}, not a float type")
        if base + end > size:
            raise SpecmlxError(
                f"{file} is truncated: tensor {name} ends at byte {base + end}, file has {size}"
            )
        tensors[name] = StoredTensor(file, dtype, shape, base + begin, end - begin)
    return tensors, raw


@dataclass(frozen=True)
class Planned:
    """One output tensor: its name, safetensors dtype and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * ITEMSIZE[self.dtype]


def plan_shards(groups: Iterable[list[Planned]], max_bytes: int) -> list[list[Planned]]:
    """Split the outputs into shards of at most `max_bytes` (mlx-lm's rule), keeping each
    group (a weight with its scales and biases) in one shard; a group larger than the
    limit gets a shard of its own."""
    shards: list[list[Planned]] = []
    size = 0
    for group in groups:
        group_bytes = sum(t.nbytes for t in group)
        if not shards or size + group_bytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(group)
        size += group_bytes
    return shards


def shard_names(count: int) -> list[str]:
    """mlx-lm's file names: one file is model.safetensors, more are numbered."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _header(tensors: list[Planned]) -> tuple[bytes, dict[str, int]]:
    entries: dict = {"__metadata__": {"format": "mlx"}}
    offsets = {}
    position = 0
    for t in tensors:
        entries[t.name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [position, position + t.nbytes],
        }
        offsets[t.name] = position
        position += t.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the format recommends
    return struct.pack("<Q", len(raw)) + raw, offsets


def write_at(f, offset: int, data: memoryview) -> None:
    """One write at a byte offset; the single place bytes reach the disk (tests stub it)."""
    f.seek(offset)
    f.write(data)


def disk_full(directory: Path) -> SpecmlxError:
    return SpecmlxError(f"disk full while writing {directory}: free some space and rerun")


class ShardWriter:
    """Writes planned shards whose tensors arrive in plan order, chunk by chunk of rows."""

    def __init__(
        self, directory: Path, shards: list[list[Planned]], names: list[str] | None = None
    ):
        self.directory = directory
        self.names = names or shard_names(len(shards))  # `names`: files other than the model's
        self.location: dict[str, tuple[int, int, Planned]] = {}  # name → (shard, offset, plan)
        self.headers = []
        for index, tensors in enumerate(shards):
            header, offsets = _header(tensors)
            self.headers.append(header)
            for t in tensors:
                self.location[t.name] = (index, len(header) + offsets[t.name], t)
        self.open_index = -1
        self.file = None

    def write_rows(self, name: str, start_row: int, array: mx.array) -> None:
        """Write `array` (rows start_row.. of tensor `name`) where the plan put it."""
        index, offset, planned = self.location[name]
        if array.dtype != DTYPES[planned.dtype][1]:
            raise ValueError(f"{name}: got {array.dtype}, planned {planned.dtype}")
        if index != self.open_index:
            self._open(index)
        row_bytes = planned.nbytes // planned.shape[0]
        bits = array.view(mx.uint16) if array.dtype == mx.bfloat16 else array
        data = np.ascontiguousarray(np.asarray(bits))
        self._guard(lambda: write_at(self.file, offset + start_row * row_bytes, data.data))

    def _open(self, index: int) -> None:
        self.close()
        self.file = open(self.directory / self.names[index], "wb")
        self.open_index = index
        self._guard(lambda: write_at(self.file, 0, memoryview(self.headers[index])))

    def _guard(self, action) -> None:
        try:
            action()
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise disk_full(self.directory) from None
            raise

    def close(self) -> None:
        if self.file is not None:
            file, self.file = self.file, None
            self._guard(file.close)  # the close flushes, so it too can find the disk full
