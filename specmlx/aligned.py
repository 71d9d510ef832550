"""Aligned copies of safetensors files, kept in $SPECMLX_HOME/mapped so they can be mapped.

A tensor can be used in place over a mapping of its file only at an 8-byte-aligned
offset (specmlx/cpu/_native/mapped.cpp). mx.save_safetensors, and so mlx_lm.convert and
every mlx-community model, starts the data section wherever the JSON header ends: most of
its tensors are unaligned and would be copied into private memory by every process, at
every start. Such a file gets one copy here instead: the same tensors and metadata (plus
the source's identity), each tensor on a 64-byte boundary with its byte count in the 8
bytes before it, where MLX's CPU buffers keep their size, so that mapping it writes
nothing (no page of the copy becomes private). Written once, to a temporary name then
renamed; every later start, in any process, maps it.

A copy is named by a hash of its source's resolved path, size and mtime, so a changed
source is never served an old copy; before it is used it is checked as any file is
(its header against its size, specmlx.safetensors) and against the source's header, and
one that fails (truncated, foreign, stale) is written again. The directory is bounded
(`evict`): copies whose source is gone or changed go first, then the least recently used
until the total fits SPECMLX_MAPPED_CACHE_GB, by default twice the largest model it holds.
SPECMLX_MAPPED_CACHE_GB=0 makes no copies (the unaligned tensors are read by mx.load).

Other bytes derived from a model's files alone (specmlx.cpu.packing's packed tiles) are
kept here the same way, as byte tensors (`find_blobs`, `store_blobs`), named by what they
are made of and the files they are made from, and bounded and forgotten with the copies.
No mlx here: the CLI's `models rm` calls `forget` without loading it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import secrets
import struct
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import SpecmlxError
from .paths import home
from .safetensors import Header, read_header

ENV_LIMIT = "SPECMLX_MAPPED_CACHE_GB"
# 64: a cache line, and what the kernels' vector loads like; any tensor needs only 8.
ALIGNMENT = 64
SIZE_BYTES = 8  # MLX's CPU buffer keeps its byte count in the 8 bytes before its data
MAX_GAP = SIZE_BYTES + ALIGNMENT - 1  # the padding before a tensor, at most
SOURCES = "specmlx.sources"  # metadata: JSON list of [resolved path, size, mtime_ns]
KIND = "specmlx.kind"  # metadata of stored blobs: what they are (their cache key)
# A temporary file this old is a writer that died, not one still writing.
STALE_TEMP_S = 3600
# 20 digits: no byte count or offset has more, so a header sized for it fits the real one.
MOST_DIGITS = 10**19


def cache_dir() -> Path:
    return home() / "mapped"


def needs_copy(header: Header) -> bool:
    """Whether some tensor lies where it cannot be mapped in place."""
    return any(t.begin % SIZE_BYTES for t in header.tensors.values())


def identity(path: Path) -> list:
    """[resolved path, size, mtime_ns]: what a cached copy of `path` is a copy of."""
    resolved = Path(path).resolve()
    st = resolved.stat()
    return [str(resolved), st.st_size, st.st_mtime_ns]


def cache_path(sources: list[list], kind: str = "aligned") -> Path:
    """Where the cache keeps `kind` made from `sources`: named by a hash of both."""
    text = json.dumps([kind, sources], separators=(",", ":"))
    return cache_dir() / f"{hashlib.sha256(text.encode()).hexdigest()[:40]}.safetensors"


def limit_bytes() -> int | None:
    """SPECMLX_MAPPED_CACHE_GB in bytes; None when unset (twice the largest model)."""
    text = os.environ.get(ENV_LIMIT, "").strip()
    if not text:
        return None
    try:
        gb = float(text)
    except ValueError:
        gb = -1.0
    if not gb >= 0 or gb == float("inf"):
        raise SpecmlxError(f"{ENV_LIMIT} must be a number of GB >= 0, got {text!r}")
    return int(gb * 1e9)


def aligned_copy(header: Header) -> tuple[Header | None, str]:
    """The header of `header`'s file's aligned copy, written first where there is none
    (or only a bad one); (None, why) where there cannot be one."""
    limit = limit_bytes()
    if limit == 0:
        return None, f"{ENV_LIMIT}=0"
    sources = [identity(header.path)]
    file = cache_path(sources)
    copy = valid_copy(file, header, sources)
    if copy is not None:
        touch(file)
        return copy, ""
    layout, header_bytes, total = plan(header, sources)
    if not fits(sources, total, file):
        return None, f"its aligned copy ({total / 1e9:.2f} GB) would not fit {ENV_LIMIT}"
    try:
        write(header, sources, file, layout, header_bytes, total)
    except OSError as e:  # a read-only or full disk: the tensors are copied as before
        return None, f"cannot write an aligned copy in {cache_dir()} ({e.strerror or e})"
    if identity(header.path) != sources[0]:  # rewritten while it was copied
        file.unlink(missing_ok=True)
        return None, f"{header.path.name} changed while it was copied"
    evict(keep=sources, limit=limit)
    return valid_copy(file, header, sources), ""


def fits(sources: list[list], nbytes: int, file: Path) -> bool:
    """Whether `file`, of `nbytes`, made from `sources`, fits an explicit
    SPECMLX_MAPPED_CACHE_GB beside what is cached for the same model (the one bound
    `evict` cannot enforce: it never removes the model being loaded). The default bound
    grows with the largest model, so anything fits it."""
    limit = limit_bytes()
    if limit is None:
        return True
    model = {str(Path(s[0]).parent) for s in sources}
    used = sum(
        st.st_size
        for other, st, made_from in entries()
        if other != file
        and is_current(made_from)
        and any(str(Path(s[0]).parent) in model for s in made_from)
    )
    return used + nbytes <= limit


def find_blobs(kind: str, sources: list[list], names: list[str]) -> Header | None:
    """The header of the stored blobs `names` of `kind`, from `sources`, where a whole file
    of them is cached; None where not (or SPECMLX_MAPPED_CACHE_GB=0)."""
    if limit_bytes() == 0:
        return None
    file = cache_path(sources, kind)
    try:
        found = read_header(file, max_gap=MAX_GAP)
    except (OSError, SpecmlxError):
        return None
    meta = found.metadata
    if meta.get(SOURCES) != json.dumps(sources) or meta.get(KIND) != kind:
        return None
    if sorted(found.tensors) != sorted(names):
        return None
    if any(t.dtype != "U8" or t.begin % ALIGNMENT for t in found.tensors.values()):
        return None
    touch(file)
    return found


def store_blobs(kind: str, sources: list[list], names: list[str], blobs: Iterator) -> Header:
    """Write the blobs `names` (the iterator yields (name, buffer) in that order, one at a
    time, so only one need be in memory) as 1-D U8 tensors laid out as the copies are,
    then rename the file into place and bound the cache. OSError where it cannot."""
    file = cache_path(sources, kind)
    metadata = {SOURCES: json.dumps(sources), KIND: kind}
    widest = {name: (MOST_DIGITS, MOST_DIGITS) for name in names}
    reserved = len(blobs_json(metadata, widest))
    header_bytes = -(-(SIZE_BYTES + reserved) // ALIGNMENT) * ALIGNMENT - SIZE_BYTES
    data_start = SIZE_BYTES + header_bytes
    layout: dict[str, tuple[int, int]] = {}
    end = 0
    with writing(file) as out:
        staged = Staged(out)
        staged.write(b"\0" * data_start, 0)  # the header's place, written last
        for name, blob in blobs:
            data = memoryview(blob).cast("B")
            begin = -(-(end + SIZE_BYTES) // ALIGNMENT) * ALIGNMENT
            staged.write(struct.pack("<Q", data.nbytes), data_start + begin - SIZE_BYTES)
            staged.write(data, data_start + begin)
            end = begin + data.nbytes
            layout[name] = (begin, end)
        staged.close()
        if list(layout) != list(names):
            raise OSError(errno.EINVAL, "the blobs written are not the ones named")
        text = blobs_json(metadata, layout)
        write_all(out, struct.pack("<Q", header_bytes) + text.ljust(header_bytes), 0)
        os.ftruncate(out, data_start + end)
    evict(keep=sources, limit=limit_bytes())
    return read_header(file, max_gap=MAX_GAP)


def blobs_json(metadata: dict, layout: dict[str, tuple[int, int]]) -> bytes:
    entries: dict = {"__metadata__": metadata}
    for name, (begin, end) in layout.items():
        entries[name] = {"dtype": "U8", "shape": [end - begin], "data_offsets": [begin, end]}
    return json.dumps(entries, separators=(",", ":")).encode()


def valid_copy(file: Path, header: Header, sources: list[list]) -> Header | None:
    """`file`'s header where it is a whole aligned copy of `header`'s tensors, from
    `sources`; else None (absent, truncated, corrupt or another file's)."""
    try:
        copy = read_header(file, max_gap=MAX_GAP)
    except (OSError, SpecmlxError):
        return None
    ours = {k: v for k, v in copy.metadata.items() if k != SOURCES}
    if copy.metadata.get(SOURCES) != json.dumps(sources) or ours != header.metadata:
        return None
    if copy.tensors.keys() != header.tensors.keys():
        return None
    for name, info in header.tensors.items():
        c = copy.tensors[name]
        if (c.dtype, c.shape) != (info.dtype, info.shape) or c.begin % ALIGNMENT:
            return None
    return copy


def plan(header: Header, sources: list[list]) -> tuple[dict[str, tuple[int, int]], int, int]:
    """Where each tensor goes in the copy (data offsets), the JSON's padded length and the
    file's size. The data section starts on an ALIGNMENT boundary, so an aligned data
    offset is an aligned file offset; the tensors keep their order."""
    layout, end = {}, 0
    for name, info in sorted(header.tensors.items(), key=lambda item: item[1].begin):
        begin = -(-(end + SIZE_BYTES) // ALIGNMENT) * ALIGNMENT
        end = begin + info.end - info.begin
        layout[name] = (begin, end)
    raw = len(header_json(header, sources, layout))
    header_bytes = -(-(SIZE_BYTES + raw) // ALIGNMENT) * ALIGNMENT - SIZE_BYTES
    return layout, header_bytes, SIZE_BYTES + header_bytes + end


def header_json(header: Header, sources: list[list], layout: dict) -> bytes:
    entries: dict = {"__metadata__": {**header.metadata, SOURCES: json.dumps(sources)}}
    for name, info in header.tensors.items():
        entries[name] = {
            "dtype": info.dtype,
            "shape": list(info.shape),
            "data_offsets": list(layout[name]),
        }
    return json.dumps(entries, separators=(",", ":")).encode()


def write(
    header: Header, sources: list[list], file: Path, layout: dict, header_bytes: int, total: int
) -> None:
    """Write the copy beside `file`, then rename it into place: a reader sees the whole
    copy or none. The padding is a hole (ftruncate); each size field is 8 bytes."""
    text = header_json(header, sources, layout)
    data_start = SIZE_BYTES + header_bytes
    with open(header.path, "rb") as src, writing(file) as out:
        staged = Staged(out)
        staged.write(struct.pack("<Q", header_bytes) + text.ljust(header_bytes), 0)
        for name in layout:  # in the copy's order: forward
            info = header.tensors[name]
            begin = data_start + layout[name][0]
            nbytes = info.end - info.begin
            staged.write(struct.pack("<Q", nbytes), begin - SIZE_BYTES)
            staged.copy(src.fileno(), info.begin, nbytes, begin)
        staged.close()
        os.ftruncate(out, total)


@contextmanager
def writing(file: Path) -> Iterator[int]:
    """A descriptor of a temporary file beside `file`, renamed to it once written and
    synced (a reader sees all of it or none), removed if the writing fails."""
    file.parent.mkdir(parents=True, exist_ok=True)
    temp = file.with_name(f".{file.stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        try:
            yield fd
            os.fsync(fd)  # renamed only once its bytes are on disk
        finally:
            os.close(fd)
        os.replace(temp, file)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def write_all(fd: int, data, at: int) -> None:
    data = memoryview(data).cast("B")
    while data:
        n = os.pwrite(fd, data, at)
        data, at = data[n:], at + n


class Staged:
    """Writes at increasing offsets of a file, staged and written a whole aligned 2 MiB at
    a time: the page cache then holds the file in 2 MiB folios where the filesystem can
    (ext4 and xfs on recent kernels), which a mapping of the file maps as huge pages. A
    decode step streams every weight once; on 4 KiB pages that is a TLB miss every 4 KiB
    (the packed tiles' anonymous copies are on huge pages for the same reason)."""

    PIECE = 2 << 20

    def __init__(self, fd: int):
        self.fd, self.base, self.end = fd, 0, 0
        # Its own anonymous mapping, not the heap's: returned whole when closed, where
        # malloc would keep a freed 2 MiB in the process.
        self.piece = mmap.mmap(-1, self.PIECE)

    def _to(self, at: int) -> memoryview:
        """Room in the piece from `at` on, after writing out the piece before it."""
        if at < self.base:
            raise ValueError("staged writes go forward only")
        if at >= self.base + self.PIECE:
            self.flush()
            self.base = at - at % self.PIECE
        self.end = max(self.end, at)
        return memoryview(self.piece)[at - self.base :]

    def write(self, data, at: int) -> None:
        data = memoryview(data).cast("B")
        while data:
            room = self._to(at)
            n = min(len(room), len(data))
            room[:n] = data[:n]
            data, at = data[n:], at + n
            self.end = max(self.end, at)

    def copy(self, src: int, src_at: int, nbytes: int, at: int) -> None:
        """nbytes of file `src` from src_at, read straight into the piece."""
        while nbytes:
            room = self._to(at)[:nbytes]
            n = os.preadv(src, [room], src_at)
            if n <= 0:
                raise OSError(errno.EIO, "the source ended before its tensors did")
            src_at, at, nbytes = src_at + n, at + n, nbytes - n
            self.end = max(self.end, at)

    def flush(self) -> None:
        if self.end > self.base:
            write_all(self.fd, memoryview(self.piece)[: self.end - self.base], self.base)
        self.piece.madvise(mmap.MADV_DONTNEED)  # zeros: the padding of the next piece

    def close(self) -> None:
        self.flush()
        self.piece.close()


def touch(file: Path) -> None:
    """Mark `file` used now: its atime is the LRU's clock (mtime stays the write's)."""
    try:
        os.utime(file, ns=(time.time_ns(), file.stat().st_mtime_ns))
    except OSError:  # a read-only cache still serves its copies
        pass


def entries() -> list[tuple[Path, os.stat_result, list[list]]]:
    """Each cached file, its stat and its sources ([] where its header is unreadable)."""
    found = []
    for file in cache_dir().glob("*.safetensors"):
        try:
            st = file.stat()
            sources = json.loads(read_header(file, max_gap=MAX_GAP).metadata[SOURCES])
        except (OSError, SpecmlxError, KeyError, ValueError):
            sources = []
            try:
                st = file.stat()
            except OSError:
                continue
        found.append((file, st, sources))
    return found


def is_current(sources: list[list]) -> bool:
    try:
        return bool(sources) and all(identity(Path(s[0])) == s for s in sources)
    except (OSError, TypeError, IndexError):
        return False


def evict(keep: Iterable[list] = (), limit: int | None = None) -> list[Path]:
    """Bound the cache: remove temporary files of dead writers, copies whose source is
    gone or changed, then the least recently used until the total is at most `limit`
    (None: twice the largest model, a model being what was made from one directory's
    files). Never what was made from a source in `keep` (the model being loaded). A
    process that has a removed copy mapped keeps its pages: an unlinked file lives on
    until unmapped. Returns what was removed."""
    keep = [list(s) for s in keep]
    removed = []
    now = time.time()
    for temp in cache_dir().glob(".*.tmp"):
        try:
            if now - temp.stat().st_mtime > STALE_TEMP_S:
                temp.unlink()
                removed.append(temp)
        except OSError:
            pass
    live = []
    for file, st, sources in entries():
        kept = any(s in keep for s in sources)
        if not kept and not is_current(sources):
            file.unlink(missing_ok=True)
            removed.append(file)
        else:
            live.append((file, st, sources, kept))
    if limit is None:
        models: dict[str, int] = {}
        for _, st, sources, _ in live:
            model = str(Path(sources[0][0]).parent) if sources else ""
            models[model] = models.get(model, 0) + st.st_size
        limit = 2 * max(models.values(), default=0)
    total = sum(st.st_size for _, st, _, _ in live)
    for file, st, _, kept in sorted(live, key=lambda entry: entry[1].st_atime_ns):
        if total <= limit:
            break
        if not kept:
            file.unlink(missing_ok=True)
            removed.append(file)
            total -= st.st_size
    return removed


def forget(model_dir: Path) -> list[Path]:
    """Remove the cached copies made from files in `model_dir` (its model deleted)."""
    root = Path(model_dir).resolve()
    removed = []
    for file, _, sources in entries():
        if any(Path(s[0]).is_relative_to(root) for s in sources):
            file.unlink(missing_ok=True)
            removed.append(file)
    return removed
