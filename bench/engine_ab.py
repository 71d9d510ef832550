"""Two versions of the engine side by side: each one's auto against the target alone.

The working tree's specmlx/engine.py and the one of another commit (`--old`, loaded from
git as a module of its own beside the rest of today's package) decode the same prompts
with auto γ, the target alone (today's engine, γ = 0) as the baseline, the three runs of
each prompt in a rotating order so that load from other processes hits them alike. Each
version keeps its own Session per call, as `specmlx bench` does; both read and teach the
one persisted cost curve of the pair. Per category: the median over prompts and repeats
of each version's decode tok/s over the target alone's in the same block, and the
median of new / old. Greedy runs must give the target's tokens in both versions.

    python -m bench engine_ab --old HEAD~1 --temperature 1 \\
        --categories qa,writing,translation,summarization --prompts 16 --repeat 2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import specmlx
from bench.timing import median, orders, steal_during
from specmlx import engine
from specmlx.bench.runners import encode
from specmlx.bench.suite import read_suite, select_prompts
from specmlx.paths import home

ROOT = Path(__file__).resolve().parent.parent


def old_engine(commit: str):
    """specmlx/engine.py as of `commit`, imported as specmlx._engine_old."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{commit}:specmlx/engine.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(specmlx.__file__).parent / "_engine_old.py"
    path.write_text(source)
    try:
        spec = importlib.util.spec_from_file_location("specmlx._engine_old", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    finally:
        path.unlink()
    return module


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    models = home() / "models"
    ap.add_argument("--model", default=str(models / "qwen2.5-coder-1.5b-instruct-int4"))
    ap.add_argument("--draft", default=str(models / "qwen2.5-coder-0.5b-instruct-int4"))
    ap.add_argument("--old", required=True, help="the commit whose engine.py is compared")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--categories", default="qa,writing,translation,summarization")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", help="write every run here")
    args = ap.parse_args(argv)

    old = old_engine(args.old)
    target, draft = specmlx.load(args.model), specmlx.load(args.draft)
    prompts = select_prompts(
        read_suite(), "tune", args.categories.split(","), args.prompts, shortest=True
    )
    versions = {
        "target": lambda ids, seed: engine.generate(
            target,
            ids,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=seed,
            num_draft=0,
        ),
        "new": lambda ids, seed: engine.generate(
            target,
            ids,
            draft,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=seed,
        ),
        "old": lambda ids, seed: old.generate(
            target,
            ids,
            draft,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=seed,
        ),
    }
    names = list(versions)
    warm = encode(target, prompts[0].text, True)
    for name in names:  # one-time work (kernels, the cost curve) out of the timed runs
        versions[name](warm, 0).run()
    runs = []
    blocks = [(p, r) for r in range(args.repeat) for p in prompts]
    for (p, r), (_, order) in zip(blocks, orders(names, len(blocks), "rotate"), strict=True):
        ids = encode(target, p.text, True)
        row = {"prompt": p.id, "category": p.category, "repeat": r}

        def block(row=row, ids=ids, order=order, r=r) -> None:
            for name in order:
                gen = versions[name](ids, r).run()
                row[name] = gen.stats.decode_tps
                row[name + "_tokens"] = gen.tokens
                row[name + "_rounds"] = gen.stats.rounds_by_gamma

        _, row["steal"] = steal_during(block)
        if args.temperature == 0:
            assert row["new_tokens"] == row["target_tokens"] == row["old_tokens"], p.id
        runs.append(row)
        print(
            f"{p.id:16} {p.category:14} target {row['target']:5.1f}  new x"
            f"{row['new'] / row['target']:.3f}  old x{row['old'] / row['target']:.3f}  "
            f"steal {row['steal'] or 0:.2f}",
            flush=True,
        )
    from specmlx.cpu import describe

    print(f"\n{args.model} + {args.draft} · T = {args.temperature} · {describe()}")
    print("category        n   new/target  old/target  new/old   (medians)")
    for category in [*args.categories.split(","), "all"]:
        rows = [x for x in runs if category in ("all", x["category"])]
        if not rows:
            continue
        new, old_ = (median(x[k] / x["target"] for x in rows) for k in ("new", "old"))
        both = median(x["new"] / x["old"] for x in rows)
        print(f"{category:14} {len(rows):3}   {new:.3f}       {old_:.3f}       {both:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv, "runs": runs}, indent=1))
