"""The target's cost curve T(k)/T(1), alone and right after draft passes, and the draft's pass.

The γ policy (specmlx.policy) prices a round from ratios the engine times as it runs.
This script times the same passes outside the engine, so its figures can be checked:
each target pass over k new tokens is timed with the caches trimmed back after it, k
interleaved within each repeat, medians over repeats. "after drafts" runs three
one-token draft passes before each target pass, as a round of γ = 3 does. "draft
catch-up" is the draft's own pass over k tokens (a draft that sat out k - 1 plain rounds
takes them with its first pass), as a ratio to its one-token pass: the policy prices it
on the target's curve. With --rows B, also T(B, k): one batched pass (specmlx.batch) over B
sequences of k new tokens each, each on its own cache, what a round of continuous
batching costs.

    python -m bench cost_curve --target TARGET_DIR --draft DRAFT_DIR [--kmax 9 --repeat 5]
    python -m bench cost_curve ... --isa avx2   # the AVX2 kernels on an AVX-512 CPU
    python -m bench cost_curve ... --rows 4     # and a batch of 4 sequences
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from bench.timing import median
from specmlx.batch import batched_pass
from specmlx.bench import encode
from specmlx.caches import checkpoint, make_cache, prefill, rewind, timed_pass
from specmlx.cpu import native
from specmlx.loading import load

PROMPT = "Write a python function that adds two numbers and explain it."


def timed_rows(model, caches: list[list], tokens: list[int]) -> float:
    """Seconds for one batched pass over `tokens` in each of the caches; they are left as
    they were."""
    saved = [checkpoint(c) for c in caches]
    start = time.perf_counter()
    x = mx.array(tokens, mx.uint32)
    mx.eval(batched_pass(model, [(c, x) for c in caches]))
    seconds = time.perf_counter() - start
    for cache, state in zip(caches, saved, strict=True):
        rewind(model, cache, state, [], len(tokens))
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--kmax", type=int, default=9)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--isa", help="force the native kernels' ISA: avx512, avx2 or scalar")
    parser.add_argument("--rows", type=int, default=0, help="also T(B, k) for a batch of B")
    args = parser.parse_args(argv)
    if args.isa:
        if not native.available():
            raise SystemExit(f"--isa needs the native kernel: {native.reason()}")
        native.set_isa(args.isa)

    target, draft = load(args.target), load(args.draft)
    ids = encode(target, PROMPT, chat_template=True)
    models = {"target": target, "draft": draft}
    caches = {}
    for name, model in models.items():
        caches[name] = make_cache(model.module)
        prefill(model, caches[name], ids)
        # A process's first one-token pass pays one-time work, even after the prefill.
        first, second = (timed_pass(model, caches[name], ids[-1:]) for _ in range(2))
        print(f"{name}: first one-token pass {first * 1000:.0f} ms, the next {second * 1000:.0f}")

    def run(name: str, k: int) -> float:
        return timed_pass(models[name], caches[name], ids[-k:])

    alone = {k: [] for k in range(1, args.kmax + 1)}
    after = {k: [] for k in (1, 4, 8) if k <= args.kmax}
    draft_pass = []
    catch_up = {k: [] for k in (2, 5, 10, 20) if k < len(ids)}
    rows: list[list] = []
    for _ in range(args.rows if args.rows > 1 else 0):
        rows.append(make_cache(target.module))
        prefill(target, rows[-1], ids)
    batched = {k: [] for k in range(1, 5) if rows and k <= args.kmax}
    for _ in range(args.repeat):
        for k in batched:
            batched[k].append(timed_rows(target, rows, ids[-k:]))
        for k in alone:
            alone[k].append(run("target", k))
        draft_pass.append(run("draft", 1))
        for k in catch_up:
            catch_up[k].append(run("draft", k))
        for k in after:
            for _ in range(3):
                run("draft", 1)
            after[k].append(run("target", k))
    t1, d1 = median(alone[1]), median(draft_pass)
    if args.isa:
        print(f"kernel: {native.describe()}")
    print(f"T(1) {t1 * 1000:.0f} ms; draft pass {d1 / t1:.2f} of T(1)")
    print("alone:       " + "  ".join(f"{k}: {median(v) / t1:.2f}" for k, v in alone.items()))
    print("after drafts: " + "  ".join(f"{k}: {median(v) / t1:.2f}" for k, v in after.items()))
    print("draft catch-up: " + "  ".join(f"{k}: {median(v) / d1:.2f}" for k, v in catch_up.items()))
    if batched:
        ratios = "  ".join(f"{k}: {median(v) / t1:.2f}" for k, v in batched.items())
        print(f"{args.rows} rows, k each: {ratios}")
