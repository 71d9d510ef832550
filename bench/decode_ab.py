"""Whole decode of two builds, checkpoints or settings against each other, as a user runs it.

One process a run, the variants alternating (the order reversed every other repeat), so
that a change to the kernel or to a checkpoint is measured as a user sees it, from load
to the last token.

    python -m bench decode_ab --variant base=- --variant packed=/tmp/var/packed --repeat 7
    python -m bench decode_ab --variant h8=-:$M/q15-h8 --variant h6=-:$M/q15-h6
    python -m bench decode_ab --variant packed=- --variant plain=- --env plain:SPECMLX_PACK=0
    python -m bench decode_ab --variant new=- --variant old=/tmp/old --draft $M/DRAFT

A variant is NAME=TREE[:MODEL]: TREE a copy of the repository (its `specmlx` package, with
its own built extension, goes first on PYTHONPATH; `-` for the installed one), MODEL a
model directory (default --model); --env NAME:KEY=VALUE sets a variable for one variant's
runs. Each run loads the model, decodes 16 greedy tokens to
warm up, then --tokens twice, and reports the faster of the two (tok/s) and a hash of its
tokens. With --draft, each run speculates with that draft model at auto γ (the warm-up
too), so two engines' speculation is compared as a user runs it. Prints each variant's
median and its per-repeat ratios to the first variant's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from bench.timing import interleave, median

PROMPT = "Write a Python function that tells whether a number is prime."
CHILD = """
import hashlib, sys
import specmlx
model = specmlx.load(sys.argv[1])
model.tokenizer.eos_token_ids = set()
ids = model.tokenizer.encode(sys.argv[3])
draft = specmlx.load(sys.argv[4]) if sys.argv[4] != "-" else None
run = dict(draft=draft, num_draft="auto" if draft else 0)
specmlx.generate(model, ids, max_tokens=16, **run).run()
best, tokens = 0.0, []
for _ in range(2):
    gen = specmlx.generate(model, ids, max_tokens=int(sys.argv[2]), **run).run()
    best, tokens = max(best, gen.stats.tokens / gen.stats.decode_time), gen.tokens
print(best, hashlib.sha256(str(tokens).encode()).hexdigest()[:8])
"""


def run_once(
    tree: str, model: str, extra: dict, tokens: int, draft: str = "-"
) -> tuple[float, str]:
    env = dict(os.environ, **extra)
    if tree != "-":
        env["PYTHONPATH"] = str(Path(tree).resolve())
    out = subprocess.run(
        [sys.executable, "-c", CHILD, model, str(tokens), PROMPT, draft],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",  # so that the working tree's own specmlx does not shadow TREE's
        check=True,
    ).stdout.split()
    return float(out[0]), out[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append", required=True, help="NAME=TREE[:MODEL]")
    parser.add_argument(
        "--model", help="default: $SPECMLX_HOME/models/qwen2.5-coder-1.5b-instruct-int4"
    )
    parser.add_argument("--env", action="append", default=[], help="NAME:KEY=VALUE")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--draft", default="-", help="a draft model: auto γ speculation")
    args = parser.parse_args(argv)
    if args.model is None:
        from specmlx.paths import home

        args.model = str(home() / "models" / "qwen2.5-coder-1.5b-instruct-int4")
    variants = {}
    for spec in args.variant:
        name, _, rest = spec.partition("=")
        tree, _, model = rest.partition(":")
        variants[name] = (tree or "-", model or args.model, {})
    for spec in args.env:
        name, _, assignment = spec.partition(":")
        key, _, value = assignment.partition("=")
        if name not in variants or not key:
            parser.error(f"--env {spec!r}: want NAME:KEY=VALUE for a --variant NAME")
        variants[name][2][key] = value

    def run(name: str):
        def once(r: int) -> tuple[float, str]:
            rate, digest = run_once(*variants[name], args.tokens, args.draft)
            print(f"repeat {r + 1}: {name} {rate:.2f} tok/s (tokens {digest})", flush=True)
            return rate, digest

        return once

    runs = interleave({name: run(name) for name in variants}, args.repeat)
    rates = {name: [rate for rate, _ in values] for name, values in runs.items()}
    first = next(iter(variants))
    for name, values in rates.items():
        ratios = [a / b for a, b in zip(values, rates[first], strict=True)]
        print(
            f"{name}: median {median(values):.2f} tok/s; against {first} "
            f"{median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f}); "
            f"tokens {', '.join(sorted({digest for _, digest in runs[name]}))}"
        )
