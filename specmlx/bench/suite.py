"""The prompt suites: Spec-Bench and EAGLE's HumanEval, their tune/held-out split, and the
round-robin selection a run takes from them.

The suites ship inside the package (`prompts/`, read with importlib.resources), so an
installed specmlx benchmarks without a checkout.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from ..errors import SpecmlxError

MT_BENCH = (
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
)
# When a run takes fewer prompts than there are categories, categories are visited in
# this order, so a handful of prompts still spans code, prose, translation and QA.
SPREAD = (
    "humaneval",
    "writing",
    "translation",
    "qa",
    "coding",
    "summarization",
    "math",
    "reasoning",
    "extraction",
    "roleplay",
    "stem",
    "humanities",
    "math_reasoning",
    "rag",
)
HELDOUT = ("math_reasoning", "rag")  # plus humaneval ids 40-79
HUMANEVAL_TUNE_IDS = range(40)
SPLITS = ("tune", "heldout", "all")
SUITE_FILES = {"spec_bench": "spec_bench.jsonl", "humaneval": "humaneval.jsonl"}


@dataclass(frozen=True)
class Prompt:
    id: str  # "spec_bench/81", "humaneval/0"
    category: str
    text: str
    split: str  # "tune" | "heldout"


def prompt_split(category: str, number: int) -> str:
    if category in HELDOUT or (category == "humaneval" and number not in HUMANEVAL_TUNE_IDS):
        return "heldout"
    return "tune"


def read_suite(suite_dir: Path | None = None) -> list[Prompt]:
    """Every prompt of Spec-Bench and EAGLE's HumanEval, first turn only, from `suite_dir`
    or else the suites packaged with specmlx."""
    folder = suite_dir if suite_dir is not None else files(__package__) / "prompts"
    prompts = []
    for source, name in SUITE_FILES.items():
        path = folder / name
        if not path.is_file():
            raise SpecmlxError(f"prompt suite {path} not found; --suite-dir needs {name}")
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            # EAGLE's file says "code": named apart from MT-bench's "coding"
            category = "humaneval" if source == "humaneval" else row["category"]
            number = int(row["question_id"])
            prompts.append(
                Prompt(
                    f"{source}/{number}", category, row["turns"][0], prompt_split(category, number)
                )
            )
    return prompts


def select_prompts(
    prompts: list[Prompt],
    split: str = "tune",
    categories: Iterable[str] | None = None,
    limit: int | None = None,
    shortest: bool = False,
    skip: int = 0,
) -> list[Prompt]:
    """Filter by split and category, then take `limit` prompts round-robin over categories.

    Within a category prompts keep the suite's order, or go shortest first with
    `shortest` (cheap prefill: a quick run on a slow machine); `skip` leaves out the first
    prompts of each category (a long run split in parts: humaneval 0-19, then 20-39).
    """
    if split not in SPLITS:
        raise SpecmlxError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    known = sorted({p.category for p in prompts})
    wanted = None
    if categories:  # "mt-bench" stands for its eight categories
        wanted = [c for item in categories for c in (MT_BENCH if item == "mt-bench" else [item])]
    if wanted:
        unknown = [c for c in wanted if c not in known]
        if unknown:
            raise SpecmlxError(
                f"unknown categor{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)}; "
                f"choose from mt-bench, {', '.join(known)}"
            )
    by_category: dict[str, list[Prompt]] = defaultdict(list)
    for p in prompts:
        if (split == "all" or p.split == split) and (not wanted or p.category in wanted):
            by_category[p.category].append(p)
    if not by_category:
        raise SpecmlxError(
            f"no prompts in split {split!r} for categories {', '.join(wanted or known)}; "
            "math_reasoning and rag are held out (--split heldout or all)"
        )
    if shortest:
        for items in by_category.values():
            items.sort(key=lambda p: len(p.text))
    for items in by_category.values():
        del items[:skip]
    order = wanted or [c for c in SPREAD if c in by_category]
    queues = [by_category[c] for c in order if c in by_category]
    total = sum(len(q) for q in queues)
    limit = total if limit is None else min(limit, total)
    if limit < 1:
        raise SpecmlxError(f"--prompts must be >= 1, got {limit}")
    chosen: list[Prompt] = []
    depth = 0
    while len(chosen) < limit:
        for queue in queues:
            if depth < len(queue) and len(chosen) < limit:
                chosen.append(queue[depth])
        depth += 1
    return chosen
