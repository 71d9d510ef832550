"""Saved `specmlx bench --json` runs side by side: one mode's speedup over the target
alone on each run's prompts, as the median and geometric mean over prompts, and the
mean on each category named. For comparing runs of two builds of specmlx whose own
medians sit within the noise of each other (per-prompt ratios move ±0.1 run to run).

    python bench/compare_runs.py bench/results/categories-zen4-round30-kin-*.json \
        --category humaneval
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path
from types import SimpleNamespace

from specmlx.bench.result import read_result
from specmlx.bench.summary import pairwise_ratios


def prompt_speedups(path: Path, mode: str) -> dict[str, tuple[str, float]]:
    """{prompt_id: (category, the mode's speedup over the target alone)} of one run."""
    result = read_result(path)
    records = [SimpleNamespace(**r) for r in result["runs"]]  # as saved, rates included
    category = {r.prompt_id: r.category for r in records}
    ratios = pairwise_ratios(records)
    return {pid: (category[pid], x) for (m, _, pid), x in ratios.items() if m == mode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--mode", default="specmlx:auto")
    parser.add_argument("--category", action="append", default=[])
    args = parser.parse_args()
    columns = ["run", "prompts", "median", "geomean", *args.category]
    print(f"| {' | '.join(columns)} |")
    print("|---|" + "---:|" * (len(columns) - 1))
    for path in args.runs:
        speedups = prompt_speedups(path, args.mode)
        values = [x for _, x in speedups.values()]
        if not values:
            raise SystemExit(f"{path}: no {args.mode} runs paired with the target alone")
        geomean = math.exp(statistics.fmean(math.log(x) for x in values))
        cells = [f"{statistics.median(values):.2f}x", f"{geomean:.3f}x"]
        for name in args.category:
            mine = [x for c, x in speedups.values() if c == name]
            cells.append(f"{statistics.fmean(mine):.2f}x" if mine else "-")
        print(f"| {path.stem} | {len(values)} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
