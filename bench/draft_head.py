"""A draft head over the most frequent N tokens (FR-Spec): coverage, greedy acceptance and
draft pass time for each N, and which ranking of the tokens keeps acceptance.

    python bench/draft_head.py [--sizes 8192,16384,32768,65536] [--max-tokens 48]
        [--e2e 65536] [--table specmlx/drafters/frequent_tokens.json]

The target's greedy continuations of tune prompts (HumanEval ids 0-39 and the first
prompts of six Spec-Bench tune categories; never the held-out ones) are made once and
kept in --outputs. The prompts of each category alternate between a fit half, the only
text a counted ranking is counted on, and a check half, on which every figure is read:

- coverage: the share of the target's tokens (its EOS too) inside the top N;
- greedy acceptance, teacher-forced: the share of those positions where the draft's argmax
  (over the full head, or over the top N only) is the target's token, the α of greedy
  speculation with that head;
- the draft step: one token through the draft with its cache (context of --context
  tokens), logits and draw (greedy, and T = 1 with q widened), through ModelDrafter
  itself, with the target's T(1) and T(5); all in turn in one process, --repeat rounds,
  medians; and from them a predicted speed per N at its best γ (predicted_speed);
- with --e2e N: specmlx.generate greedy with the full head and with N tokens, in turn, on
  --e2e-prompts check prompts: decode tok/s, acceptance, and that the tokens are the same.

Rankings: "id" (token id order: byte-level BPE ids follow merge order, roughly frequency),
"outputs" (counts in the target's fit-half outputs, then id order), "prompts" (counts in
the fit-half prompt texts, then id order). Special tokens are always in (drafters.subvocab).
--table writes the "outputs" counts as drafters.subvocab's table for the draft's tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path
from statistics import median

import mlx.core as mx
import numpy as np

import specmlx
from specmlx.bench.runners import encode
from specmlx.bench.suite import read_suite, select_prompts
from specmlx.caches import make_cache, prefill, trim
from specmlx.drafters import ModelDrafter
from specmlx.drafters.subvocab import ENV, always_in, sub_head, sub_vocab, tokenizer_key
from specmlx.sampling import SamplingParams
from specmlx.verify import make_sampler

MODELS = Path("~/.cache/specmlx/models").expanduser()
CATEGORIES = ("writing", "translation", "qa", "summarization", "coding", "reasoning")


def cpu_line() -> str:
    """The CPU's model name and the ISA flags the kernels care about, from lscpu."""
    text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    name = fields.get("Model name", platform.processor()).strip()
    flags = set(fields.get("Flags", "").split())
    wanted = ["avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"]
    return f"{name}; {' '.join(f for f in wanted if f in flags)}; {os.cpu_count()} CPUs"


def tune_prompts(per_category: int) -> list:
    """HumanEval ids 0-39 and the first `per_category` of each Spec-Bench category here."""
    suite = read_suite()
    chosen = select_prompts(suite, "tune", ["humaneval"])
    for category in CATEGORIES:
        chosen += select_prompts(suite, "tune", [category], limit=per_category)
    return chosen


def target_outputs(target, draft, prompts, max_tokens: int, path: Path) -> dict:
    """{prompt id: (prompt ids, the target's first max_tokens greedy tokens, EOS included)},
    made once: speculative greedy (exactly the target's own tokens) and kept in `path`.
    A kept run of more tokens is cut: greedy decoding's first tokens do not depend on how
    many follow."""
    kept = json.loads(path.read_text()) if path.exists() else {}
    if kept.get("target") != str(target.path):
        kept = {"target": str(target.path), "outputs": {}}
    outputs = kept["outputs"]
    for p in prompts:
        if p.id in outputs and outputs[p.id]["max_tokens"] >= max_tokens:
            continue
        ids = encode(target, p.text, chat_template=True)
        gen = specmlx.generate(target, ids, draft, max_tokens=max_tokens, num_draft=4).run()
        # the EOS a chat turn ends with (the engine stops at it and does not emit it)
        eos = [target.tokenizer.eos_token_id] if gen.stats.finish_reason == "eos" else []
        outputs[p.id] = {"prompt": ids, "tokens": gen.tokens + eos, "max_tokens": max_tokens}
        print(f"  {p.id}: {len(gen.tokens)} tokens, {gen.stats.decode_tps:.1f} tok/s", flush=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(kept))
        tmp.replace(path)
    return {p.id: (outputs[p.id]["prompt"], outputs[p.id]["tokens"][:max_tokens]) for p in prompts}


