"""Does `mx.compile` pay on the CPU backend? Passes of the target and the draft, uncompiled
and compiled three ways, timed interleaved in one process, and their outputs compared.

    eager    the pass as specmlx runs it with SPECMLX_COMPILE=0
    modules  specmlx.compiled: each layer's norms, RoPE and MLP compiled (the default)
    fixed    the whole pass compiled at one cache length: its trace serves only that
             length (every step is a new one), so this is the bound, not a way to run
    whole    the whole pass compiled once for every length: the caches' buffers and an
             array offset are its inputs, an array mask hides the buffers' tail, so the
             attention is MLX's (the native op takes no mask)

Then plain decoding pipelined as the engine runs it, and generate(), with compiled
modules on and off; and a fresh kernel cache dir shows what the first compiled pass costs
where MLX must build its kernels with g++.

    python bench/compile_cpu.py
    python bench/compile_cpu.py --repeat 21 --json out.json
    python bench/compile_cpu.py --probes   # dispatch of no-op ops; MLX without a compiler
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from statistics import median

import mlx.core as mx
from mlx_lm.models.cache import KVCache

import specmlx
from specmlx import compiled
from specmlx.caches import checkpoint, make_cache, prefill, rewind, trim
from specmlx.cpu import describe, native

MODELS = Path.home() / ".cache/specmlx/models"
TARGET = MODELS / "qwen2.5-coder-1.5b-instruct-int4"
DRAFT = MODELS / "qwen2.5-coder-0.5b-instruct-int4"
EXTRA = MODELS / "gemma3-270m-int4"  # sliding windows: eager and modules only
TOKENS = [1000, 2000, 3000, 4000, 5000, 6000, 7000, 8000]
PROMPT = "def quicksort(items):\n    "


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return f"{fields.get('Model name', '?').strip()} ({fields.get('CPU(s)', '?').strip()} CPUs)"


def step_ops(model, cache: list) -> dict[str, int]:
    """The primitives of a one-token step's graph, by kind (MLX's dot export of it)."""
    module = model.module
    saved = checkpoint(cache)
    out = module(mx.array([TOKENS[:1]], mx.uint32), cache=cache)
    with tempfile.TemporaryDirectory() as tmp:
        dot = Path(tmp) / "step.dot"
        mx.export_to_dot(str(dot), out)
        kinds = Counter(re.findall(r'label ="?([A-Za-z]+)', dot.read_text()))
    mx.eval(out)
    rewind(model, cache, saved, [], 1)
    return dict(kinds.most_common())


class _TracedCache:
    """A KVCache as the `whole` trace sees it: its whole buffer, an array offset."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array):
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        start = mx.concatenate(
            [mx.zeros((2,), mx.int32), self.offset[None], mx.zeros((1,), mx.int32)]
        )
        self.keys = mx.slice_update(self.keys, keys, start, axes=(0, 1, 2, 3))
        self.values = mx.slice_update(self.values, values, start, axes=(0, 1, 2, 3))
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        queries = self.offset + mx.arange(n, dtype=mx.int32)[:, None]
        return mx.arange(self.keys.shape[2], dtype=mx.int32)[None] <= queries


def whole_pass(module):
    """forward(x, cache): the pass compiled once per (tokens, buffer length); the caches
    (prefilled plain KVCaches) advance as an uncompiled pass would advance them."""

    def run(x, offset, *buffers):
        views = [
            _TracedCache(buffers[i], buffers[i + 1], offset) for i in range(0, len(buffers), 2)
        ]
        logits = module(x, cache=views)
        return [logits, *(a for v in views for a in (v.keys, v.values))]

    traced = mx.compile(run)

    def forward(x: mx.array, cache: list) -> mx.array:
        n = x.shape[1]
        for c in cache:
            if c.offset + n > c.keys.shape[2]:
                raise ValueError("whole_pass: grow the buffers first (not needed here)")
        buffers = [a for c in cache for a in (c.keys, c.values)]
        for c in cache:
            c.keys = c.values = None  # the pass's buffers are its own: updated in place
        logits, *new = traced(x, mx.array(cache[0].offset, mx.int32), *buffers)
        del buffers
        for i, c in enumerate(cache):
            c.keys, c.values, c.offset = new[2 * i], new[2 * i + 1], c.offset + n
        return logits

    return forward


def fixed_pass(module):
    """forward(x, cache): the pass compiled whole at the cache's current length (a new
    trace per length, so only the bound); the cache is left as it was."""

    def run(offset, x, *buffers):
        views = []
        for i in range(0, len(buffers), 2):
            view = KVCache()
            view.keys, view.values, view.offset = buffers[i], buffers[i + 1], offset
            views.append(view)
        return module(x, cache=views)

    traced = {}

    def forward(x: mx.array, cache: list) -> mx.array:
        offset = cache[0].offset
        if offset not in traced:
            traced[offset] = mx.compile(lambda *a: run(offset, *a))
        return traced[offset](x, *(a for c in cache for a in (c.keys, c.values)))

    return forward


