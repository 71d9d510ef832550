"""τ with trees against chains at the same number of verified tokens, and each one's speed.

A chain of B drafts and a tree of B nodes (at most B deep, in the shape the call's
acceptance makes best, its nodes placed by the drafter's own probabilities at T = 0:
policy.FixedGamma) each make the target verify B + 1 tokens a round, so τ (tokens per target
pass) compares what the two shapes keep of the same verify width; decode tok/s says what
that is worth on this machine's cost curve (a tree's draft passes are wider, its verify the
same width). Then auto γ with trees allowed against auto with chains only: what the policy
makes of it. The issue's bar: τ with trees >= 1.3x τ with chains at the same budget, and
tok/s >= chains' where T(k) is flat; on an AVX2-only CPU auto keeps chains and loses nothing
(>= 0.97x).

Modes run interleaved per prompt (the order reversed every other repeat), fresh caches
each call, on the tune split's prompts (specmlx bench's suite):

    python -m bench trees [--target DIR --draft DIR] [--budgets 4,8] [-t 0,1]
    python -m bench trees --tiny qwen2 --prompts 2 -n 24   # a smoke run on a tiny pair
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

import specmlx
from bench.timing import cpu_name, median, orders, portable, write_atomic
from specmlx.bench import encode, read_suite, select_prompts
from specmlx.paths import home
from specmlx.tiny import build_tiny_model


def modes(budgets: list[int], drafters: list[str]) -> dict[str, dict]:
    """Every mode's generate() settings: each drafter's chain and tree at each budget (as
    deep as the chain may be), and auto γ with and without trees."""
    out = {}
    for mode in drafters:
        for b in budgets:
            out[f"{mode} chain {b}"] = dict(num_draft=b, tree="off", draft_mode=mode)
            out[f"{mode} tree {b}"] = dict(num_draft=b, tree=b, draft_mode=mode)
    out["auto chains"] = dict(num_draft="auto", tree="off")
    out["auto trees"] = dict(num_draft="auto", tree="auto")
    return out


def run(target, draft, prompts, settings, temperatures, repeat, max_tokens, sampling) -> dict:
    """{(mode, temperature): [per-call stats dicts]} over the prompts and repeats."""
    found: dict[tuple[str, float], list[dict]] = defaultdict(list)
    for prompt in prompts:
        ids = encode(target, prompt.text, chat_template=True)
        for t in temperatures:
            for _, order in orders(settings, repeat):
                for mode in order:
                    gen = specmlx.generate(
                        target,
                        ids,
                        draft,
                        max_tokens=max_tokens,
                        temperature=t,
                        sampling=sampling,
                        seed=0,
                        **settings[mode],
                    )
                    found[mode, t].append(gen.run().stats.to_dict())
    return found


def summary(found: dict) -> list[dict]:
    """Per mode and temperature: τ (all tokens over all passes), decode tok/s (the
    median over calls), and the share of rounds that drafted trees."""
    rows = []
    for (mode, t), calls in sorted(found.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        passes = sum(c["target_passes"] for c in calls)
        produced = sum(c["tokens"] + c["eos"] for c in calls)
        drafting = sum(sum(n for g, n in c["rounds_by_gamma"].items() if g) for c in calls)
        trees = sum(c["tree_rounds"] for c in calls)
        rows.append(
            {
                "mode": mode,
                "temperature": t,
                "tau": produced / passes if passes else 0.0,
                "decode_tps": median(c["decode_tps"] for c in calls),
                "tree_share": trees / drafting if drafting else 0.0,
                "calls": len(calls),
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    print("| T | mode | τ | τ / chain's | decode tok/s | tok/s / chain's | tree rounds |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    by = {(r["mode"], r["temperature"]): r for r in rows}
    for r in rows:
        chain = by.get(
            (r["mode"].replace(" tree", " chain").replace("trees", "chains"), r["temperature"])
        )
        tau = f"{r['tau'] / chain['tau']:.2f}x" if chain and chain is not r else ""
        tps = f"{r['decode_tps'] / chain['decode_tps']:.2f}x" if chain and chain is not r else ""
        print(
            f"| {r['temperature']:g} | {r['mode']} | {r['tau']:.2f} | {tau} | "
            f"{r['decode_tps']:.1f} | {tps} | {r['tree_share']:.0%} |"
        )


def main(argv: list[str] | None = None) -> None:
    models = home() / "models"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(models / "qwen2.5-coder-1.5b-instruct-int4"))
    ap.add_argument(
        "--draft",
        default=str(models / "qwen2.5-coder-0.5b-instruct-int4"),
        help="a draft model, or a head (then --drafters head,lookup)",
    )
    ap.add_argument("--tiny", help="instead, a tiny random pair of this mlx-lm architecture")
    ap.add_argument("--categories", default="humaneval,qa,writing,summarization")
    ap.add_argument("--prompts", type=int, default=4, help="per category")
    ap.add_argument("--budgets", default="4,8", help="verified drafts a round, comma-separated")
    ap.add_argument("--drafters", default="model,lookup", help="draft modes compared")
    ap.add_argument("-t", "--temperatures", default="0,1")
    ap.add_argument("--sampling", default="rejection", help="at T > 0: rejection or coupled")
    ap.add_argument("-n", "--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", help="write the rows and the per-call stats here")
    args = ap.parse_args(argv)
    if args.tiny:
        root = Path(tempfile.mkdtemp())
        target_dir = build_tiny_model(root / "target", arch=args.tiny, seed=0)
        draft_dir = build_tiny_model(
            root / "draft", arch=args.tiny, seed=1, perturb_from=target_dir, noise=0.05
        )
    else:
        target_dir, draft_dir = Path(args.target), Path(args.draft)
    target = specmlx.load(target_dir, lazy=False)
    from specmlx.cli.options import load_head

    # --draft may name a head (its drafter: --drafters head,lookup)
    draft = load_head(target, str(draft_dir), print) or specmlx.load(draft_dir, lazy=False)
    budgets = [int(b) for b in args.budgets.split(",")]
    settings = modes(budgets, args.drafters.split(","))
    temperatures = [float(t) for t in args.temperatures.split(",")]
    categories = args.categories.split(",")
    prompts = select_prompts(read_suite(), "tune", categories, args.prompts * len(categories))
    found = run(
        target, draft, prompts, settings, temperatures, args.repeat, args.max_tokens, args.sampling
    )
    rows = summary(found)
    print(
        f"{target_dir.name} / {draft_dir.name} on {cpu_name()}; {len(prompts)} prompts x "
        f"{args.repeat}, {args.max_tokens} tokens, sampling {args.sampling} at T > 0"
    )
    print_table(rows)
    if args.json:
        result = {
            "command": f"python -m bench trees {' '.join(argv or [])}".strip(),
            "machine": cpu_name(),
            "target": portable(target_dir),
            "draft": portable(draft_dir),
            "rows": rows,
            "calls": {f"{mode} @ T={t:g}": calls for (mode, t), calls in found.items()},
        }
        write_atomic(args.json, json.dumps(result, indent=1))