def halves(prompts) -> tuple[list, list]:
    """Alternate prompts of each category: (fit, check)."""
    seen: Counter = Counter()
    fit, check = [], []
    for p in prompts:
        (fit if seen[p.category] % 2 == 0 else check).append(p)
        seen[p.category] += 1
    return fit, check


def rankings(draft, fit, outputs) -> dict[str, np.ndarray]:
    """Every token id, most frequent first, by each ranking."""
    size = draft.vocab_size

    def counted(counts: Counter) -> np.ndarray:
        seen = sorted(counts, key=lambda t: (-counts[t], t))
        rest = np.setdiff1d(np.arange(size), seen, assume_unique=False)
        return np.concatenate([np.array(seen, np.int64), rest])

    from_outputs = Counter(t for p in fit for t in outputs[p.id][1])
    from_prompts = Counter(t for p in fit for t in outputs[p.id][0])
    return {
        "id": np.arange(size),
        "outputs": counted(from_outputs),
        "prompts": counted(from_prompts),
    }


def chosen_ids(draft, order: np.ndarray, n: int) -> np.ndarray:
    """The sub-vocabulary as drafters.subvocab builds it, from this ranking."""
    return np.asarray(sub_vocab(draft, n, mx.array(order, mx.uint32)))


def draft_logits(draft, ids: list[int], output: list[int]) -> np.ndarray:
    """The draft's full logits at each position that predicts an output token."""
    x = mx.array(ids + output[:-1], mx.uint32)[None]
    hidden = draft.module.model(x, cache=make_cache(draft.module))[0, len(ids) - 1 :]
    module = draft.module
    head = module.lm_head if "lm_head" in module else module.model.embed_tokens.as_linear
    return np.array(head(hidden)[:, : draft.vocab_size])


def acceptance(draft, check, outputs, sets: dict) -> tuple[dict, dict, float, int]:
    """(coverage, teacher-forced greedy acceptance) per set, the full head's acceptance, and
    how many positions they were counted over."""
    hits = dict.fromkeys(sets, 0)
    inside = dict.fromkeys(sets, 0)
    full = total = 0
    for p in check:
        ids, output = outputs[p.id]
        logits = draft_logits(draft, ids, output)
        truth = np.array(output)
        full += int((logits.argmax(-1) == truth).sum())
        total += truth.size
        for name, sub in sets.items():
            inside[name] += int(np.isin(truth, sub).sum())
            hits[name] += int((sub[logits[:, sub].argmax(-1)] == truth).sum())
    coverage = {name: inside[name] / total for name in sets}
    return coverage, {name: hits[name] / total for name in sets}, full / total, total


def pass_times(target, draft, context: list[int], sets: dict, repeat: int) -> dict:
    """Median milliseconds of one draft step through ModelDrafter with each head, greedy
    (argmax) and at T = 1 (softmax, a draw, and q widened to the full vocabulary), and of
    the target's passes over 1 and 5 tokens (T(1), T(5)), all in turn each round."""
    drafters = {"full": ModelDrafter(draft)}
    for name, sub in sets.items():
        ids = mx.array(sub, mx.uint32)
        drafters[name] = ModelDrafter(draft, sub_head(draft, ids, draft.vocab_size))
    for d in drafters.values():
        prefill(draft, d.cache, context[:-1])
    draws = {t: make_sampler(SamplingParams(temperature=t), draft.vocab_size) for t in (0.0, 1.0)}
    target_cache = make_cache(target.module)
    prefill(target, target_cache, context[:-1])
    token = mx.array(context[-1:], mx.uint32)
    key = mx.random.key(0)
    times: dict[str, list[float]] = {f"{n} T={t:g}": [] for n in drafters for t in draws}
    times.update({"target T(1)": [], "target T(5)": []})
    for rep in range(repeat + 1):
        for k in (1, 5):
            start = time.perf_counter()
            mx.eval(target.module(mx.array(context[-k:], mx.uint32)[None], cache=target_cache))
            seconds = time.perf_counter() - start
            trim(target_cache, k)
            if rep:
                times[f"target T({k})"].append(seconds * 1000)
        for name, d in drafters.items():
            for t, draw in draws.items():
                start = time.perf_counter()
                _, probs, x = d.step(token, key, draw)
                if probs is not None and d.head is not None:
                    probs = d.head.widen(probs)
                mx.eval(x, *([] if probs is None else [probs]))
                seconds = time.perf_counter() - start
                trim(d.cache, 1)
                if rep:  # the first round pays one-time work (weights read, rows cut)
                    times[f"{name} T={t:g}"].append(seconds * 1000)
    return {name: median(t) for name, t in times.items()}


