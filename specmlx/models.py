"""Where models live when the user names none: specmlx's home and its default pair."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def home() -> Path:
    """specmlx's cache of converted models: $SPECMLX_HOME, else ~/.cache/specmlx."""
    return Path(os.environ.get("SPECMLX_HOME") or Path.home() / ".cache" / "specmlx")


def tiny_demo_pair(log=lambda msg: print(msg, file=sys.stderr)) -> tuple[Path, Path]:
    """A tiny random qwen2 target and a perturbed copy as its draft, built once.

    Their text is noise: they exist so the whole pipeline runs on a machine with no
    weights at all. Built into a temp dir and renamed, so a crash leaves nothing half-made.
    """
    from .tiny import build_tiny_model

    root = home() / "tiny-demo"
    target, draft = root / "target", root / "draft"
    if not (target / "config.json").exists() or not (draft / "config.json").exists():
        import shutil
        import tempfile

        log(f"building the tiny demo pair (random weights, ~1 MB) in {root}")
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tiny-demo-", dir=root.parent))
        try:
            build_tiny_model(tmp / "target", seed=0)
            build_tiny_model(tmp / "draft", seed=1, perturb_from=tmp / "target", noise=0.1)
            if root.exists():
                shutil.rmtree(root)
            tmp.rename(root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target, draft