def passes(module, cache: list) -> dict:
    """Each variant as forward(x, cache) -> logits; `fixed` leaves the cache as it was.
    The whole-pass variants take plain KVCaches only (no sliding windows)."""

    def eager(x, cache):
        return module(x, cache=cache)

    variants = {"eager": eager, "modules": eager}
    if all(type(c) is KVCache for c in cache):
        variants.update(fixed=fixed_pass(module), whole=whole_pass(module))
    return variants


def run_pass(model, name: str, forward, x: mx.array, cache: list) -> mx.array:
    compiled.set_enabled(name == "modules")
    saved = checkpoint(cache)
    logits = forward(x, cache)
    mx.eval(logits)
    if name != "fixed":
        rewind(model, cache, saved, [], x.shape[1])
    return logits


def time_passes(model, cache: list, k: int, repeat: int) -> dict[str, float]:
    """Median ms of each variant's k-token pass, the variants interleaved."""
    x = mx.array([TOKENS[:k]], mx.uint32)
    variants = passes(model.module, cache)
    samples = {name: [] for name in variants}
    for name, forward in variants.items():  # the first pass of each traces (and builds)
        run_pass(model, name, forward, x, cache)
    for _ in range(repeat):
        for name, forward in variants.items():
            start = time.perf_counter()
            run_pass(model, name, forward, x, cache)
            samples[name].append(time.perf_counter() - start)
    return {name: round(median(s) * 1e3, 2) for name, s in samples.items()}


def exactness(model, cache: list, k: int = 4) -> dict[str, float]:
    """Max |difference| of logits: each compiled variant against eager, and a k-token
    pass against k one-token steps of the same variant (0 where rows are exact)."""
    x = mx.array([TOKENS[:k]], mx.uint32)
    variants = passes(model.module, cache)
    eager = run_pass(model, "eager", variants["eager"], x, cache)
    out = {}
    for name in ("modules", "whole"):
        if name not in variants:
            continue
        forward = variants[name]
        full = run_pass(model, name, forward, x, cache)
        compiled.set_enabled(name == "modules")
        saved = checkpoint(cache)
        steps = [forward(x[:, i : i + 1], cache) for i in range(k)]
        mx.eval(steps)
        rewind(model, cache, saved, [], k)
        out[f"{name} vs eager"] = mx.abs(full - eager).max().item()
        out[f"{name}: pass vs steps"] = mx.abs(full - mx.concatenate(steps, axis=1)).max().item()
        out[f"{name}: same argmax as eager"] = bool(
            mx.array_equal(full.argmax(-1), eager.argmax(-1))
        )
    compiled.set_enabled(True)
    return out


def measure_model(path: Path, ks: list[int], context: int, repeat: int) -> dict:
    model = specmlx.load(path)
    module = model.module
    compiled.patch_model(module)  # a no-op where loading did it
    cache = make_cache(module)
    prefill(model, cache, [t % 1000 + 100 for t in range(context)])
    compiled.set_enabled(False)
    ops = {"eager": step_ops(model, cache)}
    compiled.set_enabled(True)
    ops["modules"] = step_ops(model, cache)
    result = {
        "model": path.name,
        "ops per step": {name: sum(kinds.values()) for name, kinds in ops.items()},
        "op kinds": ops,
        "exactness": exactness(model, cache),
        "ms": {},
    }
    for k in ks:
        result["ms"][k] = time_passes(model, cache, k, repeat)
        print(path.name, k, result["ms"][k], flush=True)
    return result


def pipelined_decode(path: Path, context: int, chunks: int, n: int = 8) -> dict[str, float]:
    """ms per token of plain greedy decoding as the engine runs it (each step's pass
    queued before the previous token is read: Python builds one graph while the CPU runs
    the other), in chunks of n steps, compiled and not, the chunks interleaved."""
    model = specmlx.load(path)
    module = model.module
    compiled.patch_model(module)
    cache = make_cache(module)
    prefill(model, cache, [t % 1000 + 100 for t in range(context)])

    def step(token: mx.array) -> mx.array:
        logits = module(token.reshape(1, 1), cache=cache)[0, -1:]
        token = mx.argmax(logits, axis=-1).astype(mx.uint32)
        mx.async_eval(token)
        return token

    samples = {"eager": [], "modules": []}
    for i in range(chunks + 1):  # the first round warms both up
        for name in samples:
            compiled.set_enabled(name == "modules")
            start = time.perf_counter()
            queued = step(mx.array([TOKENS[0]], mx.uint32))
            for j in range(n):
                following = step(queued) if j + 1 < n else None
                queued.item()
                queued = following
            if i:
                samples[name].append((time.perf_counter() - start) / n)
            trim(cache, n)
    compiled.set_enabled(True)
    return {name: round(median(s) * 1e3, 2) for name, s in samples.items()}


