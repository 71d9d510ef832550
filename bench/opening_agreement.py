"""Where in a reply does the draft agree with the target? Greedy, teacher-forced.

For each prompt of a bench result, take the target's own greedy reply (its token ids,
recorded in the JSON), run the draft once over prompt + reply and compare its argmax at
every reply position with the target's token. At temperature 0 that agreement is
exactly the acceptance a draft proposal would get there. The γ policy reads this to
leave a reply's first token to the target (schedule.Scheduler.opening).

    python bench/opening_agreement.py --draft DRAFT_DIR \
        bench/results/auto-vs-fixed-int4.json bench/results/fp32-humaneval-auto-vs-mlx-lm.json \
        --out bench/results/opening_agreement.md
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
import numpy as np

from specmlx.bench import encode, read_suite
from specmlx.loading import load


def agreement(draft, prompt_ids: list[int], reply: list[int]) -> list[int]:
    """1 where the draft's greedy token equals the reply's, at each reply position."""
    x = mx.array([prompt_ids + reply[:-1]], mx.uint32)
    logits = draft.module(x)[0, len(prompt_ids) - 1 :]
    guess = np.array(mx.argmax(logits, axis=-1))
    return (guess == np.array(reply)).astype(int).tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path, help="bench --json files (greedy runs)")
    ap.add_argument("--draft", required=True, help="the draft model the bench used")
    ap.add_argument("--out", type=Path, help="write the table here (markdown)")
    args = ap.parse_args()
    draft = load(args.draft)
    texts = {p.id: p.text for p in read_suite()}
    rows, seen = [], set()
    for path in args.results:
        for run in json.loads(path.read_text())["runs"]:
            pid = run["prompt_id"]
            if run["mode"] != "target" or run["temperature"] != 0 or pid in seen:
                continue
            seen.add(pid)
            ids = encode(draft, texts[pid], chat_template=True)
            rows.append((run["category"], pid, agreement(draft, ids, run["token_ids"])))
            print(run["category"], pid, "".join(map(str, rows[-1][2][:32])), flush=True)
    by_cat: dict[str, list[list[int]]] = defaultdict(list)
    for cat, _, agree in rows:
        by_cat[cat].append(agree)
    by_cat["all"] = [a for _, _, a in rows]
    lines = [
        "| category | prompts | position 0 | positions 1-3 | positions 4+ |",
        "| --- | --- | --- | --- | --- |",
    ]
    for cat, agrees in sorted(by_cat.items(), key=lambda kv: (kv[0] == "all", kv[0])):

        def share(part: list[int]) -> str:
            return f"{np.mean(part):.2f} ({sum(part)}/{len(part)})" if part else "–"

        first = [a[0] for a in agrees]
        early = [x for a in agrees for x in a[1:4]]
        rest = [x for a in agrees for x in a[4:]]
        lines.append(f"| {cat} | {len(agrees)} | {share(first)} | {share(early)} | {share(rest)} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        sources = " ".join(str(p) for p in args.results)
        args.out.write_text(
            f"# Draft/target greedy agreement by reply position\n\n"
            f"`python bench/opening_agreement.py --draft …/{Path(args.draft).name} {sources}`\n\n"
            f"Draft {draft.name}; replies: the target's greedy tokens recorded in those runs "
            f"(chat template on). Agreement = the draft's argmax equals the target's token, "
            f"teacher-forced: the acceptance a draft would get there at T = 0.\n\n{table}\n"
        )


if __name__ == "__main__":
    main()
