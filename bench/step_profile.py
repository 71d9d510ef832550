"""Where one decode step's time goes: the parts of a one-token target pass, timed apart.

A step is timed whole (graph building and eval), then its parts are each run alone at
the same shapes, in one graph per part, so each is the time the part costs when nothing
else runs: every linear layer of the blocks (the INT4 kernel; then each kind of layer
alone, with its GB/s: small layers can lag where the big ones stream), the output head, the
attention over the cache, and the Python that builds the step's graph. What is left of
the step is norms, RoPE, residual adds, the cache writes and MLX's per-op dispatch. The
floor is the bytes the step must read (every weight but the embedding table, of which
one row) over this machine's DRAM read rate, measured here with all threads reading.

    python -m bench step_profile --model $SPECMLX_HOME/models/qwen2.5-coder-1.5b-instruct-int4
    python -m bench step_profile --model DIR --context 512 --repeat 30 --json out.json
"""

from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from bench.timing import cpu_name, median, median_seconds, portable, seconds, write_atomic
from bench.timing import timed as timed_call
from specmlx.caches import make_cache, prefill, timed_pass
from specmlx.cpu import native
from specmlx.cpu.attention import scaled_dot_product_attention
from specmlx.loading import load


def dram_read_gbs(threads: int, gib: float = 1.0, repeat: int = 5) -> float:
    """GB/s of summing a buffer far larger than the caches, split over `threads` (numpy
    releases the GIL in its reductions)."""
    data = np.ones(int(gib * 2**30) // 8, np.float64)
    parts = np.array_split(data, threads)

    def read() -> float:
        workers = [threading.Thread(target=np.sum, args=(p,)) for p in parts]

        def run() -> None:
            for w in workers:
                w.start()
            for w in workers:
                w.join()

        return seconds(run)

    read()
    return data.nbytes / min(read() for _ in range(repeat)) / 1e9


def timed(build, repeat: int) -> float:
    """Median seconds of building and evaluating the graph `build()` returns, after one
    untimed run (the first pays one-time work)."""
    return median_seconds(lambda: mx.eval(build()), repeat)


def parameter_bytes(m: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(m.parameters()))


def block_linears(module: nn.Module) -> dict[str, tuple[nn.Module, int]]:
    """The quantized linear layers inside the transformer blocks (not the head), by name,
    with the bytes a call reads. A stacked q/k/v (qkv.patch_projections) is one op that
    q's call runs for all three: it is timed once, as `q/k/v (stacked)`."""
    found = {}
    for name, m in module.named_modules():
        if not isinstance(m, nn.QuantizedLinear) or ".layers." not in f".{name}":
            continue
        stack = getattr(m, "_stack", None)
        if stack is None:
            found[name] = (m, parameter_bytes(m))
        elif m._slot == 0:
            stacked = f"{name.rsplit('.', 1)[0]}.q/k/v (stacked)"
            found[stacked] = (m, sum(parameter_bytes(layer) for layer in stack.layers))
    return found


def by_kind(names: list[str]) -> dict[str, list[int]]:
    """Indices of the layers of each kind, the last part of a name (q_proj, down_proj, …):
    a kind's layers share one shape, so its GB/s shows how the kernel does at that shape."""
    kinds: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        kinds.setdefault(name.rsplit(".", 1)[-1], []).append(i)
    return kinds


def head_of(module: nn.Module):
    lm_head = getattr(module, "lm_head", None)
    if lm_head is not None:
        return lm_head
    return module.model.embed_tokens.as_linear


def attention_shapes(module: nn.Module, cache: list) -> list[tuple[int, int, int, int]]:
    """(heads, kv heads, head dim, cached length) per attention layer."""
    shapes = []
    for layer, c in zip(module.model.layers, cache, strict=True):
        attn = getattr(layer, "self_attn", None)
        keys = getattr(c, "keys", None)
        if keys is None or not hasattr(attn, "n_heads"):
            continue
        shapes.append((attn.n_heads, attn.n_kv_heads, keys.shape[-1], c.offset))
    return shapes


def step_bytes(module: nn.Module) -> int:
    """Bytes a one-token step reads: every parameter but the embedding table (one row),
    which a tied head reads whole as the head."""
    tied = getattr(module, "lm_head", None) is None
    total = 0
    for name, value in tree_flatten(module.parameters()):
        if name.startswith("model.embed_tokens.") and not tied:
            total += value.nbytes // value.shape[0]
        else:
            total += value.nbytes
    return total


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--context", type=int, default=256, help="tokens already in the cache")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    model = load(args.model)
    module = model.module
    cache = make_cache(module)
    prefill(model, cache, [int(t) % 1000 + 100 for t in range(args.context)])
    token = [1000]
    timed_pass(model, cache, token)

    dtype = mx.float32 if model.dtype == "float32" else getattr(mx, model.dtype)
    named = block_linears(module)
    linears = [m for m, _ in named.values()]
    layer_bytes = [n for _, n in named.values()]
    kinds = by_kind(list(named))
    xs = [mx.random.normal((1, 1, m.weight.shape[1] * 32 // m.bits)).astype(dtype) for m in linears]
    head = head_of(module)
    hidden = mx.random.normal((1, 1, module.args.hidden_size)).astype(dtype)
    shapes = attention_shapes(module, cache)
    qkv = [
        (
            mx.random.normal((1, h, 1, d)).astype(dtype),
            mx.random.normal((1, kv, n, d)).astype(dtype),
            mx.random.normal((1, kv, n, d)).astype(dtype),
        )
        for h, kv, d, n in shapes
    ]
    mx.eval(xs, hidden, qkv)

    def attention():  # the model's own: the native op, or MLX's (SPECMLX_ATTENTION)
        return [
            scaled_dot_product_attention(q, k, v, cache=None, scale=q.shape[-1] ** -0.5, mask=None)
            for q, k, v in qkv
        ]

    def build_only() -> float:
        samples = []
        for _ in range(args.repeat):
            out, took = timed_call(lambda: module(mx.array([token], mx.uint32), cache=cache))
            samples.append(took)
            mx.eval(out)
            for c in cache:
                c.trim(1)
        return median(samples)

    def step() -> float:
        return median(timed_pass(model, cache, token) for _ in range(args.repeat))

    def layers(which: list[int] | None = None):
        chosen = range(len(linears)) if which is None else which
        return [linears[i](xs[i]) for i in chosen]

    parts: dict[str, list[float]] = {}
    per_kind: dict[str, list[float]] = {}
    for _ in range(3):  # interleaved: load on the machine moves every part alike
        for name, run in (
            ("step", step),
            ("linear layers", lambda: timed(layers, args.repeat)),
            ("head", lambda: timed(lambda: head(hidden), args.repeat)),
            ("attention", lambda: timed(attention, args.repeat)),
            ("graph building (Python)", build_only),
        ):
            parts.setdefault(name, []).append(run())
        for kind, which in kinds.items():
            per_kind.setdefault(kind, []).append(timed(lambda w=which: layers(w), args.repeat))
    ms = {name: median(v) * 1e3 for name, v in parts.items()}
    ms["the rest"] = ms["step"] - sum(v for k, v in ms.items() if k != "step")
    threads = native.threads() if native.available() else 1
    gbs = dram_read_gbs(threads)
    floor = step_bytes(module) / gbs / 1e6
    kind_rows = {}
    for kind, which in kinds.items():
        kind_s = median(per_kind[kind])
        nbytes = sum(layer_bytes[i] for i in which)
        kind_rows[kind] = {
            "layers": len(which),
            "ms": round(kind_s * 1e3, 2),
            "us_per_layer": round(kind_s / len(which) * 1e6, 1),
            "gb_s": round(nbytes / kind_s / 1e9, 1),
        }
    result = {
        "model": portable(args.model),
        "cpu": cpu_name(),
        "kernel": native.describe() if native.available() else native.reason(),
        "mlx": mx.__version__,
        "context": args.context,
        "ms": {k: round(v, 2) for k, v in ms.items()},
        "linear_layers_by_kind": kind_rows,
        "step_bytes": step_bytes(module),
        "dram_read_gbs": round(gbs, 1),
        "floor_ms": round(floor, 2),
    }
    print(f"{result['model']}\n{result['cpu']}; kernel {result['kernel']}; mlx {mx.__version__}")
    print("| part | ms | share of the step |\n| --- | --- | --- |")
    for name, v in ms.items():
        print(f"| {name} | {v:.1f} | {v / ms['step']:.0%} |")
    print(
        f"floor: {result['step_bytes'] / 1e6:.0f} MB read per step at {gbs:.1f} GB/s "
        f"({threads} threads) = {floor:.1f} ms; the step is {ms['step'] / floor:.2f}x the floor"
    )
    print("\n| linear layers | n | ms | µs each | GB/s |\n| --- | --- | --- | --- | --- |")
    for kind, row in kind_rows.items():
        cells = (kind, row["layers"], f"{row['ms']:.2f}", row["us_per_layer"], row["gb_s"])
        print("| " + " | ".join(map(str, cells)) + " |")
    if args.json:
        write_atomic(args.json, json.dumps(result, indent=1))
