"""Auto against the target alone at long context: does speculation ever lose there?

A pass over k new tokens after L cached ones costs more than the same pass at short
context, by more as k grows where attention's share grows with L; a policy priced at
short context drafts where it cannot win. This builds long prompts from Python source
files that ship with mlx-lm (so every machine builds the same ones), at each --lengths
in tokens, with a task after the code: `summarize` (a reply in its own words: drafts
seldom pass), `edit` (a reply that copies much of the code: prompt lookup pays) and
`question` (a question answered from the code, as retrieval-augmented prompts ask). Each
prompt and temperature runs the target alone and auto with the draft, each in a Session
of its own: the first call of each (a fresh Session, as `specmlx bench` makes) takes the
prompt and gives the end-to-end ratio, prefill included; then --repeat pairs of calls on
the warm Sessions, interleaved (the order reversed every other pair), give the decode
ratio. A warm call takes only its reply, so a pair's two calls run seconds apart instead
of a long prefill apart: this host's speed drifts by ~10% over minutes, which fresh
pairs could not tell from a loss (at six fresh pairs a case's median still moved ~5%
between runs). Auto's warm calls go on from what its earlier calls left (the draft has
the prompt once it drafted), as a conversation's next turn over the same document does.
Prints, per case, each mode's decode tok/s (median over the warm pairs), auto's ratio to
the target alone per pair (median, min-max), the end-to-end ratio of the fresh pair, and
whether greedy replies were identical.

    python -m bench long_context --lengths 2048,4096 --temperatures 0,1 --repeat 6
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlx_lm

import specmlx
from bench.timing import cpu_name, median, orders, write_atomic
from specmlx.paths import home

TASKS = {
    "summarize": "Summarize what the code above does, module by module.",
    "edit": "Rewrite the first class in the code above with a docstring on every method. "
    "Give the whole class.",
    "question": "In the code above, how is the attention mask made for a pass over several "
    "tokens, and which cache classes take part? Answer from the code.",
}
SOURCES = ("models/llama.py", "models/qwen2.py", "models/gemma3_text.py", "models/cache.py")


def source_text() -> str:
    root = Path(mlx_lm.__file__).parent
    return "\n\n".join((root / name).read_text() for name in SOURCES if (root / name).is_file())


def long_prompt(target, tokens: int, task: str) -> list[int]:
    """The chat-templated prompt: the first lines of the sources that fit in `tokens`
    tokens, then the task."""
    lines, kept = source_text().splitlines(), []
    for line in lines:
        if len(target.tokenizer.encode("\n".join([*kept, line]))) > tokens:
            break
        kept.append(line)
    message = "```python\n" + "\n".join(kept) + "\n```\n\n" + TASKS[task]
    return target.tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True
    )


def call(target, ids: list[int], session, mode: dict, run: dict):
    """One finished generate() call on `session`."""
    return specmlx.generate(target, ids, session=session, **mode, **run).run()


def main(argv: list[str] | None = None) -> None:
    models = home() / "models"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(models / "qwen2.5-coder-1.5b-instruct-int4"))
    ap.add_argument("--draft", default=str(models / "qwen2.5-coder-0.5b-instruct-int4"))
    ap.add_argument("--lengths", default="2048,4096")
    ap.add_argument("--tasks", default="summarize,edit")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=6, help="warm pairs a case")
    ap.add_argument("--out", help="also write the table to this markdown file")
    args = ap.parse_args(argv)
    target, draft = specmlx.load(args.target), specmlx.load(args.draft)
    specmlx.generate(target, "hi", draft=draft, max_tokens=8).run()  # one-time work
    modes = {"alone": dict(num_draft=0), "auto": dict(num_draft="auto")}
    drafts = {"alone": None, "auto": draft}
    lines = [
        f"{cpu_name()} · {args.max_tokens} tokens · {args.repeat} warm pairs",
        "",
        "| case | alone tok/s | auto tok/s | auto / alone, decode | end to end | greedy same |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for length in (int(x) for x in args.lengths.split(",")):
        for task in args.tasks.split(","):
            ids = long_prompt(target, length, task)
            for temperature in (float(t) for t in args.temperatures.split(",")):
                sessions = {n: specmlx.Session(target, drafts[n]) for n in modes}
                run = dict(max_tokens=args.max_tokens, temperature=temperature, seed=0)
                fresh = {n: call(target, ids, sessions[n], modes[n], run) for n in modes}
                runs: dict[str, list] = {name: [] for name in modes}
                for _, order in orders(list(modes), args.repeat):
                    for n in order:
                        runs[n].append(call(target, ids, sessions[n], modes[n], run))
                tps = {n: [g.stats.decode_tps for g in gens] for n, gens in runs.items()}
                decode = [a / b for a, b in zip(tps["auto"], tps["alone"], strict=True)]

                def wall(g) -> float:
                    return g.stats.prefill_time + g.stats.decode_time

                e2e = (fresh["auto"].stats.tokens / wall(fresh["auto"])) / (
                    fresh["alone"].stats.tokens / wall(fresh["alone"])
                )
                same = "–"
                if temperature == 0:
                    pairs = [*zip(runs["auto"], runs["alone"], strict=True), fresh.values()]
                    same = f"{sum(a.tokens == b.tokens for a, b in pairs)}/{len(pairs)}"
                case = f"{task}, {len(ids)} tokens, T = {temperature:g}"
                lines.append(
                    f"| {case} | {median(tps['alone']):.1f} | {median(tps['auto']):.1f} | "
                    f"{median(decode):.3f}x ({min(decode):.3f}-{max(decode):.3f}) | "
                    f"{e2e:.3f}x | {same} |"
                )
                print(lines[-1], flush=True)
    if args.out:
        write_atomic(args.out, "\n".join(lines) + "\n")
