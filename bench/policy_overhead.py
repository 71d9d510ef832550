"""What auto's per-round policy work costs where it decodes plainly.

The target alone against auto made to plan γ = 0 every round (its plan and observe still
run, the confidence read included), and against that without the confidence read.
Interleaved, 5 repeats of 48 tokens after one warm-up each, medians of decode ms per token,
and of the host time from a plain round's sync to the start of the next pass (the device
idles through it: what the policy does there costs every plain round).

    python bench/policy_overhead.py [--target DIR --draft DIR]
"""

from __future__ import annotations

import argparse
import time
from statistics import median

import mlx.core as mx

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
    sync, launch = mx.eval, mx.async_eval
    synced, gaps = None, []  # when the last sync ended, if no pass has started since

    def timed_sync(*arrays):
        nonlocal synced
        sync(*arrays)
        synced = time.perf_counter()

    def timed_launch(*arrays):
        nonlocal synced
        if synced is not None:
            gaps.append(time.perf_counter() - synced)
            synced = None
        launch(*arrays)

    mx.eval, mx.async_eval = timed_sync, timed_launch

    def run(mode: str) -> tuple[float, float]:
        Scheduler.choose = (
            choose if mode == "alone" else lambda self, remaining=None, behind=None: Choice(0)
        )
        auto.top_probability = top_probability if "no confidence" not in mode else lambda *a: 0.5
        draft_model = None if mode == "alone" else draft
        gaps.clear()
        gen = specmlx.generate(target, prompt, draft_model, max_tokens=48).run()
        return gen.stats.decode_time / gen.stats.tokens * 1000, median(gaps) * 1000

    samples: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    for mode in MODES:
        run(mode)  # warm-up
    for _ in range(args.repeat):
        for mode in MODES:
            samples[mode].append(run(mode))
    for mode, runs in samples.items():
        ms = [step for step, _ in runs]
        gap = median(g for _, g in runs)
        print(
            f"{mode}: {median(ms):.2f} ms/token median of {[round(x, 1) for x in ms]}; "
            f"sync to next pass {gap:.3f} ms"
        )


if __name__ == "__main__":
    main()