def predicted_speed(alpha: float, draft_ms: float, t1: float, t5: float) -> tuple[float, int]:
    """(tokens per second, γ) of greedy speculation at its best fixed γ in 1..8, by the
    standard model: a round of γ drafts and one target pass over γ + 1 tokens (T(k) drawn
    through T(1) and T(5)) yields (1 - α^(γ+1)) / (1 - α) tokens, α per position."""

    def speed(g: int) -> float:
        tokens = (1 - alpha ** (g + 1)) / (1 - alpha) if alpha < 1 else g + 1
        return tokens / ((g * draft_ms + t1 + (t5 - t1) * g / 4) / 1000)

    best = max(range(1, 9), key=speed)
    return speed(best), best


def end_to_end(target, draft, check, outputs, size: int, max_tokens: int, gamma: int) -> dict:
    """specmlx.generate, greedy at γ, with the full head and with `size` tokens, in turn
    per prompt (the order alternating), over the check prompts: decode tok/s ratios per
    prompt, acceptance over all, and whether every output was the same."""
    sessions = {}
    for mode in ("full", str(size)):
        os.environ[ENV] = mode  # read where the Session builds its drafter
        sessions[mode] = specmlx.Session(target, draft)
        warm = outputs[check[0].id][0]
        specmlx.generate(
            target, warm, draft, max_tokens=8, num_draft=gamma, session=sessions[mode]
        ).run()
    ratios, same = [], True
    drafted = dict.fromkeys(sessions, 0)
    accepted = dict.fromkeys(sessions, 0)
    for i, p in enumerate(check):
        runs = {}
        for mode in list(sessions)[:: 1 if i % 2 == 0 else -1]:
            gen = specmlx.generate(
                target,
                outputs[p.id][0],
                draft,
                max_tokens=max_tokens,
                num_draft=gamma,
                session=sessions[mode],
            ).run()
            runs[mode] = gen
            drafted[mode] += gen.stats.drafted
            accepted[mode] += gen.stats.accepted
        same = same and runs["full"].tokens == runs[str(size)].tokens
        ratios.append(runs[str(size)].stats.decode_tps / runs["full"].stats.decode_tps)
    return {
        "size": size,
        "gamma": gamma,
        "prompts": len(check),
        "decode_tps_ratio_median": median(ratios),
        "decode_tps_ratios": ratios,
        "acceptance": {mode: accepted[mode] / drafted[mode] for mode in sessions},
        "same_tokens": same,
    }


