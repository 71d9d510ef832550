"""Does queueing the next plain pass (as mlx-lm's generate_step does) pay on this backend?

The target alone decodes the same prompt with each plain round building the next pass
before it syncs on its own token and running it as soon as the next round is planned
plain (what specmlx's engine does), and without, interleaved, medians of decode tok/s.
The tokens must agree.

    python bench/plain_queue.py [--model DIR] [--repeat 6] [--tokens 64]
"""

from __future__ import annotations

import argparse
from statistics import median

import specmlx
from specmlx import engine
from specmlx.paths import home

PROMPT = "Write a short travel blog post about Hawaii."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(home() / "models" / "qwen2.5-coder-1.5b-instruct-int4"))
    ap.add_argument("--repeat", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    target = specmlx.load(args.model)
    messages = [{"role": "user", "content": PROMPT}]
    ids = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    queues = engine.trims_exactly
    runs: dict[str, list[float]] = {"queued": [], "unqueued": []}
    tokens = {}
    for i in range(args.repeat + 1):  # the first pair warms up and is not counted
        for mode in ("queued", "unqueued") if i % 2 else ("unqueued", "queued"):
            # The engine queues only over caches that trim exactly: say these do not.
            engine.trims_exactly = queues if mode == "queued" else (lambda cache: False)
            gen = engine.generate(target, ids, max_tokens=args.tokens, num_draft=0).run()
            tokens.setdefault(mode, gen.tokens)
            if i:
                runs[mode].append(gen.stats.decode_tps)
    engine.trims_exactly = queues
    assert tokens["queued"] == tokens["unqueued"], "queued and unqueued decoded apart"
    from specmlx.cpu import describe

    print(f"{args.model} · backend {engine.backend()} · {describe()}")
    for mode, tps in runs.items():
        print(f"{mode}: {median(tps):.2f} tok/s median of {[round(t, 1) for t in tps]}")


if __name__ == "__main__":
    main()
