"""What models are on this machine: $SPECMLX_HOME/models and the Hugging Face hub cache.

Pure functions, no printing: `specmlx models` shows the listing and `--draft auto` picks
from it. Models in the same tokenizer group encode text to the same ids, so any of them
can draft for any other.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path

from .errors import SpecmlxError
from .paths import home

SPECMLX, HUB = "specmlx", "hub"


@dataclass(frozen=True)
class ModelEntry:
    name: str  # directory name under models_dir(), or the hub's repo id
    where: str  # SPECMLX or HUB
    path: Path  # the directory to load (for the hub: its newest snapshot)
    model_type: str | None
    size_bytes: int
    quantization: str  # "4-bit g64", or "dense"
    tokenizer: str | None  # group label; None where no tokenizer file is found
    source: str | None = None  # what specmlx converted it from (its specmlx.json)
    head_for: str | None = None  # a head (heads/): the target it drafts for
    source_command: str | None = None  # what writes that source again, where it is gone

    def as_json(self) -> dict:
        return {**self.__dict__, "path": str(self.path)}


def models_dir() -> Path:
    return home() / "models"


def read_config(path: Path) -> dict:
    """config.json of a model directory; {} if absent or unreadable (the listing shows
    what it can rather than failing on one broken directory)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def source_of(name: str, path: Path) -> tuple[str | None, str | None]:
    """specmlx.json's source and, where that is not on disk, the command that gets it back:
    an offline model's GGUF is assembled again from its wheels. Models built before
    specmlx.json named the wheels record the GGUF's temporary path: they are known by name."""
    from . import models

    try:
        info = json.loads((path / "specmlx.json").read_text())
    except (OSError, ValueError):
        return None, None
    if not isinstance(info, dict) or not isinstance(info.get("source"), str):
        return None, None
    source, spec = info["source"], models.offline_spec(name)
    if spec is None or models.gguf_path(spec).is_file():
        return source, None
    return source, models.get_source_command(spec)


def quantization_label(config: dict) -> str:
    quant = config.get("quantization")
    if not isinstance(quant, dict) or "bits" not in quant:
        return "dense"
    group = quant.get("group_size")
    return f"{quant['bits']}-bit g{group}" if group else f"{quant['bits']}-bit"


def directory_size(path: Path) -> int:
    """Bytes of the files under path; links followed, as the hub's snapshots are links."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def tokenizer_key(path: Path, vocab_keys: dict[str, str] | None = None) -> str | None:
    """A label equal for models whose tokenizer.json is byte-identical or has the same
    model.vocab (a re-serialised copy of one tokenizer is still the same tokenizer).

    `vocab_keys` caches file digest → label: a real vocab is a few MB of JSON to parse,
    and pairs usually ship the very same file.
    """
    tokenizer_json = path / "tokenizer.json"
    if not tokenizer_json.is_file():
        sentencepiece = path / "tokenizer.model"  # older Llama-style checkpoints
        if sentencepiece.is_file():
            return hashlib.sha256(sentencepiece.read_bytes()).hexdigest()[:8]
        return None
    data = tokenizer_json.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if vocab_keys is not None and digest in vocab_keys:
        return vocab_keys[digest]
    try:
        vocab = json.loads(data)["model"]["vocab"]
        canonical = json.dumps(vocab, sort_keys=True, ensure_ascii=False).encode()
        key = hashlib.sha256(canonical).hexdigest()[:8]
    except (ValueError, KeyError, TypeError):  # no vocab to compare: the bytes decide
        key = digest[:8]
    if vocab_keys is not None:
        vocab_keys[digest] = key
    return key


def local_entries(vocab_keys: dict[str, str]) -> list[ModelEntry]:
    root = models_dir()
    if not root.is_dir():
        return []
    dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    entries = []
    for path in dirs:
        source, command = source_of(path.name, path)
        listed = entry(path.name, SPECMLX, path, directory_size(path), vocab_keys)
        entries.append(replace(listed, source=source, source_command=command))
    return entries


def hub_entries(vocab_keys: dict[str, str]) -> list[ModelEntry]:
    """The hub cache's model repos at their newest cached revision; none if there is no
    cache. Reads the disk only: scan_cache_dir never goes online."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir()
    except CacheNotFound:
        return []
    entries = []
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        newest = max(repo.revisions, key=lambda r: r.last_modified)
        entries.append(
            entry(repo.repo_id, HUB, newest.snapshot_path, repo.size_on_disk, vocab_keys)
        )
    return entries


def entry(
    name: str, where: str, path: Path, size_bytes: int, vocab_keys: dict[str, str]
) -> ModelEntry:
    config = read_config(path)
    kind, head_for = head_of(path, config)
    return ModelEntry(
        name=name,
        where=where,
        path=path,
        model_type=kind or config.get("model_type"),
        size_bytes=size_bytes,
        quantization=quantization_label(config),
        tokenizer=tokenizer_key(path, vocab_keys),
        head_for=head_for,
    )


def head_of(path: Path, config: dict) -> tuple[str | None, str | None]:
    """(what kind of head, the target it drafts for) where `path` holds a head, else
    (None, None). An EAGLE-3 checkpoint names its target only where its config does."""
    from .heads import what_is

    found = what_is(path)
    if found == "head":
        target = config.get("target")
        return "head", target.get("name") if isinstance(target, dict) else None
    if found == "eagle3":
        target = config.get("base_model") or config.get("_name_or_path")
        return "EAGLE-3 head", target if isinstance(target, str) else None
    return None, None


def list_models() -> list[ModelEntry]:
    """Every model in $SPECMLX_HOME/models, then every model repo in the hub cache."""
    vocab_keys: dict[str, str] = {}  # shared, so both places label one tokenizer alike
    return local_entries(vocab_keys) + hub_entries(vocab_keys)


def same_directory(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


def smallest_same_tokenizer(
    target: Path, entries: list[ModelEntry] | None = None
) -> ModelEntry | None:
    """The smallest listed model with a config whose tokenizer is the target's, other than
    the target itself: the cheapest draft at hand for it."""
    key = tokenizer_key(target, {})
    if key is None:
        return None
    candidates = [
        e
        for e in (list_models() if entries is None else entries)
        if e.tokenizer == key and e.model_type and not same_directory(e.path, target)
    ]
    return min(candidates, key=lambda e: (e.size_bytes, e.name), default=None)


def removable(name: str) -> Path:
    """The directory `specmlx models rm NAME` may delete: a direct child of models_dir(),
    named, never reached through a path (so nothing else can be deleted by mistake)."""
    root = models_dir()
    if not name or name in (".", "..") or "/" in name or "\\" in name:
        raise SpecmlxError(
            f"{name!r} is not a model name: give a directory name as `specmlx models` lists "
            f"it under {root} (hub models: `hf cache rm model/ORG/NAME`)"
        )
    path = root / name
    if path.is_symlink() or not path.is_dir():
        raise SpecmlxError(f"no model directory {name!r} in {root} (see `specmlx models`)")
    return path