def generation(target_path: Path, draft_path: Path, tokens: int, repeat: int) -> dict:
    """Decode tok/s of generate(), target alone and speculative (γ 3), compiled modules on
    and off interleaved (median, min, max of the runs); whether each run's tokens equal
    the uncompiled target alone's."""
    target = specmlx.load(target_path)
    draft = specmlx.load(draft_path, tokenizer_from=target)
    for model in (target, draft):
        compiled.patch_model(model.module)
    runs = {(on, gamma): [] for gamma in (0, 3) for on in (False, True)}
    outputs = {}
    for i in range(repeat + 1):  # the first round warms every variant up
        for on, gamma in runs:
            compiled.set_enabled(on)
            gen = specmlx.generate(
                target, PROMPT, draft=draft, max_tokens=tokens, num_draft=gamma
            ).run()
            outputs[(on, gamma)] = gen.tokens
            if i:
                runs[(on, gamma)].append(gen.stats.decode_tps)
    compiled.set_enabled(True)
    alone = outputs[(False, 0)]
    return {
        f"{'compiled' if on else 'uncompiled'}, gamma {gamma}": {
            "decode tok/s": [round(f(tps), 2) for f in (median, min, max)],
            "tokens equal the uncompiled target alone's": outputs[(on, gamma)] == alone,
        }
        for (on, gamma), tps in runs.items()
    }


def cold_start(target_path: Path) -> dict:
    """Child processes with an empty kernel cache dir each: their first three one-token
    steps, compiled (the first builds MLX's fused kernels with the C++ compiler) and not."""
    out = {}
    for setting in ("1", "0"):
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, TMPDIR=tmp, **{compiled.ENV: setting})
            cmd = [sys.executable, __file__, "--cold-probe", "--target", str(target_path)]
            run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        out[f"{compiled.ENV}={setting}, first three steps, s"] = json.loads(run.stdout)
    return out


def cold_probe(target_path: Path) -> None:
    model = specmlx.load(target_path)
    compiled.patch_model(model.module)
    cache = make_cache(model.module)
    prefill(model, cache, [t % 1000 + 100 for t in range(64)])
    times = []
    for token in TOKENS[:3]:
        start = time.perf_counter()
        mx.eval(model.module(mx.array([[token]], mx.uint32), cache=cache))
        times.append(round(time.perf_counter() - start, 3))
    print(json.dumps(times))


def noop_contiguous_ms(count: int, repeat: int) -> float:
    """Median ms of one graph of `count` mx.contiguous ops on arrays already contiguous
    and evaluated (what each INT4 matmul's wrapper adds four of): pure dispatch."""
    arrays = [mx.random.normal((64,)) for _ in range(count)]
    mx.eval(arrays)
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        mx.eval([mx.contiguous(a) for a in arrays])
        samples.append(time.perf_counter() - start)
    return round(median(samples) * 1e3, 2)


def without_compiler() -> dict:
    """A compiled function in a child process whose PATH has no C++ compiler and whose
    kernel cache dir is empty: its result against the same ops uncompiled, and how many
    kernels MLX built."""
    code = (
        "import mlx.core as mx; x = mx.linspace(-1, 1, 1000); "
        "f = lambda x: mx.arctan(mx.cosh(x)) * mx.erf(x) - mx.log1p(x + 2); "
        "print(mx.array_equal(mx.compile(f)(x), f(x)).item())"
    )
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as bare:
        env = dict(os.environ, TMPDIR=tmp, PATH=bare)
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        built = len(list(Path(tmp).rglob("*.so")))
    return {
        "rc": run.returncode,
        "equal": run.stdout.strip(),
        "stderr": run.stderr.strip(),
        "kernels built": built,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=TARGET)
    ap.add_argument("--draft", type=Path, default=DRAFT)
    ap.add_argument("--extra", type=Path, nargs="*", default=[EXTRA] if EXTRA.exists() else [])
    ap.add_argument("--context", type=int, default=300, help="tokens already in the caches")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32, help="tokens per generate() run")
    ap.add_argument("--runs", type=int, default=6, help="generate() runs per variant")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--probes",
        action="store_true",
        help="only the dispatch cost of no-op Contiguous ops and a run without a compiler",
    )
    ap.add_argument("--cold-probe", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    native.set_threads(args.threads)
    if args.cold_probe:
        cold_probe(args.target)
        return
    if args.probes:
        probes = {
            "788 no-op Contiguous, ms": noop_contiguous_ms(788, args.repeat),
            "a compiled function without a C++ compiler": without_compiler(),
        }
        print(json.dumps(probes, indent=1))
        return
    report = {
        "cpu": cpu_name(),
        "mlx": mx.__version__,
        "kernels": describe(),
        "context": args.context,
        "repeat": args.repeat,
        "target": measure_model(args.target, [1, 2, 4, 8], args.context, args.repeat),
        "draft": measure_model(args.draft, [1], args.context, args.repeat),
        "extra": [measure_model(p, [1, 4], args.context, args.repeat) for p in args.extra],
    }
    report["pipelined decode, ms/token"] = {
        model.name: pipelined_decode(model, args.context, args.repeat)
        for model in (args.target, args.draft)
    }
    print(report["pipelined decode, ms/token"], flush=True)
    report["generate"] = generation(args.target, args.draft, args.tokens, args.runs)
    print(json.dumps(report["generate"], indent=1), flush=True)
    report["cold start"] = cold_start(args.target)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        tmp = args.json.with_suffix(args.json.suffix + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
