"""Target step time T(k) for k new tokens: is verifying k tokens as cheap as one?

    python bench/blas_verify.py                                  # 0.5B and 1.5B, 5 reps
    python bench/blas_verify.py --sizes 0.5B --reps 5 --out bench/results/blas_verify.md

Speculation pays only when T(k)/T(1) stays near 1 (memory-bound). For random-init
Qwen2.5-0.5B / 1.5B shapes (mlx-lm's qwen2 Model; INT4 g64 with float32 scales and
activations, as specmlx.load uses on the CPU) it times one forward of k = 1, 2, 4, 8 new
tokens on a 128-token KV cache, in these modes:

    int4-mx          mx.quantized_matmul (MLX's CPU kernel)
    int4-native-N    specmlx's native INT4 kernel with N threads, when built (one worker
                     per N: its thread pool is sized once)
    fp32-netlib      INT4 expanded to float32 (specmlx.cpu.fp32.expand_quantized), mlx's
                     bundled reference BLAS
    fp32-openblas-N  the same weights on OpenBLAS (specmlx.cpu.blas.activate), N threads

A BLAS is chosen per process, so modes live in two worker processes (reference BLAS,
OpenBLAS) that the parent drives one call at a time: every repetition runs every mode
and k back to back, the mode order rotating each repetition, so a busy minute on a
shared machine lands on all modes alike. Cells are the median over repetitions, with
min-max. The cache is filled with random keys and values instead of a real prefill: the
step cost depends on the cache length, not its contents, and a 128-token prefill on the
reference BLAS takes minutes for 1.5B.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import select
import statistics
import subprocess
import sys
import time

SIZES = {  # Qwen2.5 configs (both tie the output head to the embedding)
    "0.5B": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2},
    "1.5B": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
             "num_attention_heads": 12, "num_key_value_heads": 2},
}  # fmt: skip
COMMON = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
}
KS = (1, 2, 4, 8)
CONTEXT = 128
GROUP_SIZE = 64
STEP_TIMEOUT_S = 900  # a hung worker is reported, not waited for


# ---- worker: one BLAS per process ------------------------------------------------------


def worker(kind: str, size: str) -> None:
    """Build the models, then answer {"mode", "threads", "k"} lines with step times."""
    from specmlx.cpu import blas

    if kind == "openblas":
        why = blas.activate()  # before mlx is imported, so libmlx binds OpenBLAS
        if why:
            print(json.dumps({"error": why}), flush=True)
            return
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import qwen2
    from mlx_lm.models.cache import make_prompt_cache

    from specmlx.cpu import native, quantized
    from specmlx.cpu.fp32 import expand_quantized

    mx.set_default_device(mx.cpu)
    args = qwen2.ModelArgs.from_dict({**COMMON, **SIZES[size]})

    def int4_model():
        mx.random.seed(0)
        model = qwen2.Model(args)
        nn.quantize(model, group_size=GROUP_SIZE, bits=4)
        return model

    models = {}
    base = int4_model()
    mx.eval(base.parameters())
    if kind == "native":
        if not native.available():
            print(json.dumps({"error": native.reason()}), flush=True)
            return
        quantized.patch_model(base)
        models["int4-native"] = base
    if kind == "reference":
        models["int4-mx"] = base
    if kind in ("reference", "openblas"):
        fp32 = int4_model()
        fp32.update(base.parameters())
        expand_quantized(fp32)
        mx.eval(fp32.parameters())
        models["fp32-netlib" if kind == "reference" else "fp32-openblas"] = fp32
    del base

    caches = {}
    for name, model in models.items():
        cache = make_prompt_cache(model)
        head_dim = args.hidden_size // args.num_attention_heads
        shape = (1, args.num_key_value_heads, CONTEXT, head_dim)
        for c in cache:
            c.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
        mx.eval([c.state for c in cache])
        caches[name] = cache

    def step(name: str, k: int) -> float:
        tokens = mx.random.randint(0, args.vocab_size, (1, k))
        mx.eval(tokens)
        t0 = time.perf_counter()
        mx.eval(models[name](tokens, cache=caches[name]))
        elapsed = time.perf_counter() - t0
        for c in caches[name]:
            c.trim(k)  # back to CONTEXT tokens
        return elapsed

    for name in models:  # warm-up: first-call allocations and page faults
        step(name, 1)
    info = blas.blas_info(probe=True)
    print(json.dumps({"ready": sorted(models), "blas": info, "native": native.describe()}))
    sys.stdout.flush()
    for line in sys.stdin:
        request = json.loads(line)
        if request["mode"] == "fp32-openblas":
            blas.set_threads(request["threads"])
        times = {k: step(request["mode"], k) for k in request["k"]}
        print(json.dumps({"times": times}), flush=True)


# ---- parent: interleave the workers -----------------------------------------------------


def start_worker(kind: str, size: str, threads: int = 1) -> tuple[subprocess.Popen, dict]:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)  # each worker picks its own BLAS
    env.pop("SPECMLX_BLAS_REEXEC", None)
    # The native kernel's pool is sized once, at its first use (set_threads between calls
    # hung here), so each native thread count gets its own worker; others do without it.
    env["SPECMLX_NATIVE"] = "1" if kind == "native" else "0"
    env["SPECMLX_THREADS"] = str(threads)
    if kind == "reference":
        env["SPECMLX_FAST_BLAS"] = "0"
    proc = subprocess.Popen(
        [sys.executable, __file__, "--worker", kind, "--size", size],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    hello = read_reply(proc, STEP_TIMEOUT_S)
    if hello is None or "error" in hello:
        proc.kill()
        raise SystemExit(f"{kind} worker: {hello['error'] if hello else 'no answer'}")
    return proc, hello


def read_reply(proc: subprocess.Popen, timeout: float) -> dict | None:
    """The worker's next JSON line, or None when it hangs or dies."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    return json.loads(line) if line else None


