"""Whole decode of builds, checkpoints, settings or rank counts against each other.

One process (or one mlx.launch) a run, the variants alternating (the order reversed every
other repeat), so that a change to the kernel or to a checkpoint, or the target split
over two ranks against one process, is measured as a user sees it, from load to the last
token.

    python -m bench decode_ab --variant base=- --variant packed=/tmp/var/packed --repeat 7
    python -m bench decode_ab --variant h8=-:$M/q15-h8 --variant h6=-:$M/q15-h6
    python -m bench decode_ab --variant packed=- --variant plain=- --env plain:SPECMLX_PACK=0
    python -m bench decode_ab --variant new=- --variant old=/tmp/old --draft $M/DRAFT
    python -m bench decode_ab --variant one=-::- --variant one+d=- --variant two=-::- \
        --variant two+d=- --ranks two:2 --ranks two+d:2 --draft $M/DRAFT \
        --prompts heldout:humaneval:4 --passes 1,2,4,8

A variant is NAME=TREE[:MODEL[:DRAFT]]: TREE a copy of the repository (its `specmlx`
package, with its own built extension, goes first on PYTHONPATH; `-` for the installed
one), MODEL a model directory (default --model), DRAFT a draft model that variant
speculates with at auto γ (default --draft; `-` for none: the target alone). --env
NAME:KEY=VALUE sets a variable for one variant's runs; --ranks NAME:N runs that variant
as N ranks on this machine (the ring backend on localhost, each rank started as
`mlx.launch -n N --backend ring` starts it; the target split as `specmlx generate`
splits it, each rank SPECMLX_THREADS = CPUs / N; rank 0 reports).

Each run loads the model, decodes 16 greedy tokens to warm up, then each prompt (the
fixed one, or --prompts SPLIT:CATEGORY:K from the suite, chat-templated): alone, --tokens
twice and the faster kept; with --prompts, once each, and tok/s over them all. It reports
tok/s and a hash of its tokens. --passes K,K,.. also times target passes over k new
tokens after the first prompt (the cache cut back after each; medians of 15), and with
ranks one all-sum of a hidden state (the collective a tensor split pays twice a layer).
Prints each variant's median and its per-repeat ratios to the first variant's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.timing import interleave, median

PROMPT = "Write a Python function that tells whether a number is prime."
CHILD = """
import hashlib, json, sys, time
import mlx.core as mx
import specmlx
from specmlx import distributed
from specmlx.bench import encode
from specmlx.caches import layers
args = json.loads(sys.argv[1])
world = distributed.group()
lead = world is None or world.rank() == 0
model = specmlx.load(args["model"], group=world)
model.tokenizer.eos_token_ids = set()
draft = None
if args["draft"] != "-":
    draft = specmlx.load(args["draft"], lazy=not lead)
run = dict(draft=draft, num_draft="auto" if draft else 0)
texts = args["prompts"] or [args["prompt"]]
ids = [encode(model, t, chat_template=bool(args["prompts"])) for t in texts]
specmlx.generate(model, ids[0], max_tokens=16, **run).run()
out = {}
tokens, seconds, emitted = 0, 0.0, []
for prompt in ids:
    tries = 1 if args["prompts"] else 2
    best = None
    for _ in range(tries):
        gen = specmlx.generate(model, prompt, max_tokens=args["tokens"], **run).run()
        if best is None or gen.stats.decode_time < best.stats.decode_time:
            best = gen
    tokens, seconds = tokens + best.stats.tokens, seconds + best.stats.decode_time
    emitted += best.tokens
out["tps"] = tokens / seconds
out["digest"] = hashlib.sha256(str(emitted).encode()).hexdigest()[:8]
if args["passes"]:
    from specmlx.target import Target
    from specmlx.sampling import SamplingParams
    target = Target(model)
    target.start(ids[0], SamplingParams(temperature=0.0), 151936)
    def pass_ms(k):
        x = mx.array(ids[0][-1:] * k, mx.uint32)
        times = []
        for _ in range(15):
            start = time.perf_counter()
            mx.eval(target._forward(x)[0])
            times.append(time.perf_counter() - start)
            for c in layers(target.cache):
                c.trim(k)
        return 1000 * sorted(times)[7]
    out["pass_ms"] = {k: pass_ms(k) for k in args["passes"]}
    if world is not None:
        hidden = mx.ones((1, 1, model.module.args.hidden_size))
        times = []
        for _ in range(101):
            start = time.perf_counter()
            mx.eval(mx.distributed.all_sum(hidden, group=world))
            times.append(time.perf_counter() - start)
        out["all_sum_us"] = 1e6 * sorted(times)[50]
if lead:
    print(json.dumps(out))
