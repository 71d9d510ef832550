"""specmlx vs mlx_lm.generate on the same bfloat16-scaled INT4 checkpoint, on this CPU.

mlx-community's 4-bit checkpoints store bfloat16 scales, and mlx-lm runs them as
stored: bf16 activations, which MLX's x86 CPU kernels run ~8x slower than float32.
specmlx's dtype policy casts to float32 at load on the CPU (and its native INT4 kernel
then applies). Both engines run the same greedy decode of the same prompt, interleaved,
several times; the script reports decode tok/s, their ratio (median of per-rep ratios),
and how far the outputs agree (tokens, and logits on the prompt within a tolerance).

    python bench/dtype_policy.py --model DIR_WITH_BF16_SCALES [--tokens 16] [--reps 3]

Make such a directory from any source with `specmlx quantize SRC -o DIR --dtype bfloat16
--embed-bits 4` (mlx-community's layout: everything 4-bit, bf16 scales).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.generate import stream_generate
from mlx_lm.utils import common_prefix_len
from mlx_lm.utils import load as mlx_lm_load

import specmlx

PROMPT = "def quicksort(items):"


def decode_mlx_lm(model, tokenizer, ids: list[int], tokens: int) -> tuple[list[int], float]:
    """Greedy tokens and decode tok/s (first token excluded: it carries the prefill)."""
    out, first_at = [], None
    for response in stream_generate(model, tokenizer, mx.array(ids), max_tokens=tokens):
        out.append(response.token)
        if first_at is None:
            first_at = time.perf_counter()
    return out, (len(out) - 1) / (time.perf_counter() - first_at)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    theirs, tokenizer = mlx_lm_load(str(args.model))
    ours = specmlx.load(args.model, lazy=False)
    scales = {str(v.dtype) for k, v in tree_flatten(theirs.parameters()) if k.endswith("scales")}
    ids = tokenizer.encode(PROMPT)
    logits_theirs = theirs(mx.array([ids]))[0].astype(mx.float32)
    logits_ours = ours.module(mx.array([ids]))[0].astype(mx.float32)
    a, b = np.array(logits_ours), np.array(logits_theirs)
    logit_gap = float(np.abs(a - b).max() / (a.max() - a.min()))

    rows = []
    for rep in range(args.reps):  # interleaved: a slow minute hits both engines alike
        tokens_theirs, tps_theirs = decode_mlx_lm(theirs, tokenizer, ids, args.tokens)
        gen = specmlx.generate(ours, ids, max_tokens=args.tokens, num_draft=0).run()
        rows.append(
            {
                "rep": rep,
                "mlx_lm_tps": tps_theirs,
                "specmlx_tps": gen.stats.decode_tps,
                "mlx_lm_tokens": tokens_theirs,
                "specmlx_tokens": gen.tokens,
            }
        )
        print(f"rep {rep}: mlx_lm {tps_theirs:.2f} tok/s, specmlx {gen.stats.decode_tps:.2f} tok/s")
    ratio = statistics.median(r["specmlx_tps"] / r["mlx_lm_tps"] for r in rows)
    agree = [common_prefix_len(r["specmlx_tokens"], r["mlx_lm_tokens"]) for r in rows]
    summary = {
        "model": str(args.model),
        "checkpoint_scales": sorted(scales),
        "specmlx_dtype": ours.dtype,
        "specmlx_layers": sorted({type(m).__name__ for m in ours.module.modules()} & {
            "QuantizedLinear", "NativeQuantizedLinear", "Linear"}),
        "mlx_lm_tps_median": statistics.median(r["mlx_lm_tps"] for r in rows),
        "specmlx_tps_median": statistics.median(r["specmlx_tps"] for r in rows),
        "speedup_median": ratio,
        "prompt_logits_max_gap_over_range": logit_gap,
        "greedy_tokens_equal_before_first_divergence": agree,
        "rows": rows,
    }  # fmt: skip
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
