"""Microbenchmark: specmlx's native INT4 CPU matmul vs mx.quantized_matmul.

    python bench/native_matmul.py                       # full table (a few minutes)
    python bench/native_matmul.py --quick               # 4096x4096 only
    python bench/native_matmul.py --out bench/results/native_matmul.md
    python bench/native_matmul.py --activations         # float32 vs int8 x, 1.5B layers
    python bench/native_matmul.py --activations --model DIR   # and whole-model passes T(k)
    python bench/native_matmul.py --builds DIR_A DIR_B  # two builds of the kernel, int8 x

Shapes: a 4096x4096 layer and Qwen2.5-1.5B's linear layers (hidden 1536, intermediate
8960, vocab 151936), INT4 g64 with float32 activations and scales (what specmlx.load uses
on the CPU). Rows M = 1, 2, 4, 8 (decode and verify) and 32 (a prefill chunk). Each cell
is the median of several runs of one evaluated call, so MLX's per-call overhead is
included, as it is in a model. Two alternatives are timed too: a float32 matmul on weights
dequantized beforehand (the `--cpu-weights fp32` path; it uses OpenBLAS when
specmlx.cpu.blas finds one, and 8x the memory), and for M = 32 dequantize + matmul per call
(what large M would cost without the kernel).

--activations times the kernel's two modes instead (native.set_activations: float32 x, or
x quantized to int8 for integer dot products) on the 1.5B's INT4 layers at M = 1 ... 128,
the modes alternating within every repeat so that load from other processes hits both
alike; with --model, also one forward pass of that model over k tokens (on a short
prompt's cache, trimmed back after each pass), k = 1, 2, 4, 8, 16.

--builds times two builds of the extension (each DIR holds an _ext*.so built for this
mlx, e.g. from two commits' specmlx/cpu/_native) against each other in one process, the
builds alternating within every repeat: int8 x (--x float32: float32 x), 2 threads, at
M = 1, 2, 3, 8, on the 1.5B's gate/up and down projections (INT4) and the 1.5B head and
the 0.5B draft's sub-vocabulary head (8-bit), fp16 scales as checkpoints store them, the
4-bit ones in the packed layout where a build's tiles read it (packing.pack_layers).
Copies of each matrix (~300 MB in all) are cycled so that every call reads its weights
from DRAM, as a model's step does. --isa forces an instruction set in both. With --model,
also whole-model passes of that model over k = 1, 2, 4, 8 tokens (on a short prompt's
cache, trimmed back after), the builds alternating pass by pass, each serving every native
op of the pass (fused decoder layers, attention, norms, head) in turn. --rows and --passes
choose other Ms and ks (--passes 128: a prefill chunk).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

from specmlx.cpu import blas

blas.activate()  # before mlx is imported, so MLX's sgemm is OpenBLAS when there is one

import mlx.core as mx  # noqa: E402

from specmlx.cpu import native, ops  # noqa: E402

SHAPES = {  # name: (N output features, K input features)
    "4096x4096": (4096, 4096),
    "qwen1.5b q/o 1536x1536": (1536, 1536),
    "qwen1.5b k/v 256x1536": (256, 1536),
    "qwen1.5b gate/up 8960x1536": (8960, 1536),
    "qwen1.5b down 1536x8960": (1536, 8960),
    "qwen1.5b head 151936x1536": (151936, 1536),
}
ROWS = (1, 2, 4, 8, 32)
GROUP_SIZE = 64
ACTIVATION_ROWS = (1, 2, 4, 8, 16, 64, 128)
ACTIVATION_SHAPES = [name for name in SHAPES if name.startswith("qwen1.5b") and "head" not in name]
PASS_TOKENS = (1, 2, 4, 8, 16)
MODES = ("float32", "int8")
BUILD_SHAPES = {  # name: (N, K, bits, copies cycled)
    "qwen1.5b gate/up 8960x1536 (4-bit)": (8960, 1536, 4, 40),
    "qwen1.5b down 1536x8960 (4-bit)": (1536, 8960, 4, 40),
    "qwen1.5b head 151936x1536 (8-bit)": (151936, 1536, 8, 2),
    "qwen0.5b sub-vocab head 65536x896 (8-bit)": (65536, 896, 8, 4),
}
BUILD_ROWS = (1, 2, 3, 8)
BUILD_PASS_TOKENS = (1, 2, 4, 8)


def median_ms(fn: Callable[[], mx.array], reps: int) -> float:
    mx.eval(fn())  # warm-up: first-call allocation and page faults
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure(m: int, w, scales, biases, thread_counts: list[int], args) -> str:
    """The table cells after the row count, for x with m rows against one layer."""
    n, k = w.shape[0], w.shape[1] * 8
    x = mx.random.normal((m, k))
    mx.eval(x)

    def mlx_qmm() -> mx.array:
        return mx.quantized_matmul(
            x, w, scales, biases, transpose=True, group_size=GROUP_SIZE, bits=4
        )

    def ours() -> mx.array:
        return ops.quantized_matmul(x, w, scales, biases, GROUP_SIZE)

    def dequant_matmul() -> mx.array:
        return x @ mx.dequantize(w, scales, biases, group_size=GROUP_SIZE, bits=4).T

    def dense() -> mx.array:
        return x @ w_fp32.T

    ref = median_ms(mlx_qmm, args.mlx_reps)
    times = []
    for t in thread_counts:
        native.set_threads(t)
        times.append(median_ms(ours, args.reps))
    dense_cell = dequant_cell = "-"
    if n * k <= 4096 * 4096:  # the 151936-row head would need 0.9 GB as float32
        w_fp32 = mx.dequantize(w, scales, biases, group_size=GROUP_SIZE, bits=4)
        mx.eval(w_fp32)
        dense_cell = f"{median_ms(dense, args.reps):.3f}"
        del w_fp32
        if m >= 32:
            dequant_cell = f"{median_ms(dequant_matmul, args.mlx_reps):.2f}"
    native_cells = " | ".join(f"{t:.3f}" for t in times)
    return f"{ref:.2f} | {native_cells} | {ref / min(times):.1f}x | {dense_cell} | {dequant_cell} |"


def interleaved_ms(fns: dict[str, Callable[[], mx.array]], reps: int) -> dict[str, float]:
    """Median ms of each mode's call, the modes alternating within each repeat."""
    times: dict[str, list[float]] = {mode: [] for mode in fns}
    for mode, fn in fns.items():  # warm-up: allocation, page faults, first-call work
        native.set_activations(mode)
        mx.eval(fn())
    for _ in range(reps):
        for mode, fn in fns.items():
            native.set_activations(mode)
            t0 = time.perf_counter()
            mx.eval(fn())
            times[mode].append(time.perf_counter() - t0)
    return {mode: statistics.median(t) * 1e3 for mode, t in times.items()}


