"""Does the target's own confidence forecast whether a draft would pass? Teacher-forced.

For each prompt of a bench result, take the target's reply (its token ids, recorded in
the JSON: greedy at T = 0, sampled at T = 1) and run both models once over prompt +
reply. At every reply position compare the target's top probability (what a plain
decoding step shows for free) with whether the draft's argmax equals the target's token
(the acceptance a draft would get there at T = 0) and with Σ min(p, q) (its acceptance
when sampling at T = 1). The γ policy reads the top probability as a forecast of α
(schedule.Acceptance).

    python bench/confidence_agreement.py --target TARGET_DIR --draft DRAFT_DIR \
        bench/results/auto-vs-fixed-int4.json bench/results/lookup-summarization.json \
        --out bench/results/confidence_agreement.md [--traces TRACES.json]

`--traces` keeps every position (top, agreement, overlap, the draft's top) for
`schedule_sim.py --traces`, which replays the γ policy on these real replies.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from specmlx.bench import encode, read_suite
from specmlx.loading import load

BINS = (0.0, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
POSITIONS = ("top", "agree", "overlap", "draft_top")


def positions(target, draft, prompt_ids: list[int], reply: list[int]) -> dict[str, np.ndarray]:
    """Per reply position: the target's top probability, greedy agreement, Σ min(p, q),
    and the draft's own top probability (what a drafting round shows before the verify)."""
    x = mx.array([prompt_ids + reply[:-1]], mx.uint32)
    vocab = min(target.vocab_size, draft.vocab_size)
    start = len(prompt_ids) - 1
    p = mx.softmax(target.module(x)[0, start:, :vocab].astype(mx.float32), axis=-1)
    q = mx.softmax(draft.module(x)[0, start:, :vocab].astype(mx.float32), axis=-1)
    return {
        "top": np.array(mx.max(p, axis=-1)),
        "agree": np.array(mx.argmax(q, axis=-1)) == np.array(reply),
        "overlap": np.array(mx.sum(mx.minimum(p, q), axis=-1)),
        "draft_top": np.array(mx.max(q, axis=-1)),
    }


def calibration_table(at: dict[str, np.ndarray], key: str, title: str) -> str:
    """Agreement and overlap per band of one confidence (`key`), as a markdown table."""
    conf, agree, overlap = at[key], at["agree"], at["overlap"]
    lines = [
        f"| {title} | positions | mean | greedy agreement | Σ min(p, q) at T = 1 |",
        "| --- | --- | --- | --- | --- |",
    ]
    for lo, hi in zip(BINS[:-1], BINS[1:], strict=True):
        m = (conf >= lo) & ((conf < hi) if hi < 1 else (conf <= hi))
        if m.any():
            lines.append(
                f"| {lo:.2f}–{hi:.2f} | {m.sum()} | {conf[m].mean():.3f} | "
                f"{agree[m].mean():.3f} | {overlap[m].mean():.3f} |"
            )
    lines.append(
        f"| all | {len(conf)} | {conf.mean():.3f} | {agree.mean():.3f} | {overlap.mean():.3f} |"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path, help="bench --json files (T = 0 or 1)")
    ap.add_argument("--target", required=True, help="the target model the bench used")
    ap.add_argument("--draft", required=True, help="the draft model the bench used")
    ap.add_argument("--out", type=Path, help="write the tables here (markdown)")
    ap.add_argument(
        "--traces", type=Path, help="write each reply's positions here (JSON), for schedule_sim"
    )
    args = ap.parse_args()
    target = load(args.target)
    draft = load(args.draft, tokenizer_from=target)
    texts = {p.id: p.text for p in read_suite()}
    rows, seen, limits = [], set(), {}
    for path in args.results:
        result = json.loads(path.read_text())
        for run in result["runs"]:
            pid, temperature = run["prompt_id"], run["temperature"]
            reply = (pid, temperature, tuple(run["token_ids"]))  # repeats sample other texts
            if run["mode"] != "target" or temperature not in (0, 1) or reply in seen:
                continue
            seen.add(reply)
            limits[pid, temperature] = result["settings"]["max_tokens"]
            ids = encode(target, texts[pid], chat_template=True)
            # The reply's first token follows the chat template's header: not its text's
            # (bench/results/opening_agreement.md); the policy leaves it out too.
            at = {k: v[1:] for k, v in positions(target, draft, ids, run["token_ids"]).items()}
            rows.append((run["category"], pid, temperature, at))
            print(pid, f"T={temperature} top {at['top'].mean():.2f}", flush=True)
    tables = []
    for temperature in sorted({r[2] for r in rows}):
        of_t = [r[3] for r in rows if r[2] == temperature]
        at = {k: np.concatenate([a[k] for a in of_t]) for k in POSITIONS}
        replies = "greedy replies" if temperature == 0 else "replies sampled at T = 1"
        for whose in ("top", "draft_top"):  # the target's confidence, then the draft's
            tables.append(calibration_table(at, whose, f"{whose.replace('_', ' ')} ({replies})"))
    replies = [
        "| reply | T | category | positions | mean top | greedy agreement | Σ min(p, q) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for cat, pid, temperature, at in rows:
        replies.append(
            f"| {pid} | {temperature:g} | {cat} | {len(at['top'])} | {at['top'].mean():.2f} | "
            f"{at['agree'].mean():.2f} | {at['overlap'].mean():.2f} |"
        )
    tables = "\n\n".join(tables + ["\n".join(replies)])
    if args.traces:
        traces = [
            {"prompt_id": pid, "category": cat, "temperature": temperature}
            | {"max_tokens": limits[pid, temperature]}
            | {k: at[k].astype(float).round(4).tolist() for k in POSITIONS}
            for cat, pid, temperature, at in rows
        ]
        args.traces.write_text(json.dumps(traces))
    print(tables)
    if args.out:
        sources = " ".join(str(p) for p in args.results)
        args.out.write_text(
            f"# The target's confidence as a forecast of draft acceptance\n\n"
            f"`python bench/confidence_agreement.py --target …/{Path(args.target).name} "
            f"--draft …/{Path(args.draft).name} {sources}`\n\n"
            f"Replies: the target's tokens recorded in those runs (chat template on), "
            f"each reply's first token left out. Top = the target's highest probability "
            f"at a position (softmax at T = 1); agreement = the draft's argmax is the "
            f"target's token.\n\n{tables}\n"
        )


if __name__ == "__main__":
    main()
