"""The engine's shape as the design promises it, checked on the source (nothing imported):
one round on one screen, no drafter told apart by its class or its name outside
specmlx/drafters/, and source comments that cite results, not one machine's rounds."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "specmlx"
DRAFTER_CLASSES = {"ModelDrafter", "LookupDrafter", "CostProbe", "HeadDrafter"}
DRAFTER_NAMES = {"model", "lookup", "probe", "head", "auto"}


def sources(*suffixes: str) -> list[Path]:
    return [p for p in PACKAGE.rglob("*") if p.suffix in suffixes and p.is_file()]


def outside_drafters() -> list[Path]:
    return [p for p in sources(".py") if "drafters" not in p.relative_to(PACKAGE).parts]


def test_the_decode_loop_fits_on_one_screen():
    engine = ast.parse((PACKAGE / "engine.py").read_text())
    decode = next(n for n in engine.body if getattr(n, "name", "") == "_decode")
    assert decode.end_lineno - decode.lineno + 1 <= 60


def test_nothing_outside_drafters_tests_a_drafters_class():
    found = []
    for path in outside_drafters():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance":
                named = {getattr(n, "id", getattr(n, "attr", "")) for n in ast.walk(node.args[1])}
                if named & DRAFTER_CLASSES:
                    found.append(f"{path.name}:{node.lineno}")
    assert found == []


def test_nothing_outside_drafters_compares_a_draft_mode_string():
    found = []
    for path in outside_drafters():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            names = {getattr(n, "attr", getattr(n, "id", "")) for n in ast.walk(node)}
            strings = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant)}
            if names & {"draft_mode", "mode"} and strings & DRAFTER_NAMES:
                found.append(f"{path.name}:{node.lineno}")
    assert found == []


def test_sources_cite_no_round_of_one_machines_history():
    pattern = re.compile(r"\bround \d+", re.IGNORECASE)
    found = [
        f"{p.relative_to(PACKAGE)}:{i}"
        for p in sources(".py", ".cpp", ".h", ".md")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []
