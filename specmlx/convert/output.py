"""Where a conversion's output goes: checked before anything is read (not over the
source, not under a file, writable, room for it), written into a temp directory beside
OUT and renamed into place only when whole, so an error or Ctrl-C leaves nothing behind.
Shared by `specmlx quantize` and whatever else writes a directory (heads)."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import SpecmlxError
from ..wording import human_bytes
from . import shards


def check_output(out: Path, source_path: Path, force: bool) -> None:
    source_path = source_path.resolve()
    resolved = out.resolve()
    if resolved == source_path or source_path.is_relative_to(resolved):
        raise SpecmlxError(f"OUT {out} would overwrite the source {source_path}; pick another OUT")
    if source_path.is_dir() and resolved.is_relative_to(source_path):
        raise SpecmlxError(f"OUT {out} is inside the source {source_path}; pick a path outside it")
    if (out.exists() or out.is_symlink()) and not force:
        raise SpecmlxError(f"{out} already exists; pass --force to replace it")


@contextmanager
def atomic_directory(out: Path) -> Iterator[Path]:
    """A temp dir beside `out`, renamed to `out` (replacing it) only if the block succeeds.

    On any exception, KeyboardInterrupt included, the temp dir and any parent directories
    created for it are removed, so a failure leaves the file system as it was.
    """
    created = [p for p in [out.parent, *out.parent.parents] if not p.exists()]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    except OSError as e:  # checked before (check_writable), but the disk may have changed
        _remove_empty(created)
        raise unwritable(out, e) from None
    tmp.chmod(0o777 & ~_umask())  # mkdtemp's 0700 would make OUT private, unlike mkdir
    try:
        yield tmp
        try:
            _move_into_place(tmp, out)
        except OSError as e:
            raise unwritable(out, e) from None
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:  # the tokenizer, the config
            raise shards.disk_full(out) from None
        raise


def _move_into_place(tmp: Path, out: Path) -> None:
    if out.exists() or out.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        out.rename(old / "replaced")
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)


def _remove_empty(created: list[Path]) -> None:
    """Remove the directories made for OUT's parent (deepest first), as far as empty."""
    for directory in created:
        try:
            directory.rmdir()
        except OSError:
            break


def check_writable(out: Path) -> None:
    """Refuse at once, before the source is read, an OUT that cannot be created: under a
    file, on a read-only file system, in a directory this user may not write to."""
    ancestor = _existing_ancestor(out.parent)
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise unwritable(out)


def unwritable(out: Path, error: OSError | None = None) -> SpecmlxError:
    """Why OUT cannot be created (from its nearest existing ancestor, or `error`, the
    OSError creating it raised), and the way out, in one line."""
    ancestor = _existing_ancestor(out.parent)
    code = error.errno if error is not None else None
    if not ancestor.is_dir():
        why = f"{ancestor} is a file, not a directory; pick an OUT that is not under a file"
    elif code == errno.EROFS or os.statvfs(ancestor).f_flag & os.ST_RDONLY:
        why = f"{ancestor} is on a read-only file system; pick an OUT on a writable one"
    elif code in (None, errno.EACCES, errno.EPERM):
        why = (
            f"no permission to write in {ancestor}; pick an OUT in a directory you can "
            "write to, or change its permissions"
        )
    else:
        why = f"{error.strerror or error}; pick another OUT"
    return SpecmlxError(f"cannot write {out}: {why}")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# config.json, the shard index, specmlx.json and the shards' headers: small beside the
# weights, but the output's own, so counted.
METADATA_BYTES = 1 << 20


def check_free_space(out: Path, content_bytes: int) -> None:
    """Refuse, before writing, an OUT whose file system has less free space than the
    output takes: its tensors and tokenizer as planned, plus METADATA_BYTES."""
    needed = content_bytes + METADATA_BYTES
    free = shutil.disk_usage(_existing_ancestor(out)).free
    if free < needed:
        raise SpecmlxError(
            f"not enough disk space for {out}: it needs {human_bytes(needed)}, "
            f"{human_bytes(free)} is free; free some space or pick another OUT"
        )


def _existing_ancestor(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path
