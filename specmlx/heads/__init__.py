"""Heads: drafters that read the target's own features instead of running a second model.

A head is one decoder layer over the target's hidden states (feature.py), read from:
specmlx's own head directory (store.py: `specmlx head train` writes one), an EAGLE-3
checkpoint as EAGLE / SpecForge publish them, or the MTP layers a checkpoint ships
inside the target itself. `what_is(path)` tells which a path holds, from its files alone
(no MLX import), so `--draft PATH` can say what it found before loading anything.
"""

from __future__ import annotations

import json
from pathlib import Path

HEAD_FORMAT = "specmlx-head"  # config.json's "format" in specmlx's own head directory


MTP = "mtp"  # --draft mtp: the MTP layers the target's own checkpoint ships


def is_head(draft: object) -> bool:
    """Whether a loaded draft is a head (heads.head.Head) rather than a draft model."""
    return bool(getattr(draft, "is_head", False))


def what_is(path: Path) -> str:
    """ "head" (specmlx's own), "eagle3" (an EAGLE-3 checkpoint) or "model" (anything
    else: loaded as a draft model, which says what is wrong with it)."""
    config = path / "config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return "model"
    if not isinstance(data, dict):
        return "model"
    if data.get("format") == HEAD_FORMAT:
        return "head"
    architectures = " ".join(data.get("architectures") or [])
    if "Eagle3" in architectures or "draft_vocab_size" in data:
        return "eagle3"
    return "model"
