"""A feature head against the target alone, the draft model, and head + prompt lookup.

Does drafting from the target's own features pay where a second model does not: on
prose, on long retrieval prompts (where the draft model must prefill the context), end
to end? Per category and temperature, every mode runs each prompt once, interleaved (the
order reversed every other prompt), a fresh Session per call as `specmlx bench` makes
them (so the draft model's prefill is counted). Modes: `alone` (the target, no drafts),
`draft` (the draft model, auto γ, with prompt lookup: generate's default), `head` (the
head alone, auto γ) and `head+lookup` (auto over the head and prompt lookup: generate's
default with a head). Also prints the costs that decide it: the target's T(k) at short
context and a draft pass of each drafter as a share of T(1).

    python -m bench heads --head HEAD --split heldout --prompts 8 --temperatures 0,1
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import specmlx
from bench.timing import cpu_name, median, orders, write_atomic
from specmlx.caches import make_cache, prefill, timed_pass
from specmlx.paths import home

PROMPTS = Path(__file__).parent.parent.parent / "shared" / "prompts"
# The shared prompts' README: tune on these, never on the held-out ones.
HELD_OUT = {"math_reasoning", "rag"}


def prompts(split: str, per_category: int) -> dict[str, list[str]]:
    """category -> first turns: the held-out split (HumanEval 40-79, math_reasoning,
    rag) or every Spec-Bench category."""
    out: dict[str, list[str]] = {}
    if split == "heldout":
        for line in (PROMPTS / "humaneval.jsonl").read_text().splitlines():
            q = json.loads(line)
            if int(q["question_id"]) >= 40:
                out.setdefault("humaneval 40-79", []).append(q["turns"][0])
    for line in (PROMPTS / "spec_bench.jsonl").read_text().splitlines():
        q = json.loads(line)
        if split == "all" or q["category"] in HELD_OUT:
            out.setdefault(q["category"], []).append(q["turns"][0])
    return {c: ps[:per_category] for c, ps in out.items()}


def cost_lines(target, draft, head) -> list[str]:
    """The target's T(k) over k = 1..6 new tokens after 512 cached, and each drafter's
    pass as a share of T(1): medians of 9."""
    cache = make_cache(target.module)
    prefill(target, cache, list(range(100, 612)))
    t = {k: median(timed_pass(target, cache, [7] * k) for _ in range(9)) for k in range(1, 7)}
    curve = " · ".join(f"T({k}) {t[k] / t[1]:.2f}" for k in t)
    lines = [f"target T(1) {t[1] * 1e3:.1f} ms; {curve} (of T(1)), at 512 cached tokens"]
    for name, source in (("draft model", draft), ("head", head)):
        session = specmlx.Session(target, source)
        mode = "head" if source is head else "model"
        specmlx.generate(target, list(range(100, 612)), session=session, draft_mode=mode,
                         num_draft=2, max_tokens=4).run()  # fmt: skip
        drafter = session.made[mode]
        share = median(drafter.time_pass() for _ in range(9)) / t[1]
        lines.append(f"{name}: a draft pass costs {share:.3f} of T(1)")
    return lines


def main(argv: list[str] | None = None) -> None:
    models = home() / "models"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(models / "qwen2.5-coder-1.5b-instruct-int4"))
    ap.add_argument("--draft", default=str(models / "qwen2.5-coder-0.5b-instruct-int4"))
    ap.add_argument("--head", required=True, help="a head directory, or mtp")
    ap.add_argument("--split", choices=("heldout", "all"), default="heldout")
    ap.add_argument("--prompts", type=int, default=8, help="per category")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", help="also write the table to this markdown file")
    args = ap.parse_args(argv)
    target = specmlx.load(args.target, lazy=False)
    draft = specmlx.load(args.draft, lazy=False, tokenizer_from=target)
    from specmlx.cli.options import load_head

    head = load_head(target, args.head, print)
    modes = {
        "alone": dict(num_draft=0),
        "draft": dict(draft=draft),
        "head": dict(draft=head, draft_mode="head"),
        "head+lookup": dict(draft=head),
    }
    for mode in modes.values():  # one-time work (first passes, kernels) off the clock
        specmlx.generate(target, "def f(x):", max_tokens=8, **mode).run()
    lines = [f"{cpu_name()} · {args.max_tokens} tokens · {args.prompts} prompts a category"]
    lines += cost_lines(target, draft, head)
    lines += [
        "",
        "| category | T | alone tok/s | draft | head | head+lookup | e2e: draft | head | "
        "head+lookup | head α by position | greedy same |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    print("\n".join(lines), flush=True)
    for category, texts in prompts(args.split, args.prompts).items():
        for temperature in (float(t) for t in args.temperatures.split(",")):
            runs: dict[str, list] = {name: [] for name in modes}
            for i, order in orders(list(modes), len(texts)):
                ids = target.tokenizer.apply_chat_template(
                    [{"role": "user", "content": texts[i]}], add_generation_prompt=True
                )
                for name in order:
                    run = dict(max_tokens=args.max_tokens, temperature=temperature, seed=i)
                    runs[name].append(specmlx.generate(target, ids, **modes[name], **run).run())
            lines.append(row(category, temperature, runs))
            print(lines[-1], flush=True)
    if args.out:
        write_atomic(args.out, "\n".join(lines) + "\n")


def row(category: str, temperature: float, runs: dict[str, list]) -> str:
    """One table row: decode tok/s of the target alone, each mode's median ratio to it per
    prompt (decode, then end to end with prefill), the head's α per draft position."""

    def ratios(name: str, end_to_end: bool) -> str:
        def speed(g) -> float:
            wall = g.stats.decode_time + (g.stats.prefill_time if end_to_end else 0.0)
            return g.stats.tokens / wall

        pairs = zip(runs[name], runs["alone"], strict=True)
        return f"{median(speed(g) / speed(a) for g, a in pairs):.2f}x"

    alone = median(g.stats.decode_tps for g in runs["alone"])
    drafted = [sum(pad(g.stats.drafted_by_position)[i] for g in runs["head"]) for i in range(8)]
    passed = [sum(pad(g.stats.accepted_by_position)[i] for g in runs["head"]) for i in range(8)]
    alpha = " ".join(f"{a / d:.2f}" for a, d in zip(passed, drafted, strict=True) if d)
    same = "–"
    if temperature == 0:
        plain = [g.tokens for g in runs["alone"]]
        same = all(
            [g.tokens for g in runs[name]] == plain for name in ("draft", "head", "head+lookup")
        )
        same = "yes" if same else "NO"
    decode = " | ".join(ratios(n, False) for n in ("draft", "head", "head+lookup"))
    e2e = " | ".join(ratios(n, True) for n in ("draft", "head", "head+lookup"))
    return f"| {category} | {temperature:g} | {alone:.1f} | {decode} | {e2e} | {alpha} | {same} |"


def pad(values: list[int], width: int = 8) -> list[int]:
    return (values + [0] * width)[:width]


if __name__ == "__main__":
    main()