def write_table(draft, counts: Counter, source: str, path: Path) -> None:
    """The counted ranking into drafters.subvocab's TABLE format, merged, temp + rename."""
    table = json.loads(path.read_text()) if path.exists() else {}
    ids = sorted(counts, key=lambda t: (-counts[t], t))
    table[tokenizer_key(draft.path / "tokenizer.json")] = {"source": source, "ids": ids}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, separators=(",", ":")) + "\n")
    tmp.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=str(MODELS / "qwen2.5-coder-1.5b-instruct-int4"))
    parser.add_argument("--draft", default=str(MODELS / "qwen2.5-coder-0.5b-instruct-int4"))
    parser.add_argument("--sizes", default="8192,16384,32768,65536")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=31)
    parser.add_argument(
        "--outputs", type=Path, default=Path(tempfile.gettempdir()) / "draft_head_outputs.json"
    )
    parser.add_argument("--json", type=Path, default=Path("bench/results/draft_head.json"))
    parser.add_argument(
        "--heldout", type=int, default=0, help="also read coverage and acceptance on K held-out"
    )
    parser.add_argument("--e2e", type=int, default=0, help="also generate with this size")
    parser.add_argument("--e2e-gamma", type=int, default=4)
    parser.add_argument("--e2e-prompts", type=int, default=8, help="check prompts, evenly spaced")
    parser.add_argument(
        "--table", type=Path, help="write the fit half's counted ranking to this TABLE file"
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    target = specmlx.load(args.target, lazy=False)
    draft = specmlx.load(args.draft, lazy=False, tokenizer_from=target)
    prompts = tune_prompts(args.per_category)
    print(f"target greedy outputs of {len(prompts)} tune prompts -> {args.outputs}", flush=True)
    outputs = target_outputs(target, draft, prompts, args.max_tokens, args.outputs)
    fit, check = halves(prompts)
    orders = rankings(draft, fit, outputs)
    sets = {(name, n): chosen_ids(draft, order, n) for name, order in orders.items() for n in sizes}
    coverage, accepted, full, positions = acceptance(draft, check, outputs, sets)
    context = [t for p in check for t in outputs[p.id][0] + outputs[p.id][1]][: args.context]
    timed = {f"id:{n}": sets["id", n] for n in sizes}
    seconds = pass_times(target, draft, context, timed, args.repeat)
    t1, t5 = seconds["target T(1)"], seconds["target T(5)"]
    full_speed, full_gamma = predicted_speed(full, seconds["full T=0"], t1, t5)
    if args.table:
        counts = Counter(t for p in fit for t in outputs[p.id][1])
        source = f"{target.path.name} greedy, {args.max_tokens} tokens, {len(fit)} tune prompts"
        write_table(draft, counts, source, args.table)

    heldout = None
    if args.heldout:  # a check only: nothing above was chosen on these
        others = select_prompts(read_suite(), "heldout", limit=args.heldout)
        print(f"target greedy outputs of {len(others)} held-out prompts", flush=True)
        kept = target_outputs(target, draft, others, args.max_tokens, args.outputs)
        h_coverage, h_accepted, h_full, h_positions = acceptance(draft, others, kept, sets)
        heldout = {
            "prompts": [p.id for p in others],
            "positions": h_positions,
            "full_acceptance": h_full,
            "rows": [
                {"ranking": name, "n": n, "coverage": h_coverage[name, n], "acceptance": a}
                for (name, n), a in h_accepted.items()
            ],
        }
        print(f"held out: full head acceptance {h_full:.3f} over {h_positions} positions")
        for r in heldout["rows"]:
            print(f"| {r['ranking']} | {r['n']} | {r['coverage']:.4f} | {r['acceptance']:.3f} |")
    e2e = None
    if args.e2e:
        spaced = check[:: max(1, len(check) // args.e2e_prompts)][: args.e2e_prompts]
        e2e = end_to_end(target, draft, spaced, outputs, args.e2e, args.max_tokens, args.e2e_gamma)
        print("end to end:", {k: v for k, v in e2e.items() if k != "decode_tps_ratios"})
    rows = []
    for name, n in sets:
        alpha = accepted[name, n]
        speed, gamma = predicted_speed(alpha, seconds[f"id:{n} T=0"], t1, t5)
        rows.append(
            {
                "ranking": name,
                "n": n,
                "coverage": coverage[name, n],
                "acceptance": alpha,
                "acceptance_vs_full": alpha / full,
                "predicted_vs_full": speed / full_speed,
                "predicted_gamma": gamma,
            }
        )
    result = {
        "command": "python bench/draft_head.py "
        + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("json",)
        ),
        "cpu": cpu_line(),
        "load_average": os.getloadavg(),
        "target": str(target.path),
        "draft": str(draft.path),
        "fit_prompts": [p.id for p in fit],
        "check_prompts": [p.id for p in check],
        "check_positions": positions,
        "full_acceptance": full,
        "full_predicted_gamma": full_gamma,
        "rows": rows,
        "pass_ms": seconds,
        "always_in": len(always_in(draft)),
        "end_to_end": e2e,
        "heldout": heldout,
    }
    tmp = args.json.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(args.json)
    print(f"full head: acceptance {full:.3f} over {positions} check positions")
    print("| ranking | N | coverage | acceptance | vs full | predicted speed vs full (γ) |")
    for r in rows:
        print(
            f"| {r['ranking']} | {r['n']} | {r['coverage']:.4f} | {r['acceptance']:.3f} "
            f"| {r['acceptance_vs_full']:.3f} | {r['predicted_vs_full']:.3f} "
            f"({r['predicted_gamma']}) |"
        )
    print("ms (median):", {k: round(v, 2) for k, v in result["pass_ms"].items()})
    print(f"full head: predicted best γ {full_gamma}")


if __name__ == "__main__":
    main()
