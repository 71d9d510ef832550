"""Does the Python thread cost the kernel a core? Decode with that thread at a lower priority.

On a 2-core machine a decode step has three threads that want a core: the native kernel's
two (MLX's stream thread, which calls the kernel, and one pool worker) and the Python
thread, which builds the next step's graph while the current one runs (about 2 ms of CPU
a token on the 1.5B). When Python runs, one of the kernel's threads waits for a core. This
lowers the Python thread's priority (its nice value, that thread only: the kernel's threads
exist by then and keep theirs), so that it runs in the kernel's gaps, and times decode
both ways in one process, interleaved, medians of the per-run ratios.

Lowering a thread's priority is one-way for a user without CAP_SYS_NICE: only root gets
the Python thread back to nice 0 between runs, which an A/B in one process needs (run it
as root, or give --nice only values above 0 and read each against the first).

    python bench/thread_priority.py --nice 0 10 [--draft] [--repeat 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from statistics import median

import specmlx
from specmlx.bench.machine import machine_info
from specmlx.engine import encode_prompt
from specmlx.paths import home

PROMPT = "Write a Python function that checks whether a string is a palindrome, with tests."


def main() -> None:
    models = home() / "models"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(models / "qwen2.5-coder-1.5b-instruct-int4"))
    ap.add_argument("--draft-model", default=str(models / "qwen2.5-coder-0.5b-instruct-int4"))
    ap.add_argument("--draft", action="store_true", help="speculative (auto) instead of plain")
    ap.add_argument("--nice", type=int, nargs="+", default=[0, 10])
    ap.add_argument("--repeat", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json", help="write the runs here")
    args = ap.parse_args()

    target = specmlx.load(args.target)
    draft = specmlx.load(args.draft_model) if args.draft else None
    prompt = encode_prompt(target, PROMPT)
    tid = threading.get_native_id()
    specmlx.generate(target, prompt, draft=draft, max_tokens=16).run()  # warm: pool, caches

    runs: dict[int, list[float]] = {n: [] for n in args.nice}
    tokens: dict[int, list[int]] = {}
    for r in range(args.repeat):
        for n in args.nice if r % 2 == 0 else args.nice[::-1]:
            os.setpriority(os.PRIO_PROCESS, tid, n)
            gen = specmlx.generate(target, prompt, draft=draft, max_tokens=args.tokens).run()
            runs[n].append(gen.stats.decode_tps)
            tokens.setdefault(n, gen.tokens)
            print(f"run {r + 1}/{args.repeat}, nice {n}: {gen.stats.decode_tps:.2f} tok/s")
    first = args.nice[0]
    rows = []
    for n in args.nice:
        ratio = median(a / b for a, b in zip(runs[n], runs[first], strict=True))
        same = tokens[n] == tokens[first]
        rows.append({"nice": n, "tps": runs[n], "median_tps": median(runs[n]), "ratio": ratio})
        print(f"nice {n}: median {median(runs[n]):.2f} tok/s, {ratio:.3f}x nice {first}", end="")
        print(f", same tokens: {same}")
    if args.json:
        out = {"machine": machine_info(), "mode": "auto" if draft else "plain", "runs": rows}
        nice = " ".join(map(str, args.nice))
        draft_flag = " --draft" if draft else ""
        out["command"] = f"python bench/thread_priority.py --nice {nice}{draft_flag}"
        tmp = f"{args.json}.tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
