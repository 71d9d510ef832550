"""What int8 activations cost in accuracy: a model's mean NLL per token on held-out text,
teacher-forced, with the native kernel's 4-bit matmuls on float32 x and on int8 x.

    M=~/.cache/specmlx/models
    python bench/activation_nll.py --model $M/qwen2.5-coder-1.5b-instruct-int4 \
        --model $M/qwen2.5-coder-0.5b-instruct-int4 --out bench/results/activation_nll.md

The text is the first turns of Spec-Bench's math_reasoning and rag prompts, alternating,
until --tokens tokens: categories held out from all tuning (../shared/prompts/README.md).
It runs in chunks of --chunk tokens through one KV cache, as a prefill does, so every
matmul has M = --chunk rows. Both modes see the same tokens and chunks; only the 4-bit
layers' activations differ (8-bit embeddings and heads take float32 x in both).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import mlx.core as mx

from specmlx.bench.machine import cpu_model
from specmlx.caches import make_cache
from specmlx.cpu import native
from specmlx.loading import load

PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "prompts" / "spec_bench.jsonl"
HELD_OUT = ("math_reasoning", "rag")
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni")


def held_out_text(path: Path, tokenizer, tokens: int) -> list[int]:
    """Token ids of the first turns of the held-out prompts, alternating categories, cut
    to `tokens` (they are joined with blank lines, as one document)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_category = [[r["turns"][0] for r in rows if r["category"] == c] for c in HELD_OUT]
    ids: list[int] = []
    for pair in zip(*by_category, strict=False):  # as many pairs as the shorter has
        for text in pair:
            ids += tokenizer.encode(text + "\n\n", add_special_tokens=False)
            if len(ids) >= tokens:
                return ids[:tokens]
    return ids


def token_nlls(model, ids: list[int], chunk: int) -> tuple[mx.array, mx.array]:
    """(-log p of each next token, the argmax prediction there), teacher-forced in chunks."""
    cache = make_cache(model.module)
    nlls, argmax = [], []
    for start in range(0, len(ids) - 1, chunk):
        inputs = ids[start : min(start + chunk, len(ids) - 1)]
        targets = mx.array(ids[start + 1 : start + 1 + len(inputs)])
        logits = model.module(mx.array(inputs, mx.uint32)[None], cache=cache)[0]
        logits = logits[:, : model.vocab_size].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nlls.append(-mx.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0])
        argmax.append(mx.argmax(logits, axis=-1))
        mx.eval(nlls[-1], argmax[-1], [c.state for c in cache])
    return mx.concatenate(nlls), mx.concatenate(argmax)


def isa_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "?"
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return " ".join(f for f in ISA_FLAGS if f in flags)
    return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True, help="a model dir (repeatable)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of held-out text")
    parser.add_argument("--chunk", type=int, default=128, help="tokens per forward pass")
    parser.add_argument("--prompts", type=Path, default=PROMPTS)
    parser.add_argument("--out", type=Path, help="also write the table (markdown) here")
    args = parser.parse_args()
    if not native.available() or not hasattr(native._ext, "set_activations"):
        why = native.reason() or "a build from before int8 activations; rebuild it"
        sys.exit(f"native kernel with int8 activations unavailable: {why}")
    if not args.prompts.exists():
        sys.exit(f"no prompt file {args.prompts}; pass --prompts PATH to spec_bench.jsonl")

    before = native.activations()
    lines = [
        f"command: python {' '.join(sys.argv)}",
        f"cpu: {cpu_model()} ({isa_flags()}), {os.cpu_count()} logical CPUs",
        f"kernel: {native.describe()}; int8 tiles: {native._ext.q8_kernel()}",
        f"text: first turns of {args.prompts.name} {' / '.join(HELD_OUT)} (held out), "
        f"{args.tokens} tokens, teacher-forced in chunks of {args.chunk}",
        "",
        "| model | NLL float32 x | NLL int8 x | change | ppl float32 | ppl int8 | "
        "same argmax | mean abs. change per token |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    try:
        for path in args.model:
            model = load(path)
            ids = held_out_text(args.prompts, model.tokenizer, args.tokens)
            results = {}
            for mode in ("float32", "int8"):
                native.set_activations(mode)
                results[mode] = token_nlls(model, ids, args.chunk)
            (nll_f, top_f), (nll_q, top_q) = results["float32"], results["int8"]
            mean_f, mean_q = nll_f.mean().item(), nll_q.mean().item()
            same = (top_f == top_q).astype(mx.float32).mean().item()
            drift = mx.abs(nll_q - nll_f).mean().item()
            row = (
                f"| {model.name} ({len(ids) - 1} predictions) | {mean_f:.4f} | {mean_q:.4f} | "
                f"{(mean_q / mean_f - 1) * 100:+.2f}% | {math.exp(mean_f):.3f} | "
                f"{math.exp(mean_q):.3f} | {same * 100:.1f}% | {drift:.4f} |"
            )
            lines.append(row)
            print(row, flush=True)
            del model
    finally:
        native.set_activations(before)
    if args.out:
        tmp = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
