"""Where specmlx keeps what it writes: converted models, measured costs, configs.

No imports of the package's own, so that every module may ask.
"""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """specmlx's cache of converted models: $SPECMLX_HOME, else ~/.cache/specmlx."""
    return Path(os.environ.get("SPECMLX_HOME") or Path.home() / ".cache" / "specmlx")
