"""specmlx's benchmark suite: `python -m bench NAME [args]` runs bench/NAME.py's main(argv).

`python -m bench` lists every benchmark with the question it answers (its docstring's first
line); bench/README.md says what each measures and how to read it, and bench/results/
holds what they found (README.md: where things stand now; ARCHIVE.md: the history, and the
experiments that answered their question and left this directory).

`specmlx bench` (specmlx/bench/, the CLI) is the benchmark every speed claim rests on;
these answer the questions around it. Each module here is a benchmark but the ones in
HELPERS, which the benchmarks share.
"""

from __future__ import annotations

import ast
from pathlib import Path

HERE = Path(__file__).parent
HELPERS = ("timing",)  # shared by the benchmarks, not one of them


def names() -> list[str]:
    """Every benchmark's module name, sorted."""
    return sorted(
        p.stem for p in HERE.glob("*.py") if not p.stem.startswith("_") and p.stem not in HELPERS
    )


def purpose(name: str) -> str:
    """A benchmark's one-line purpose: its docstring's first line, read without importing
    it (so that listing needs neither mlx nor a benchmark's own dependencies)."""
    doc = ast.get_docstring(ast.parse((HERE / f"{name}.py").read_text())) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""
