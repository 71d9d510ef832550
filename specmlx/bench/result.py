"""The result file `specmlx bench --json` writes: its schema tag, and reading one back to
render or plot it again."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import SpecmlxError

# Readers take the fields they need and ignore the rest, so results from before a field
# was added or dropped still read (older ones carry machine.code, the commit they ran at).
SCHEMA = "specmlx-bench/1"


def read_result(path: Path) -> dict:
    """A finished result written by `specmlx bench --json`, to render or plot again."""
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SpecmlxError(f"cannot read bench result {path}: {e}") from None
    if result.get("schema") != SCHEMA:
        raise SpecmlxError(f"{path} is not a {SCHEMA} result (schema {result.get('schema')!r})")
    if result.get("partial"):
        raise SpecmlxError(f"{path} holds a run that did not finish; only its raw runs are kept")
    return result
