"""A target pass over k tokens, whole and in its two parts: the body (embedding and decoder
layers) and the output head, each as a ratio to its own one-token pass.

bench/cost_curve.py gives T(k)/T(1) for the whole pass; this says which part grows with k.
The whole pass and the body run on a short prompt's cache, trimmed back after each pass;
the head runs on random hidden states of the same shape. k interleaved within each repeat,
medians over repeats.

    python bench/pass_parts.py --model $M/qwen2.5-coder-1.5b-instruct-int4 [--repeat 9]
"""

from __future__ import annotations

import argparse
import time
from statistics import median

import mlx.core as mx

from specmlx.bench import encode
from specmlx.caches import make_cache, prefill, timed_pass
from specmlx.loading import load

PROMPT = "Write a python function that adds two numbers and explain it."
TOKENS = (1, 2, 3, 4, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    model = load(args.model)
    module = model.module
    ids = encode(model, PROMPT, chat_template=True)
    cache = make_cache(module)
    prefill(model, cache, ids)
    tied = getattr(module, "lm_head", None) is None
    head = module.model.embed_tokens.as_linear if tied else module.lm_head
    hidden = module.args.hidden_size
    states = {k: mx.random.normal((1, k, hidden)) for k in TOKENS}
    mx.eval(list(states.values()))

    def body(x: mx.array, c: list) -> mx.array:
        return module.model(x[None], cache=c)

    def head_pass(k: int) -> float:
        start = time.perf_counter()
        mx.eval(head(states[k]))
        return time.perf_counter() - start

    for _ in range(2):  # a process's first passes pay one-time work
        timed_pass(model, cache, ids[-1:])
        timed_pass(model, cache, ids[-1:], forward=body)
        head_pass(1)
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeat):
        for k in TOKENS:
            times.setdefault(("whole", k), []).append(timed_pass(model, cache, ids[-k:]))
            times.setdefault(("body", k), []).append(timed_pass(model, cache, ids[-k:], body))
            times.setdefault(("head", k), []).append(head_pass(k))
    ms = {key: median(v) * 1e3 for key, v in times.items()}
    print(f"{args.model}; medians of {args.repeat}, ms (ratio to the part's own one-token pass)")
    for part in ("whole", "body", "head"):
        cells = (f"k={k}: {ms[part, k]:.1f} ({ms[part, k] / ms[part, 1]:.2f})" for k in TOKENS)
        print(f"{part:5}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
