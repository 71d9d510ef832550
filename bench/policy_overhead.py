"""What auto's per-round policy work costs where it decodes plainly.

The target alone against auto made to plan γ = 0 every round (its plan and observe still
run, the confidence read included), and against that without the confidence read.
Interleaved, 5 repeats of 48 tokens after one warm-up each, medians of decode ms per token.

    python bench/policy_overhead.py [--target DIR --draft DIR]
"""

from __future__ import annotations

import argparse
from statistics import median

import specmlx
from specmlx.bench import encode
from specmlx.paths import home
from specmlx.policy import auto
from specmlx.policy.choice import Choice, Scheduler

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
MODES = ("alone", "auto planning plain", "auto planning plain, no confidence read")


def main() -> None:
    models = home() / "models"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(models / "qwen2.5-coder-1.5b-instruct-int4"))
    ap.add_argument("--draft", default=str(models / "qwen2.5-coder-0.5b-instruct-int4"))
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    target, draft = specmlx.load(args.target), specmlx.load(args.draft)
    prompt = encode(target, PROMPT, chat_template=True)
    choose, top_probability = Scheduler.choose, auto.top_probability

    def run(mode: str) -> float:
        Scheduler.choose = (
            choose if mode == "alone" else lambda self, remaining=None, behind=None: Choice(0)
        )
        auto.top_probability = top_probability if "no confidence" not in mode else lambda *a: 0.5
        draft_model = None if mode == "alone" else draft
        gen = specmlx.generate(target, prompt, draft_model, max_tokens=48).run()
        return gen.stats.decode_time / gen.stats.tokens * 1000

    samples: dict[str, list[float]] = {m: [] for m in MODES}
    for mode in MODES:
        run(mode)  # warm-up
    for _ in range(args.repeat):
        for mode in MODES:
            samples[mode].append(run(mode))
    for mode, ms in samples.items():
        print(f"{mode}: {median(ms):.2f} ms/token median of {[round(x, 1) for x in ms]}")


if __name__ == "__main__":
    main()
