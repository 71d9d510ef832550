"""Would a draft that reads only part of a long prompt still agree with the target?

A draft model pays for a call's prompt before its first draft (its prefill is ~0.37 of
the target's per token on a 2-core CPU), so a long prompt with a short reply is cheaper
decoded plain. A draft fed only the prompt's first `sink` and last `window` tokens would
stay exact (any q is), and cheap; this measures what it would cost in agreement: the
target's greedy reply (up to 48 tokens) to each long tune-split prompt, teacher-forced
through the draft after the whole prompt and after each window, the share of reply
tokens where the draft's argmax is the target's (what a γ = 1 round accepts at T = 0),
and the draft's prefill seconds for each.

    python bench/draft_window.py [--target DIR --draft DIR] [--min-tokens 250 --prompts 10]
"""

from __future__ import annotations

import argparse
import time
from statistics import mean

import mlx.core as mx

from specmlx.bench import encode
from specmlx.bench.suite import read_suite, select_prompts
from specmlx.caches import make_cache, prefill
from specmlx.engine import generate
from specmlx.loading import load
from specmlx.paths import home

CATEGORIES = ["summarization", "extraction", "humaneval", "writing"]  # tune split only
WINDOWS = [(0, None), (32, 64), (32, 128), (32, 256), (0, 128)]  # (sink, window); None: all


def seen_by_draft(ids: list[int], sink: int, window: int | None) -> list[int]:
    if window is None or len(ids) <= sink + window + 1:
        return ids
    return ids[:sink] + ids[-(window + 1) :]


def main() -> None:
    models = home() / "models"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(models / "qwen2.5-coder-1.5b-instruct-int4"))
    ap.add_argument("--draft", default=str(models / "qwen2.5-coder-0.5b-instruct-int4"))
    ap.add_argument("--min-tokens", type=int, default=250, help="shortest prompt taken")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--reply", type=int, default=48, help="most reply tokens compared")
    args = ap.parse_args()
    target, draft = load(args.target), load(args.draft)
    chosen = []
    for p in select_prompts(read_suite(), "tune", categories=CATEGORIES, limit=400):
        ids = encode(target, p.text, chat_template=True)
        if len(ids) >= args.min_tokens:
            chosen.append((p, ids))
    chosen = chosen[: args.prompts]
    agree = {w: [] for w in WINDOWS}
    seconds = {w: [] for w in WINDOWS}
    for p, ids in chosen:
        reply = generate(target, ids, max_tokens=args.reply, temperature=0).run().tokens
        line = f"{p.id:22s} {len(ids):5d} tokens"
        for sink, window in WINDOWS:
            view = seen_by_draft(ids, sink, window)
            cache = make_cache(draft.module)
            start = time.perf_counter()
            prefill(draft, cache, view[:-1])
            took = time.perf_counter() - start
            x = mx.array([[view[-1], *reply[:-1]]], mx.uint32)
            guesses = draft.module(x, cache=cache)[0].argmax(-1).tolist()
            share = sum(g == t for g, t in zip(guesses, reply, strict=True)) / len(reply)
            agree[(sink, window)].append(share)
            seconds[(sink, window)].append(took)
            line += f" | {sink}+{window or 'all'}: {share:.2f} {took:.2f} s"
        print(line, flush=True)
    print("sink+window: agreement (mean over prompts), draft prefill (total)")
    for sink, window in WINDOWS:
        w = (sink, window)
        print(f"  {sink}+{window or 'all'}: {mean(agree[w]):.3f}, {sum(seconds[w]):.1f} s")


if __name__ == "__main__":
    main()
