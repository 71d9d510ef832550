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

`--self-draft 14,21` also asks whether a training-free self-draft pays: the target's first
L layers, its final norm and its own head (LayerSkip's early exit, without LayerSkip's
training), which would share those layers' cache entries and cost about L / N of a pass.
Measured without building it: how often the early exit's argmax equals the full model's
over a text read once (α at position 1), its pass cost, and the best speedup a chain of
such drafts could give (τ(γ) / (1 + γ c), T(γ + 1) taken as T(1), which flatters it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask

import specmlx
from bench.timing import cpu_name, median, orders, write_atomic
from specmlx.caches import make_cache, prefill, timed_pass
from specmlx.lm_head import head_layer
from specmlx.paths import home

PROMPTS = Path(__file__).parent.parent.parent / "shared" / "prompts"
TEXT = Path(__file__).parent.parent / "specmlx" / "engine.py"  # code the target reads
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


def early_exit_agreement(target, ids: list[int], layers: int) -> float:
    """The share of positions where the first `layers` layers' exit picks the token the
    whole model picks (both greedy)."""
    inner, (head, tied) = target.module.model, head_layer(target)
    x = mx.array(ids)[None]
    h = inner.embed_tokens(x)
    mask = create_attention_mask(h, None)
    exits = None
    for i, layer in enumerate(inner.layers):
        h = layer(h, mask, None)
        if i + 1 == layers:
            exits = inner.norm(h)
    full = inner.norm(h)

    def pick(hidden):
        return mx.argmax(head.as_linear(hidden) if tied else head(hidden), axis=-1)

    return mx.mean(pick(exits) == pick(full)).item()


def exit_cost(target, layers: int) -> float:
    """Seconds of a one-token pass through the first `layers` layers and the head, after
    512 cached tokens (median of 15)."""
    inner, (head, tied) = target.module.model, head_layer(target)
    cache = make_cache(target.module)
    prefill(target, cache, list(range(100, 612)))

    def one() -> float:
        import time

        start = time.perf_counter()
        h = inner.embed_tokens(mx.array([[7]]))
        for layer, c in zip(inner.layers[:layers], cache[:layers], strict=True):
            h = layer(h, None, c)
        out = inner.norm(h)
        mx.eval(head.as_linear(out) if tied else head(out))
        seconds = time.perf_counter() - start
        for c in cache[:layers]:
            c.trim(1)
        return seconds

    return median(one() for _ in range(15))


def best_speedup(alpha: float, ratio: float, longest: int = 8) -> tuple[float, int]:
    """max over γ of τ(γ) / (1 + γ c), τ(γ) = (1 - α^(γ+1)) / (1 - α): drafts assumed
    independent, the verify pass as cheap as one step."""
    rates = {
        g: ((1 - alpha ** (g + 1)) / (1 - alpha) if alpha < 1 else g + 1) / (1 + g * ratio)
        for g in range(1, longest + 1)
    }
    g = max(rates, key=rates.get)
    return rates[g], g


def self_draft_lines(target, layers: list[int], tokens: int) -> list[str]:
    """The early exit's table: α at draft position 1 over `tokens` tokens of engine.py
    (teacher forcing), its pass cost ÷ a full pass, the best speedup they allow."""
    ids = target.tokenizer.encode(TEXT.read_text())[:tokens]
    full = exit_cost(target, len(target.module.model.layers))
    lines = [
        f"self-draft (first L layers, norm, head) over {len(ids)} tokens of {TEXT.name}",
        "",
        "| layers | α (position 1) | pass ÷ full pass | best speedup (γ) |",
        "| --- | --- | --- | --- |",
    ]
    for n in layers:
        alpha = early_exit_agreement(target, ids, n)
        ratio = exit_cost(target, n) / full
        speedup, g = best_speedup(alpha, ratio)
        lines.append(f"| {n} | {alpha:.3f} | {ratio:.3f} | {speedup:.2f}x ({g}) |")
    return lines


def main(argv: list[str] | None = None) -> None:
    models = home() / "models"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(models / "qwen2.5-coder-1.5b-instruct-int4"))
    ap.add_argument("--draft", default=str(models / "qwen2.5-coder-0.5b-instruct-int4"))
    ap.add_argument("--head", help="a head directory, or mtp")
    ap.add_argument(
        "--self-draft",
        help="also (or, without --head, only) a training-free early exit after these "
        "numbers of layers, e.g. 14,21",
    )
    ap.add_argument("--self-draft-tokens", type=int, default=1024)
    ap.add_argument("--split", choices=("heldout", "all"), default="heldout")
    ap.add_argument("--prompts", type=int, default=8, help="per category")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", help="also write the table to this markdown file")
    args = ap.parse_args(argv)
    target = specmlx.load(args.target, lazy=False)
    lines = [f"{cpu_name()} · {target.name}"]
    if args.self_draft:
        layers = [int(n) for n in args.self_draft.split(",")]
        lines += self_draft_lines(target, layers, args.self_draft_tokens) + [""]
        print("\n".join(lines), flush=True)
    if not args.head:
        if args.out:
            write_atomic(args.out, "\n".join(lines) + "\n")
        return
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
    lines += [f"{args.max_tokens} tokens · {args.prompts} prompts a category"]
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
