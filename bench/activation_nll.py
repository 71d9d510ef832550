"""What int8 activations cost in accuracy: a model's mean NLL per token on held-out text,
teacher-forced, with the native kernel's matmuls on float32 x and on int8 x.

    M=~/.cache/specmlx/models
    python bench/activation_nll.py --model $M/qwen2.5-coder-1.5b-instruct-int4 \
        --model $M/qwen2.5-coder-0.5b-instruct-int4 --out bench/results/activation_nll.md

The text is the first turns of Spec-Bench's math_reasoning and rag prompts, alternating,
until --tokens tokens: categories held out from all tuning (../shared/prompts/README.md).
It runs in chunks of --chunk tokens through one KV cache, as a prefill does, so every
matmul has M = --chunk rows (a row's result does not depend on the rows beside it, so a
decode step's would be the same). Three runs see the same tokens and chunks: float32 x
everywhere; int8 x in the body (the 4-bit layers) with the 8-bit output head on float32 x;
and int8 x everywhere, head included (what int8 mode does). The second and third share
the body's pass: the head runs twice on its hidden states, once in each mode.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
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


def body_and_head(module) -> tuple[Callable, Callable]:
    """The model's layers up to the final norm, and its output head (tied or not), for
    models built like mlx-lm's llama / qwen2 (`model` and `lm_head` or tied embeddings)."""
    inner = getattr(module, "model", None)
    if inner is None or not hasattr(inner, "embed_tokens"):
        sys.exit(f"cannot find body and head of {type(module).__name__}; use a qwen2/llama model")
    if getattr(module, "lm_head", None) is not None:
        return inner, module.lm_head
    return inner, inner.embed_tokens.as_linear


def scored(logits: mx.array, targets: mx.array, vocab: int) -> tuple[mx.array, mx.array]:
    """(-log p of each target, the argmax prediction there)."""
    logits = logits[:, :vocab].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    nll = -mx.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
    return nll, mx.argmax(logits, axis=-1)


def token_nlls(model, ids: list[int], chunk: int, body_mode: str) -> dict[str, tuple]:
    """Per head mode ("float32", "int8"): (-log p of each next token, the argmax there),
    teacher-forced in chunks, the body's matmuls on `body_mode` x. Each mode is set before
    the evaluation it applies to: the kernel reads it when a matmul is evaluated."""
    body, head = body_and_head(model.module)
    cache = make_cache(model.module)
    head_modes = ("float32",) if body_mode == "float32" else ("float32", "int8")
    out: dict[str, tuple[list, list]] = {mode: ([], []) for mode in head_modes}
    for start in range(0, len(ids) - 1, chunk):
        inputs = ids[start : min(start + chunk, len(ids) - 1)]
        targets = mx.array(ids[start + 1 : start + 1 + len(inputs)])
        native.set_activations(body_mode)
        hidden = body(mx.array(inputs, mx.uint32)[None], cache)[0]
        mx.eval(hidden, [c.state for c in cache])
        for mode in head_modes:
            native.set_activations(mode)
            nll, top = scored(head(hidden), targets, model.vocab_size)
            mx.eval(nll, top)
            out[mode][0].append(nll)
            out[mode][1].append(top)
    return {mode: (mx.concatenate(n), mx.concatenate(t)) for mode, (n, t) in out.items()}


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
        "int8 x: int8 in the 4-bit body, the 8-bit head on float32 x (head fp32) or on int8 x "
        "too (all int8); changes and argmax against float32 x everywhere",
        "",
        "| model | NLL float32 x | NLL int8, head fp32 | change | NLL all int8 | change | "
        "ppl float32 | ppl all int8 | same argmax, head fp32 | same argmax, all int8 | "
        "mean abs. change per token, all int8 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    try:
        for path in args.model:
            model = load(path)
            ids = held_out_text(args.prompts, model.tokenizer, args.tokens)
            nll_f, top_f = token_nlls(model, ids, args.chunk, "float32")["float32"]
            int8_body = token_nlls(model, ids, args.chunk, "int8")
            (nll_b, top_b), (nll_q, top_q) = int8_body["float32"], int8_body["int8"]
            mean_f, mean_b, mean_q = (v.mean().item() for v in (nll_f, nll_b, nll_q))

            def same(top: mx.array, top_f=top_f) -> float:
                return (top == top_f).astype(mx.float32).mean().item() * 100

            drift = mx.abs(nll_q - nll_f).mean().item()
            row = (
                f"| {model.name} ({len(ids) - 1} predictions) | {mean_f:.4f} | {mean_b:.4f} | "
                f"{(mean_b / mean_f - 1) * 100:+.2f}% | {mean_q:.4f} | "
                f"{(mean_q / mean_f - 1) * 100:+.2f}% | {math.exp(mean_f):.3f} | "
                f"{math.exp(mean_q):.3f} | {same(top_b):.1f}% | {same(top_q):.1f}% | "
                f"{drift:.4f} |"
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