"""


def run_once(tree: str, model: str, extra: dict, tokens: int, draft: str = "-", **options) -> dict:
    """One run's result: {"tps", "digest"[, "pass_ms", "all_sum_us"]}. options: ranks (1),
    prompts ([] for the fixed one), passes ([])."""
    ranks = options.get("ranks", 1)
    env = dict(os.environ, **extra)
    if tree != "-":
        env["PYTHONPATH"] = str(Path(tree).resolve())
    args = dict(
        model=model,
        draft=draft,
        tokens=tokens,
        prompt=PROMPT,
        prompts=options.get("prompts", []),
        passes=options.get("passes", []),
    )
    argv = [sys.executable, "-c", CHILD, json.dumps(args)]
    with tempfile.TemporaryDirectory() as cwd:  # so that the working tree's own specmlx
        if ranks > 1:  # does not shadow TREE's
            env.setdefault("SPECMLX_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
            env["MLX_HOSTFILE"] = str(Path(cwd) / "hosts.json")
            Path(env["MLX_HOSTFILE"]).write_text(json.dumps(ring_hosts(ranks)))
        procs = [
            subprocess.Popen(
                argv,
                env=dict(env, MLX_RANK=str(rank)) if ranks > 1 else env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(ranks)
        ]
        outs = [p.communicate() for p in procs]
    if any(p.returncode != 0 for p in procs):
        sys.exit(f"a run of {tree}:{model} failed:\n{outs[0][1][-2000:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


def ring_hosts(ranks: int) -> list[list[str]]:
    """mlx.launch's hostfile for `ranks` ranks on localhost (the ring backend), on free
    ports. The ranks start as mlx.launch starts them, without it: its relay of their
    output polls a writable pipe in a loop and took about a core per rank here."""
    sockets = [socket.socket() for _ in range(ranks)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return [[f"127.0.0.1:{port}"] for port in ports]


def suite_prompts(spec: str) -> list[str]:
    """SPLIT:CATEGORY:K: the suite's first K prompts of CATEGORY in SPLIT, as text."""
    from specmlx.bench import read_suite, select_prompts

    split, _, rest = spec.partition(":")
    category, _, count = rest.partition(":")
    chosen = select_prompts(read_suite(), split, [category], int(count or 4))
    if not chosen:
        sys.exit(f"--prompts {spec!r}: no prompts of {category!r} in the {split!r} split")
    return [p.text for p in chosen]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--variant", action="append", required=True, help="NAME=TREE[:MODEL[:DRAFT]]"
    )
    parser.add_argument(
        "--model", help="default: $SPECMLX_HOME/models/qwen2.5-coder-1.5b-instruct-int4"
    )
    parser.add_argument("--env", action="append", default=[], help="NAME:KEY=VALUE")
    parser.add_argument("--ranks", action="append", default=[], help="NAME:N")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--draft", default="-", help="a draft model: auto γ speculation")
    parser.add_argument("--prompts", help="SPLIT:CATEGORY:K from the suite")
    parser.add_argument("--passes", default="", help="K,K,...: time target passes too")
    args = parser.parse_args(argv)
    if args.model is None:
        from specmlx.paths import home

        args.model = str(home() / "models" / "qwen2.5-coder-1.5b-instruct-int4")
    variants: dict[str, dict] = {}
    for spec in args.variant:
        name, _, rest = spec.partition("=")
        tree, _, rest = rest.partition(":")
        model, _, draft = rest.partition(":")
        variants[name] = dict(
            tree=tree or "-", model=model or args.model, extra={}, draft=draft or args.draft
        )
    for spec in args.env:
        name, _, assignment = spec.partition(":")
        key, _, value = assignment.partition("=")
        if name not in variants or not key:
            parser.error(f"--env {spec!r}: want NAME:KEY=VALUE for a --variant NAME")
        variants[name]["extra"][key] = value
    ranks = {}
    for spec in args.ranks:
        name, _, count = spec.partition(":")
        if name not in variants or not count.isdigit() or int(count) < 1:
            parser.error(f"--ranks {spec!r}: want NAME:N for a --variant NAME")
        ranks[name] = int(count)
    options = dict(
        prompts=suite_prompts(args.prompts) if args.prompts else [],
        passes=[int(k) for k in args.passes.split(",") if k],
    )

    def run(name: str):
        v = variants[name]

        def once(r: int) -> dict:
            found = run_once(
                v["tree"], v["model"], v["extra"], args.tokens, v["draft"],
                ranks=ranks.get(name, 1), **options,
            )  # fmt: skip
            extra = "".join(
                f"; pass({k}) {ms:.1f} ms" for k, ms in found.get("pass_ms", {}).items()
            )
            if "all_sum_us" in found:
                extra += f"; all_sum {found['all_sum_us']:.0f} us"
            print(
                f"repeat {r + 1}: {name} {found['tps']:.2f} tok/s "
                f"(tokens {found['digest']}){extra}",
                flush=True,
            )
            return found

        return once

    runs = interleave({name: run(name) for name in variants}, args.repeat)
    rates = {name: [found["tps"] for found in values] for name, values in runs.items()}
    first = next(iter(variants))
    for name, values in rates.items():
        ratios = [a / b for a, b in zip(values, rates[first], strict=True)]
        print(
            f"{name}: median {median(values):.2f} tok/s; against {first} "
            f"{median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f}); "
            f"tokens {', '.join(sorted({found['digest'] for found in runs[name]}))}"
        )
