"""specmlx's own head directory: config.json (which target, by name and by a hash of its
weights, and how the head was trained) and head.safetensors (the head's own parameters
in float32; the target's embedding and output head are never stored: they are shared).

Loading puts the head in the target's own form: INT4 where the target keeps INT4 (and
then on the native CPU kernel where the target's layers run on it), else the target's
dtype, so that a draft pass costs what its share of the target's bytes predicts.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import SpecmlxError
from ..loading import Model
from . import HEAD_FORMAT
from .feature import new_head
from .head import Head, head_vocab, ready, target_rows

WEIGHTS = "head.safetensors"
SAMPLES = 16  # spans of each weights file read into the target's hash
SPAN = 1 << 16


def weights_id(path: Path) -> str:
    """A hash of a model's weights: every safetensors file's header (names, shapes, dtypes,
    offsets) and SAMPLES spans of its data, so reading it costs milliseconds where hashing
    every byte of a 1.5 GB target would cost seconds, and two fine-tunes of one shape
    still differ."""
    digest = hashlib.sha256()
    for file in sorted(path.glob("*.safetensors")):
        size = file.stat().st_size
        with open(file, "rb") as f:
            digest.update(file.name.encode() + size.to_bytes(8, "little"))
            for i in range(SAMPLES + 1):
                f.seek(0 if i == 0 else max(0, size * i // SAMPLES - SPAN))
                digest.update(f.read(SPAN))
    return digest.hexdigest()


def save_head(module: nn.Module, target: Model, out: Path, trained: dict) -> None:
    """Write a head for `target` to directory `out`, atomically (a temp dir renamed)."""
    from ..convert.output import atomic_directory

    config = {
        "format": HEAD_FORMAT,
        "version": 1,
        "kind": "feature",
        "target": {
            "name": target.name,
            "model_type": target.config.get("model_type"),
            "weights_id": weights_id(target.path),
        },
        "vocab": head_vocab(target),  # its sub-vocabulary's size, as trained (None: whole)
        "trained": trained,
    }
    weights = {k: v.astype(mx.float32) for k, v in tree_flatten(module.parameters())}
    with atomic_directory(out) as tmp:
        mx.save_safetensors(str(tmp / WEIGHTS), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def read_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise SpecmlxError(
            f"cannot read the head's config in {path} ({e}); train it again"
        ) from None


def load_head(path: Path, target: Model) -> Head:
    """The head in directory `path`, for `target`; refused in one line when it was
    trained for another target."""
    start = time.perf_counter()
    config = read_config(path)
    meant = config.get("target", {})
    if meant.get("weights_id") != weights_id(target.path):
        raise SpecmlxError(
            f"the head in {path} was trained for {meant.get('name', 'another model')}, "
            f"not {target.name} (its weights differ); train one for this target with "
            f"`specmlx head train {target.path} --data ... -o HEAD`"
        )
    module = new_head(target)
    try:
        module.load_weights(str(path / WEIGHTS), strict=True)
    except (OSError, ValueError) as e:
        raise SpecmlxError(
            f"cannot read the head's weights in {path} ({e}); train it again"
        ) from None
    ready(module, target)
    head = Head(module, *target_rows(target, config.get("vocab")), target, "specmlx", path)
    head.info["weights_s"] = time.perf_counter() - start
    return head
