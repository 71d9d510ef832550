"""What undoing a rejected round costs, against one plain target step T(1).

A cache that trims (KVCache) drops rejected positions for free; a sliding window is cut
right after the verify pass (caches._cut); a recurrent or conv state is restored from
its checkpoint and the kept tokens run again (caches.rewind): `Stats.rewind_time`
counts those re-runs, and the γ policy prices them. One process; plain and prompt-lookup
runs interleaved (lookup's guesses are free, so the rejections are the only extra cost
beyond the verify), a warm-up pair first, medians:

    python -m bench rollback_cost MODEL_DIR [--repeat 3] [--tokens 96]
    python -m bench rollback_cost --tiny mamba2      # a tiny random model of that arch
"""

from __future__ import annotations

import argparse
import platform
import tempfile
from pathlib import Path

import specmlx
from bench.timing import median
from specmlx.tiny import build_tiny_model

COLORS = ["red", "blue", "green", "black", "white", "yellow", "brown", "grey"]


def copying_prompt(lines: int = 40) -> str:
    """A list the model continues and partly copies: lookup drafts pass about half the time."""
    items = [
        f"Item {i}: the {COLORS[i * 3 % 8]} box on shelf {i % 7} weighs "
        f"{(i * 37) % 50 + 3} kilograms."
        for i in range(1, lines + 1)
    ]
    return "Inventory list.\n" + "\n".join(items) + f"\nItem {lines + 1}:"


def measure(model: specmlx.Model, repeat: int, tokens: int) -> dict:
    prompt = copying_prompt()
    step, per_rewind = [], []
    for rep in range(repeat + 1):
        plain = specmlx.generate(model, prompt, max_tokens=tokens, num_draft=0).run().stats
        spec = (
            specmlx.generate(model, prompt, max_tokens=tokens, num_draft=4, draft_mode="lookup")
            .run()
            .stats
        )
        if rep == 0:
            continue  # warm-up: first passes pay one-time work
        step.append(plain.decode_time / plain.target_passes)
        if spec.rewinds:
            per_rewind.append(spec.rewind_time / spec.rewinds)
    t1 = median(step)
    rewind = median(per_rewind) if per_rewind else 0.0
    return {"t1_s": t1, "rewind_s": rewind, "rewind_over_t1": rewind / t1, "rewinds": spec.rewinds}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="a model directory")
    ap.add_argument("--tiny", help="instead, a tiny random model of this mlx-lm architecture")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args(argv)
    if args.tiny:
        path = build_tiny_model(Path(tempfile.mkdtemp()) / args.tiny, arch=args.tiny)
    elif args.model:
        path = Path(args.model)
    else:
        ap.error("give a model directory or --tiny ARCH")
    model = specmlx.load(path, lazy=False)
    result = measure(model, args.repeat, args.tokens)
    print(
        f"{model.config.get('model_type')} ({path.name}) on {platform.processor() or 'cpu'}: "
        f"T(1) {1000 * result['t1_s']:.2f} ms, rewind per rewound round "
        f"{1000 * result['rewind_s']:.2f} ms = {result['rewind_over_t1']:.2f} T(1) "
        f"({result['rewinds']} re-runs in the last lookup run)"
    )