def ask(proc: subprocess.Popen, mode: str, threads: int, ks: tuple[int, ...]) -> dict | None:
    proc.stdin.write(json.dumps({"mode": mode, "threads": threads, "k": list(ks)}) + "\n")
    proc.stdin.flush()
    reply = read_reply(proc, STEP_TIMEOUT_S)
    return {int(k): t for k, t in reply["times"].items()} if reply else None


def run_size(size: str, reps: int, threads: list[int], native_threads: list[int], log) -> dict:
    workers = {"reference": start_worker("reference", size)}
    workers |= {f"native-{n}": start_worker("native", size, n) for n in native_threads}
    workers["openblas"] = start_worker("openblas", size)
    modes = [("int4-mx", "reference", "int4-mx", 1)]  # (label, worker, mode, threads)
    modes += [(f"int4-native-{n}", f"native-{n}", "int4-native", n) for n in native_threads]
    modes.append(("fp32-netlib", "reference", "fp32-netlib", 1))
    modes += [(f"fp32-openblas-{n}", "openblas", "fp32-openblas", n) for n in threads]
    samples = {label: {k: [] for k in KS} for label, *_ in modes}
    failed = {}
    for rep in range(reps):
        order = modes[rep % len(modes) :] + modes[: rep % len(modes)]
        for label, kind, mode, n in order:
            if kind in failed:
                continue
            ks = KS if rep % 2 == 0 else tuple(reversed(KS))
            times = ask(workers[kind][0], mode, n, ks)
            if times is None:
                failed[kind] = f"no answer within {STEP_TIMEOUT_S} s in rep {rep + 1}"
                workers[kind][0].kill()
                log(f"{size} {label}: {failed[kind]}")
                continue
            for k, t in times.items():
                samples[label][k].append(t)
        log(f"{size} rep {rep + 1}/{reps} done, load {os.getloadavg()[0]:.1f}")
    for kind, (proc, _) in workers.items():
        if kind not in failed:
            proc.stdin.close()
            proc.wait()
    return {
        "samples": {label: by_k for label, by_k in samples.items() if by_k[1]},
        "failed": failed,
        "blas": {kind: hello["blas"] for kind, (_, hello) in workers.items()},
        "native": [hello["native"] for kind, (_, hello) in workers.items() if "native" in kind],
    }


def table(size: str, result: dict) -> list[str]:
    lines = [
        f"### Qwen2.5-{size} shapes (random weights), ms per target step after {CONTEXT} tokens",
        "",
        "| mode | T(1) ms | T(2)/T(1) | T(4)/T(1) | T(8)/T(1) | T(8) ms | T(1) min-max |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, by_k in result["samples"].items():
        med = {k: statistics.median(v) * 1e3 for k, v in by_k.items()}
        lo, hi = min(by_k[1]) * 1e3, max(by_k[1]) * 1e3
        ratios = " | ".join(f"{med[k] / med[1]:.2f}" for k in KS[1:])
        lines.append(f"| {label} | {med[1]:.0f} | {ratios} | {med[8]:.0f} | {lo:.0f}-{hi:.0f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0.5B,1.5B")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", default="1,2", help="OpenBLAS thread counts")
    parser.add_argument("--native-threads", default="1", help="native INT4 kernel threads")
    parser.add_argument("--out", help="write the markdown table here (and .json beside it)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.size)
        return

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    threads = [int(n) for n in args.threads.split(",")]
    native_threads = [int(n) for n in args.native_threads.split(",") if n]
    from specmlx.cpu import native

    if not native.available():
        log(f"native INT4 kernel unavailable ({native.reason()}): no int4-native rows")
        native_threads = []
    load_start = os.getloadavg()
    started = time.time()
    results = {}
    for size in args.sizes.split(","):
        results[size] = run_size(size, args.reps, threads, native_threads, log)
    command = "python bench/blas_verify.py " + " ".join(sys.argv[1:])
    import mlx.core as mx

    lines = [
        "## T(k): verify cost vs k, INT4 vs float32 on the reference BLAS and on OpenBLAS",
        "",
        f"`{command}`",
        "",
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"mlx {mx.__version__}; load average {load_start[0]:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end; {time.time() - started:.0f} s; "
        f"median of {args.reps} interleaved reps (T(1) range shown).",
        "",
    ]
    first = next(iter(results.values()))
    for kind, info in first["blas"].items():
        lines.append(f"- {kind} worker: {info['name']} ({info.get('gflops', 0):.0f} GFLOP/s probe)")
    lines += [f"- native INT4: {text}" for text in first["native"]]
    lines.append("")
    for size, result in results.items():
        lines += table(size, result)
        lines += [f"- {kind} worker failed: {why}" for kind, why in result["failed"].items()]
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump({"command": command, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
