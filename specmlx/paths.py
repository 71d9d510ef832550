"""Where specmlx keeps what it writes: converted models, measured costs, configs.

No imports of the package's own, so that every module may ask.
"""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """specmlx's cache of converted models: $SPECMLX_HOME, else ~/.cache/specmlx."""
    return Path(os.environ.get("SPECMLX_HOME") or Path.home() / ".cache" / "specmlx")


def portable(path: str | Path) -> str:
    """`path` as results may record it: under $SPECMLX_HOME as `$SPECMLX_HOME/...`, under
    the working directory relative to it, under the user's home as `~/...`; a committed
    result then names the model and file, not one machine's directories."""
    text = str(path)
    for root, shown in ((home(), "$SPECMLX_HOME"), (Path.cwd(), "."), (Path.home(), "~")):
        prefix = str(root).rstrip("/") + "/"
        if text.startswith(prefix):
            rest = text[len(prefix) :]
            return rest if shown == "." else f"{shown}/{rest}"
    return text
