"""Does a training-free self-draft pay: the target's first L layers, its final norm and
its own output head (LayerSkip's early exit, without LayerSkip's training)?

Such a drafter would share those layers' cache entries with the target and cost about
L / N of a target pass plus the head. Measured here without building it: over a text the
target reads once (teacher forcing), how often the early exit's argmax equals the full
model's (α at draft position 1), and the cost of a pass through L layers and the head as
a share of a full pass; from them, the best speedup a chain of γ such drafts could give
(τ(γ) / (1 + γ c) with T(γ + 1) taken as T(1), which flatters the draft). A trained head
is the comparison: `python -m bench heads`.

    python -m bench self_draft --layers 7,14,21
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask

import specmlx
from bench.timing import cpu_name, median
from specmlx.caches import make_cache, prefill
from specmlx.lm_head import head_layer
from specmlx.paths import home

TEXT = Path(__file__).parent.parent / "specmlx" / "engine.py"  # code the target can read


def early_exit_agreement(target, ids: list[int], layers: int) -> float:
    """The share of positions where the first `layers` layers' exit picks the token the
    whole model picks (both greedy)."""
    inner, (head, tied) = target.module.model, head_layer(target)
    x = mx.array(ids)[None]
    h = inner.embed_tokens(x)
    mask = create_attention_mask(h, None)
    exits = None
    for i, layer in enumerate(inner.layers):
        h = layer(h, mask, None)
        if i + 1 == layers:
            exits = inner.norm(h)
    full = inner.norm(h)

    def pick(hidden):
        return mx.argmax(head.as_linear(hidden) if tied else head(hidden), axis=-1)

    return mx.mean(pick(exits) == pick(full)).item()


def exit_cost(target, layers: int) -> float:
    """Seconds of a one-token pass through the first `layers` layers and the head, after
    512 cached tokens (median of 15)."""
    inner, (head, tied) = target.module.model, head_layer(target)
    cache = make_cache(target.module)
    prefill(target, cache, list(range(100, 612)))

    def one() -> float:
        import time

        start = time.perf_counter()
        h = inner.embed_tokens(mx.array([[7]]))
        for layer, c in zip(inner.layers[:layers], cache[:layers], strict=True):
            h = layer(h, None, c)
        out = inner.norm(h)
        mx.eval(head.as_linear(out) if tied else head(out))
        seconds = time.perf_counter() - start
        for c in cache[:layers]:
            c.trim(1)
        return seconds

    return median(one() for _ in range(15))


def best_speedup(alpha: float, ratio: float, longest: int = 8) -> tuple[float, int]:
    """max over γ of τ(γ) / (1 + γ c), τ(γ) = (1 - α^(γ+1)) / (1 - α): drafts assumed
    independent, the verify pass as cheap as one step."""
    rates = {
        g: ((1 - alpha ** (g + 1)) / (1 - alpha) if alpha < 1 else g + 1) / (1 + g * ratio)
        for g in range(1, longest + 1)
    }
    g = max(rates, key=rates.get)
    return rates[g], g


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(home() / "models" / "qwen2.5-coder-1.5b-instruct-int4"))
    ap.add_argument("--layers", default="7,14,21")
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args(argv)
    target = specmlx.load(args.target, lazy=False)
    ids = target.tokenizer.encode(TEXT.read_text())[: args.tokens]
    full = exit_cost(target, len(target.module.model.layers))
    print(f"{cpu_name()} · {target.name} · {len(ids)} tokens of {TEXT.name}")
    print("| layers | α (position 1) | pass ÷ full pass | best speedup (γ) |")
    print("| --- | --- | --- | --- |")
    for layers in (int(n) for n in args.layers.split(",")):
        alpha = early_exit_agreement(target, ids, layers)
        ratio = exit_cost(target, layers) / full
        speedup, g = best_speedup(alpha, ratio)
        print(f"| {layers} | {alpha:.3f} | {ratio:.3f} | {speedup:.2f}x ({g}) |")


if __name__ == "__main__":
    main()
