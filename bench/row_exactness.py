"""Whether a pass over k tokens gives each position what one-token steps give it, bit for bit.

Speculation verifies γ + 1 positions in one target pass; the target alone decodes one
token a step. Greedy output is the same only if each position's logits are, or differ too
little to flip a near-tie. This builds each tiny architecture of specmlx.tiny, prefills a
prompt, then runs three tokens as one pass and as three steps from the same cache, and
prints the largest logit difference. specmlx.exactness.rows_exact is the rule drawn
from it: int8 activations (whose rounding can carry a last-bit difference to a different
token) only where every layer keeps a plain KV cache.

    python bench/row_exactness.py
"""

from __future__ import annotations

import tempfile

import mlx.core as mx

import specmlx
from specmlx.caches import checkpoint, make_cache, prefill, rewind
from specmlx.tiny import ARCHITECTURES, build_tiny_model

PROMPT = (
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\nThe quick brown fox jumps over the lazy dog."
)
TOKENS = [5, 17, 42]


def main() -> None:
    root = tempfile.mkdtemp(prefix="row-exactness-")
    print("| architecture | caches | max logit difference, one pass vs steps |")
    print("| --- | --- | --- |")
    for arch in ARCHITECTURES:
        model = specmlx.load(build_tiny_model(f"{root}/{arch}", arch=arch, seed=0))
        cache = make_cache(model.module)
        prefill(model, cache, model.tokenizer.encode(PROMPT))
        saved = checkpoint(cache)
        one_pass = model.module(mx.array([TOKENS], mx.uint32), cache=cache)[0]
        mx.eval(one_pass)
        rewind(model, cache, saved, [], len(TOKENS))
        steps = [model.module(mx.array([[t]], mx.uint32), cache=cache)[0, -1] for t in TOKENS]
        diff = max(mx.abs(one_pass[i] - s).max().item() for i, s in enumerate(steps))
        kinds = ", ".join(sorted({type(c).__name__ for c in cache}))
        print(f"| {arch} | {kinds} | {diff:.3g} |")


if __name__ == "__main__":
    main()