def compare_activations(args) -> list[str]:
    """Table rows: float32 vs int8 x per layer and M, then whole-model passes if asked."""
    lines = [
        "| layer (N x K) | M | float32 x | int8 x | int8 speedup | fp32 matmul, M >= 16 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    for name in ACTIVATION_SHAPES:
        n, k = SHAPES[name]
        mx.random.seed(0)
        w, scales, biases = mx.quantize(mx.random.normal((n, k)), group_size=GROUP_SIZE)
        # what a prefill path on weights dequantized once (--cpu-weights fp32) would cost
        dense = mx.dequantize(w, scales, biases, group_size=GROUP_SIZE)
        mx.eval(w, scales, biases, dense)
        for m in ACTIVATION_ROWS:
            x = mx.random.normal((m, k))
            mx.eval(x)

            def call(x=x, w=w, scales=scales, biases=biases) -> mx.array:
                return ops.quantized_matmul(x, w, scales, biases, GROUP_SIZE)

            reps = args.reps if m <= 16 else max(3, args.reps // 3)
            ms = interleaved_ms({mode: call for mode in MODES}, reps)
            f, q = ms["float32"], ms["int8"]
            sgemm = "-"
            if m >= 16 and blas.active_library():  # MLX's reference BLAS: not a contender
                sgemm = f"{median_ms(lambda x=x, dense=dense: x @ dense.T, reps):.3f}"
            row = f"| {name} | {m} | {f:.3f} | {q:.3f} | {f / q:.2f}x | {sgemm} |"
            lines.append(row)
            print(row, flush=True)
    if args.model:
        lines += model_passes(args)
    return lines


def model_passes(args) -> list[str]:
    """Table rows: one forward pass of the model over k tokens in each mode, and T(k)/T(1),
    as wall time and as the process's CPU time (which other processes' load inflates less;
    with several kernel threads it is their sum)."""
    from specmlx.bench import encode
    from specmlx.caches import make_cache, prefill, timed_pass
    from specmlx.loading import load

    model = load(args.model)
    ids = encode(model, "Write a python function that adds two numbers and explain it.", True)
    cache = make_cache(model.module)
    prefill(model, cache, ids)
    wall = {mode: {k: [] for k in PASS_TOKENS} for mode in MODES}
    cpu = {mode: {k: [] for k in PASS_TOKENS} for mode in MODES}
    for mode in MODES:  # a process's first passes pay one-time work
        native.set_activations(mode)
        for k in PASS_TOKENS:
            timed_pass(model, cache, ids[-k:])
    for _ in range(args.reps):
        for k in PASS_TOKENS:
            for mode in MODES:
                native.set_activations(mode)
                c0 = time.process_time()
                wall[mode][k].append(timed_pass(model, cache, ids[-k:]))
                cpu[mode][k].append(time.process_time() - c0)
    lines = [
        "",
        f"whole-model pass over k tokens, {model.name} ({len(ids)}-token prompt cached), "
        f"median of {args.reps}, {native.threads()} kernel threads:",
        "",
        "| k | float32 x ms | int8 x ms | int8 speedup | T(k)/T(1) float32 | T(k)/T(1) int8 "
        "| CPU ms float32 | CPU ms int8 | CPU T(k)/T(1) float32 | CPU T(k)/T(1) int8 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    med = {
        name: {
            mode: {k: statistics.median(t) * 1e3 for k, t in by_k.items()}
            for mode, by_k in d.items()
        }
        for name, d in (("wall", wall), ("cpu", cpu))
    }
    for k in PASS_TOKENS:
        cells = []
        for name in ("wall", "cpu"):
            f, q = med[name]["float32"][k], med[name]["int8"][k]
            f1, q1 = med[name]["float32"][1], med[name]["int8"][1]
            cells.append(f"{f:.1f} | {q:.1f} | " + (f"{f / q:.2f}x | " if name == "wall" else ""))
            cells.append(f"{f / f1:.2f} | {q / q1:.2f} |")
        lines.append(f"| {k} | " + " ".join(cells))
    print("\n".join(lines), flush=True)
    return lines


def load_build(directory: str):
    """The _ext module of the build in `directory`, loaded beside any other: each .so is its
    own library, and the module registers functions only, no types."""
    import glob
    import importlib.util

    found = glob.glob(os.path.join(directory, "_ext*.so"))
    if not found:
        sys.exit(f"no _ext*.so in {directory}; build specmlx/cpu/_native there first")
    spec = importlib.util.spec_from_file_location("specmlx.cpu._native._ext", found[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if module.built_for_mlx != mx.__version__:
        sys.exit(f"{found[0]} was built for mlx {module.built_for_mlx}, not {mx.__version__}")
    return module


def build_passes(args, builds: dict) -> list[str]:
    """Table rows: one forward pass of the model over k tokens on each build in turn."""
    from specmlx.bench import encode
    from specmlx.caches import make_cache, prefill, timed_pass
    from specmlx.loading import load

    model = load(args.model)
    ids = encode(model, "Write a python function that adds two numbers and explain it.", True)
    cache = make_cache(model.module)
    prefill(model, cache, ids)
    installed = native._ext
    wall = {d: {k: [] for k in args.passes} for d in builds}
    try:
        for rep in range(args.reps + 1):  # the first round pays one-time work
            for k in args.passes:
                tokens = (ids * (k // len(ids) + 1))[-k:]  # past the prompt: it repeated
                for d in builds:
                    native._ext = builds[d]
                    t = timed_pass(model, cache, tokens)
                    if rep:
                        wall[d][k].append(t)
    finally:
        native._ext = installed
    a, b = args.builds
    lines = [
        "",
        f"whole-model pass over k tokens, {model.name} ({len(ids)}-token prompt cached), "
        f"median of {args.reps}, each build serving every native op in turn:",
        "",
        "| k | A ms | B ms | A / B |",
        "|---:|---:|---:|---:|",
    ]
    for k in args.passes:
        ta, tb = (statistics.median(wall[d][k]) * 1e3 for d in (a, b))
        lines.append(f"| {k} | {ta:.1f} | {tb:.1f} | {ta / tb:.2f}x |")
    print("\n".join(lines), flush=True)
    return lines


def packed_copies(ext, mats: list[tuple], bits: int) -> list:
    """Each 4-bit matrix in the build's packed layout where its tiles read one (as
    packing.pack_layers gives a model's layers), else None: what a model's step runs."""
    if bits != 4 or not getattr(ext, "reads_packed", lambda: False)():
        return [None] * len(mats)
    packs = [ext.pack_quad(*mat, GROUP_SIZE) for mat in mats]
    mx.eval(packs)
    return packs


def compare_builds(args) -> list[str]:
    """Table rows: ms per call of each build, per matrix and M, builds interleaved."""
    builds = {directory: load_build(directory) for directory in args.builds}
    for ext in builds.values():
        ext.set_threads(2)
        ext.set_activations(args.x)
        if args.isa:
            ext.set_isa(args.isa)
    a, b = args.builds
    lines = [
        f"command: python {' '.join(sys.argv)}",
        f"cpu: {cpu_name()}, {os.cpu_count()} logical CPUs; {args.x} x, 2 threads, "
        f"isa {builds[a].isa()} (int8 tiles: A {builds[a].q8_kernel()}, "
        f"B {builds[b].q8_kernel()}); mlx {mx.__version__}",
        f"A = {a}, B = {b}; g{GROUP_SIZE}, fp16 scales, 4-bit matrices packed where a build's "
        f"tiles read that layout; ms per call, median of {args.reps} passes over the cycled "
        "copies, the builds interleaved",
        "",
        "| matrix | M | A ms | B ms | A / B | B GB/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    for name, (n, k, bits, copies) in BUILD_SHAPES.items():
        mx.random.seed(0)
        w, scales, biases = mx.quantize(mx.random.normal((n, k)), group_size=GROUP_SIZE, bits=bits)
        mats = [(w + 0, scales.astype(mx.float16) + 0, biases.astype(mx.float16) + 0)]
        mats += [tuple(t + 0 for t in mats[0]) for _ in range(copies - 1)]  # own buffers
        mx.eval(mats)
        del w, scales, biases
        gb = sum(t.nbytes for t in mats[0]) / 1e9
        packs = {d: packed_copies(ext, mats, bits) for d, ext in builds.items()}
        for m in args.rows:
            x = mx.random.normal((m, k))
            mx.eval(x)
            times: dict[str, list[float]] = {d: [] for d in builds}
            for rep in range(args.reps + 1):  # the first pass warms up
                for d, ext in builds.items():
                    t0 = time.perf_counter()
                    for mat, pack in zip(mats, packs[d], strict=True):
                        mx.eval(ext.quantized_matmul(x, *mat, GROUP_SIZE, bits, None, pack))
                    if rep:
                        times[d].append((time.perf_counter() - t0) / copies)
            ta, tb = (statistics.median(times[d]) * 1e3 for d in args.builds)
            row = f"| {name} | {m} | {ta:.3f} | {tb:.3f} | {ta / tb:.2f}x | {gb / tb * 1e3:.1f} |"
            lines.append(row)
            print(row, flush=True)
        del mats, packs
    if args.model:
        lines += build_passes(args, builds)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="only the 4096x4096 layer")
    parser.add_argument("--reps", type=int, default=9, help="timed runs of the native kernel")
    parser.add_argument("--mlx-reps", type=int, default=3, help="timed runs of mlx (slow)")
    parser.add_argument("--out", help="also write the table (markdown) to this file")
    parser.add_argument(
        "--activations", action="store_true", help="float32 vs int8 x on the 1.5B's layers"
    )
    parser.add_argument("--model", help="with --activations: also whole-model passes of this model")
    parser.add_argument("--builds", nargs=2, metavar="DIR", help="time two builds of _ext")
    parser.add_argument("--isa", help="with --builds: force avx512, avx2 or scalar in both")
    parser.add_argument(
        "--rows",
        type=int,
        nargs="+",
        default=list(BUILD_ROWS),
        help=f"with --builds: the Ms to time (default {' '.join(map(str, BUILD_ROWS))})",
    )
    parser.add_argument(
        "--passes",
        type=int,
        nargs="+",
        default=list(BUILD_PASS_TOKENS),
        help="with --builds --model: the k of the whole-model passes "
        f"(default {' '.join(map(str, BUILD_PASS_TOKENS))}; 128: a prefill chunk)",
    )
    parser.add_argument(
        "--x", choices=MODES, default="int8", help="with --builds: the activations (default int8)"
    )
    args = parser.parse_args()
    if args.builds:
        lines = compare_builds(args)
        if args.out:
            write(args.out, lines)
        return
    if not native.available():
        sys.exit(f"native kernel unavailable: {native.reason()}")
    if args.model and not (args.activations or args.builds):
        sys.exit("--model times whole-model passes for --activations or --builds; add one")
    if args.activations:
        before = native.activations()
        header = [
            f"command: python {' '.join(sys.argv)}",
            f"cpu: {cpu_name()}, {os.cpu_count()} logical CPUs; kernel: {native.describe()}; "
            f"int8 tiles: {native.q8_kernel()}",
            f"fp32 matmul BLAS: {blas.active_library() or 'MLX bundled (reference BLAS)'}",
            f"mlx {mx.__version__}; INT4 g{GROUP_SIZE}, float32 scales; ms per call, median of "
            f"{args.reps} (M <= 16) / {max(3, args.reps // 3)} (M > 16), the modes interleaved",
            "note: taken on a shared, noisy machine; compare the modes within a row",
            "",
        ]
        print("\n".join(header), flush=True)
        try:
            lines = header + compare_activations(args)
        finally:
            native.set_activations(before)
        if args.out:
            write(args.out, lines)
        return

    pool = native.threads()
    thread_counts = sorted({1, min(2, pool)} | ({pool} if pool <= 4 else set()))
    lines = [
        f"command: python {' '.join(sys.argv)}",
        f"cpu: {cpu_name()}, {os.cpu_count()} logical CPUs; kernel: {native.describe()}",
        f"fp32 matmul BLAS: {blas.active_library() or 'MLX bundled (reference BLAS)'}",
        f"mlx {mx.__version__}; INT4 g{GROUP_SIZE}, float32 x and scales; "
        f"median of {args.reps} (native) / {args.mlx_reps} (mlx) runs, ms per call",
        "note: taken on a shared, noisy machine; compare ratios within a row, not across runs",
        "",
        "| layer (N x K) | M | mx.quantized_matmul | "
        + " | ".join(f"native {t} thr" for t in thread_counts)
        + " | speedup (best) | fp32 matmul | dequant+matmul |",
        "|---|---:|---:|" + "---:|" * len(thread_counts) + "---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    shapes = {"4096x4096": SHAPES["4096x4096"]} if args.quick else SHAPES
    try:
        for name, (n, k) in shapes.items():
            mx.random.seed(0)
            w, scales, biases = mx.quantize(mx.random.normal((n, k)), group_size=GROUP_SIZE)
            mx.eval(w, scales, biases)
            for m in ROWS:
                row = f"| {name} | {m} | " + measure(m, w, scales, biases, thread_counts, args)
                lines.append(row)
                print(row, flush=True)
    finally:
        native.set_threads(pool)
    if args.out:
        write(args.out, lines)


def write(path: str, lines: list[str]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
