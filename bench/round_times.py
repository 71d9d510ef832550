"""How long auto's rounds take inside generate on real prompts, beside the target alone.

bench/cost_curve.py times passes outside the engine; the policy prices rounds from the
times the engine itself records (a round's verify_s, as Stats.add_round sees it). This
script reads those on the tune split's real prompts: each round's verify time, grouped
by what it was (plain, or a verify of a proposal from `source` with g drafts) and by
whether the round before it was plain, medians in ms. A plain round's time is what is
left of a pass already running (its Python work overlaps the pass), so the engine's own
T(k)/T(1) sits above cost_curve's. The target alone runs interleaved with auto (fresh caches
each call, as the bench does), so that auto's plain rounds and ms a token can be read
against it: whether a reply auto keeps mostly plain costs more.

    python -m bench round_times [--target DIR --draft DIR --prompts 6 --repeat 2]
    python -m bench round_times --ids spec_bench/113,spec_bench/151 --repeat 4
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import specmlx
from bench.timing import median, orders
from specmlx.bench import encode, read_suite, select_prompts
from specmlx.engine import Stats
from specmlx.paths import home

MODES = {"alone": 0, "auto": "auto"}


def main(argv: list[str] | None = None) -> None:
    models = home() / "models"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(models / "qwen2.5-coder-1.5b-instruct-int4"))
    ap.add_argument("--draft", default=str(models / "qwen2.5-coder-0.5b-instruct-int4"))
    ap.add_argument("--categories", default="writing,roleplay,qa,humanities")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--ids", default="", help="these prompts (any split) instead of --categories")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    target, draft = specmlx.load(args.target), specmlx.load(args.draft)
    rounds: list[tuple[str, float]] = []
    add_round = Stats.add_round

    def recording(self, r) -> None:
        rounds.append(("plain" if r.source == "plain" else f"{r.source} g={r.drafted}", r.verify_s))
        add_round(self, r)

    Stats.add_round = recording
    suite = read_suite()
    if args.ids:
        by_id, wanted = {p.id: p for p in suite}, args.ids.split(",")
        unknown = [i for i in wanted if i not in by_id]
        if unknown:
            ap.error(f"no prompt {unknown[0]!r} in the suite; ids look like spec_bench/113")
        prompts = [by_id[i] for i in wanted]
    else:
        prompts = select_prompts(suite, "tune", args.categories.split(","), args.prompts)
    times: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    ms_per_token: dict[tuple[str, str], list[float]] = defaultdict(list)
    for prompt in prompts:
        ids = encode(target, prompt.text, chat_template=True)
        for _, order in orders(("alone", "auto"), args.repeat):
            for mode in order:
                rounds.clear()
                gen = specmlx.generate(
                    target, ids, draft, max_tokens=args.max_tokens, num_draft=MODES[mode]
                ).run()
                stats = gen.stats
                ms_per_token[prompt.id, mode].append(stats.decode_time / stats.tokens * 1000)
                for (before, _), (kind, seconds) in zip(rounds, rounds[1:], strict=False):
                    after = "after plain" if before == "plain" else "after a proposal"
                    times[mode, kind, after].append(seconds * 1000)
    print(f"{len(prompts)} prompts x {args.repeat}, the target alone and auto interleaved")
    print("| prompt | alone ms/token | auto ms/token | auto speedup |")
    print("| --- | ---: | ---: | ---: |")
    for prompt in prompts:
        alone, auto = (median(ms_per_token[prompt.id, m]) for m in ("alone", "auto"))
        print(f"| {prompt.id} | {alone:.1f} | {auto:.1f} | {alone / auto:.3f} |")
    print("\n| mode | round | after | n | median ms |\n| --- | --- | --- | ---: | ---: |")
    for (mode, kind, after), ms in sorted(times.items()):
        print(f"| {mode} | {kind} | {after} | {len(ms)} | {median(ms):.1f} |")
