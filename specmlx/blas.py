"""The memory-bound CPU path: a fast BLAS under MLX's CPU matmuls, and float32 weights for it.

Why: MLX's CPU INT4 matmul costs about k times one token to verify k tokens, so
speculation cannot pay. Dense float32 matmuls go to BLAS (`cblas_sgemm`), and with a
real BLAS verifying 8 tokens costs about 1.2 times one: the memory-bound regime where
speculation pays. But the `mlx[cpu]` wheel on Linux links the netlib reference BLAS
(mlx_cpu.libs/libblas-*.so.3.10.0), which is 2-3x slower than OpenBLAS at one token and
linear in k. So specmlx puts OpenBLAS in front of it:

    pip install 'specmlx[cpu-fast]'              # ngsolve-openblas: OpenBLAS 0.3.33, DYNAMIC_ARCH
    apt-get install libopenblas0-pthread         # or Debian/Ubuntu's OpenBLAS
    specmlx generate -m TARGET -d DRAFT --cpu-weights fp32 -p "..."

How: libmlx.so binds `cblas_sgemm` when it is loaded, looking in the process's global
scope before its own dependencies. So the CLI loads OpenBLAS with RTLD_GLOBAL before
anything imports mlx (`activate`), and MLX's matmuls run on it with no environment
tricks. When that cannot work in-process (mlx already imported, or OpenBLAS needs a
libgfortran.so.5 the system lacks: the pip wheel links it, and mlx[cpu] bundles one under
a hashed name), the CLI re-executes itself once with LD_PRELOAD (and LD_LIBRARY_PATH
pointing at a link to mlx's libgfortran); SPECMLX_BLAS_REEXEC marks the child so it
never loops. Library users call `specmlx.blas.activate()` before importing mlx.

Knobs (environment):
    SPECMLX_FAST_BLAS=0     keep MLX's bundled BLAS (CLI: `specmlx --no-fast-blas ...`)
    SPECMLX_NO_REEXEC=1     never re-exec; use a fast BLAS only if it loads in-process
    SPECMLX_BLAS=PATH       the BLAS library to use (must export plain `cblas_sgemm`;
                            scipy-openblas32/64 export `scipy_cblas_sgemm` and cannot)
    SPECMLX_THREADS=N       BLAS threads (shared with the native INT4 kernel)
    OPENBLAS_CORETYPE       left alone when set; else set from /proc/cpuinfo, because
                            Debian's OpenBLAS 0.3.21 picks its slowest kernels (Prescott,
                            5x slower prefill) on CPUs it does not know, as in many VMs

Threads: MLX runs each stream on one thread, and OpenBLAS adds its own. On a quiet
2-core machine 2 BLAS threads doubled fp32 decode; with other processes busy, the spinning
BLAS threads collapsed it 6x. So the default is deliberate: the CPUs this process may use
minus the 1-minute load average (rounded, at least 1), and `blas_info()` reports the
count and why. Set SPECMLX_THREADS for reproducible benchmarks.

CPU weights: `expand_quantized` turns QuantizedLinear / QuantizedEmbedding (tied heads
included) into float32 Linear / Embedding holding `mx.dequantize`d weights, lazily, so the
packed weights are read and expanded layer by layer. `pick_cpu_weights` decides for
`auto`: float32 on the CPU backend when a fast BLAS is active, no native INT4 kernel
covers the layers, and params x 4 bytes x 1.3 fit in available memory, else the
checkpoint's INT4. Float32 on OpenBLAS is flat in k (1.5B: T(8)/T(1) = 1.08), but the
native INT4 kernel reads 8x fewer bytes and is faster at every k up to 8
(bench/results/blas_verify.md; real 0.5B: 8.8 vs 2.3 tok/s decode).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from .errors import SpecmlxError

ENV_FAST = "SPECMLX_FAST_BLAS"
ENV_NO_REEXEC = "SPECMLX_NO_REEXEC"
ENV_LIB = "SPECMLX_BLAS"
ENV_THREADS = "SPECMLX_THREADS"
ENV_GUARD = "SPECMLX_BLAS_REEXEC"

# Where distributions put OpenBLAS; the pthread build first (OpenMP's would fight MLX's threads).
SYSTEM_CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
]
PIP_PACKAGE = "ngsolve_openblas"  # the `cpu-fast` extra: standard CBLAS names, DYNAMIC_ARCH

# Recorded by activate() / setup_cli(): how the fast BLAS got here and why this many threads.
_state: dict = {"how": "", "threads_why": "", "error": ""}


def _fast_disabled() -> bool:
    return os.environ.get(ENV_FAST, "1").strip().lower() in ("0", "no", "false", "off")


def find_fast_blas() -> Path | None:
    """A fast BLAS library to interpose: $SPECMLX_BLAS, the pip extra, or the system's."""
    explicit = os.environ.get(ENV_LIB)
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise SpecmlxError(f"{ENV_LIB}={explicit} is not a file; unset it or fix the path")
        return path
    spec = importlib.util.find_spec(PIP_PACKAGE)  # found, not imported: its __init__ loads it
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            libs = sorted(Path(folder).glob("libopenblas*.so*"))
            if libs:
                return libs[0]
    for candidate in SYSTEM_CANDIDATES:
        if Path(candidate).is_file():
            return Path(candidate)
    found = ctypes.util.find_library("openblas")
    return Path(found) if found and Path(found).is_absolute() else None


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def default_threads() -> tuple[int, str]:
    """BLAS threads to use, and why: SPECMLX_THREADS, else the CPUs not busy right now."""
    text = os.environ.get(ENV_THREADS, "").strip()
    if text:
        try:
            n = int(text)
        except ValueError:
            raise SpecmlxError(f"{ENV_THREADS} must be a positive integer, got {text!r}") from None
        if n < 1:
            raise SpecmlxError(f"{ENV_THREADS} must be >= 1, got {n}")
        return n, ENV_THREADS
    cpus = _cpus()
    load = os.getloadavg()[0]
    # Oversubscribed BLAS threads spin and collapse throughput, so only count idle CPUs.
    n = max(1, min(cpus, math.floor(cpus - load + 0.5)))
    return n, f"auto: {cpus} CPUs, load {load:.1f}"


def _coretype() -> str:
    """An OpenBLAS core type this CPU surely runs, from /proc/cpuinfo ('' if unsure)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return ""


def _blas_env(threads: int) -> dict:
    """Environment OpenBLAS reads when it initialises: thread pool size and kernels."""
    env = {"OPENBLAS_NUM_THREADS": str(threads)}
    if not os.environ.get("OPENBLAS_CORETYPE") and _coretype():
        env["OPENBLAS_CORETYPE"] = _coretype()
    return env


def _mlx_loaded() -> bool:
    return "mlx.core" in sys.modules


def _gfortran_dirs() -> list[Path]:
    """LD_LIBRARY_PATH folders that provide libgfortran.so.5 from mlx[cpu]'s bundled copy.

    A folder with a libgfortran.so.5 link to it, then mlx_cpu.libs itself, where that
    copy finds its own hashed libquadmath. Empty when mlx bundles none.
    """
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return None
    bundled = Path(list(spec.submodule_search_locations)[0]).parent / "mlx_cpu.libs"
    copies = sorted(bundled.glob("libgfortran-*.so.5*"))
    if not copies:
        return []
    from .paths import home

    folder = home() / "lib"
    link = folder / "libgfortran.so.5"
    if not (link.exists() and link.resolve() == copies[0].resolve()):
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".libgfortran.so.5.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(copies[0])
        tmp.replace(link)  # atomic: concurrent starts never see a half-made link
    return [folder, bundled]


def activate(threads: int | None = None) -> str:
    """Load a fast BLAS into this process's global scope, before mlx is imported.

    Returns '' on success (or when there is nothing to do), else why it could not.
    """
    if _fast_disabled():
        return f"disabled by {ENV_FAST}=0"
    if sys.platform != "linux":
        return ""  # macOS: MLX uses Accelerate already
    if active_library() is not None:
        return ""  # already here (LD_PRELOAD, or a second call)
    lib = find_fast_blas()
    if lib is None:
        return "no fast BLAS: pip install 'specmlx[cpu-fast]' or apt install libopenblas0-pthread"
    if _mlx_loaded():
        return "mlx was imported before the fast BLAS could be loaded"
    n, why = (threads, "argument") if threads else default_threads()
    for key, value in _blas_env(n).items():
        os.environ.setdefault(key, value)
    try:
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        return f"cannot load {lib}: {e}"
    _state.update(how="in-process", threads_why=why)
    return ""


def setup_cli(no_fast_blas: bool = False) -> None:
    """At CLI start: put a fast BLAS under MLX, in-process or by re-executing once."""
    if no_fast_blas:
        os.environ[ENV_FAST] = "0"  # so the stats say why, and a re-exec'd child agrees
    if os.environ.get(ENV_GUARD):
        _state.update(how="LD_PRELOAD", threads_why=os.environ[ENV_GUARD])
        return  # the child of our own re-exec: whatever it has, it keeps
    why = activate()
    _state["error"] = why
    if not why or _fast_disabled() or os.environ.get(ENV_NO_REEXEC) == "1":
        return
    lib = find_fast_blas()
    if lib is None:
        return
    env = dict(os.environ)
    n, threads_why = default_threads()
    env.update(_blas_env(n))
    env[ENV_GUARD] = threads_why
    env["LD_PRELOAD"] = ":".join(filter(None, [str(lib), env.get("LD_PRELOAD")]))
    if "libgfortran" in why:
        folders = [str(f) for f in _gfortran_dirs()]
        if not folders:
            return
        env["LD_LIBRARY_PATH"] = ":".join(filter(None, [*folders, env.get("LD_LIBRARY_PATH")]))
    # A preloaded library that fails to load kills every process started with it, so try
    # the environment on a bare interpreter first (~20 ms, and only on this rare path).
    check = subprocess.run([sys.executable, "-S", "-c", ""], env=env, capture_output=True)
    if check.returncode != 0:
        _state["error"] = f"{why}; LD_PRELOAD failed too: {check.stderr.decode().strip()}"
        return
    sys.stdout.flush()
    sys.stderr.flush()
    # orig_argv is the command line as typed (python, -m/-c or the script, the arguments).
    os.execve(sys.executable, sys.orig_argv, env)


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def active_library() -> Path | None:
    """The library whose `cblas_sgemm` is in the global scope (what libmlx binds first).

    None means only MLX's own dependency provides it: the bundled reference BLAS on
    Linux. On macOS MLX links Accelerate directly and this returns None too.
    """
    if sys.platform != "linux":
        return None
    process = ctypes.CDLL(None)
    try:
        address = ctypes.cast(process.cblas_sgemm, ctypes.c_void_p).value
    except AttributeError:
        return None
    info = _DlInfo()
    if not process.dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.dli_fname:
        return None
    return Path(os.fsdecode(info.dli_fname))


def _mapped_blas() -> list[str]:
    """BLAS-like libraries mapped into this process, from /proc/self/maps."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    keys = ("blas", "mkl", "blis", "accelerate")
    paths = {line.split(None, 5)[-1] for line in lines if len(line.split(None, 5)) == 6}
    return sorted(p for p in paths if any(k in Path(p).name.lower() for k in keys))


def _openblas_details(path: Path) -> dict:
    try:
        lib = ctypes.CDLL(str(path))  # already loaded: this only returns its handle
        lib.openblas_get_config.restype = ctypes.c_char_p
        lib.openblas_get_corename.restype = ctypes.c_char_p
        config = lib.openblas_get_config().decode()
        return {
            "version": config.split()[1] if config.startswith("OpenBLAS") else "",
            "core": lib.openblas_get_corename().decode(),
            "threads": lib.openblas_get_num_threads(),
            "_lib": lib,
        }
    except (OSError, AttributeError):
        return {}


def set_threads(n: int) -> None:
    """Set the active OpenBLAS's thread count (no-op for other BLAS libraries)."""
    path = active_library()
    details = _openblas_details(path) if path else {}
    if "_lib" in details:
        details["_lib"].openblas_set_num_threads(int(n))
        _state["threads_why"] = "set_threads"


def probe_gflops(size: int = 256, reps: int = 3) -> float:
    """GFLOP/s of a float32 matmul on the CPU: proof of what MLX actually runs.

    The reference BLAS manages ~1 GFLOP/s here, OpenBLAS tens.
    """
    import mlx.core as mx

    a = mx.random.normal((size, size), stream=mx.cpu)
    b = mx.random.normal((size, size), stream=mx.cpu)
    mx.eval(a, b)
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(mx.matmul(a, b, stream=mx.cpu))
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e9


def blas_info(probe: bool = False) -> dict:
    """Which BLAS MLX's CPU matmuls use in this process: name, path, threads, and how.

    With probe=True a small float32 matmul is timed (`gflops`) to show it took effect.
    """
    if sys.platform == "darwin":
        info = {"name": "Accelerate", "path": "", "threads": 0, "how": "linked", "fast": True}
    else:
        path = active_library()
        if path is None:
            mapped = [p for p in _mapped_blas() if "libblas" in Path(p).name]
            info = {
                "name": "reference BLAS (bundled with mlx)",
                "path": mapped[0] if mapped else "",
                "threads": 1,
                "how": "bundled",
                "fast": False,
            }
            if _state["error"]:
                info["why_not_fast"] = _state["error"]
        else:
            details = _openblas_details(path)
            details.pop("_lib", None)
            name = path.name
            if details:
                name = f"OpenBLAS {details['version']} ({details['core']})"
            preloaded = "LD_PRELOAD" if os.environ.get("LD_PRELOAD") else "loaded"
            info = {
                "name": name,
                "path": str(path),
                "threads": details.get("threads", 0),
                "threads_why": _state["threads_why"] or "OPENBLAS_NUM_THREADS or library default",
                "how": _state["how"] or preloaded,
                "fast": True,
            }
    if probe:
        info["gflops"] = round(probe_gflops(), 1)
    return info


def describe(info: dict | None = None) -> str:
    """One line for stats and benchmarks, e.g. 'OpenBLAS 0.3.33 (Cooperlake), 1 thread'."""
    info = info or blas_info()
    threads = info.get("threads", 0)
    text = info["name"]
    if threads:
        text += f", {threads} thread" + ("s" if threads != 1 else "")
    if "gflops" in info:
        text += f", {info['gflops']:.0f} GFLOP/s"
    return text


def fast_blas_active() -> bool:
    return bool(blas_info()["fast"])


# ---- CPU weights ---------------------------------------------------------------------

CPU_WEIGHTS = ("auto", "int4", "fp32")
# Headroom over the float32 weights for activations, KV caches and the draft's share.
MEMORY_MARGIN = 1.3


def _is_quantized(layer) -> bool:
    import mlx.nn as nn

    return isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding))


def dense_params(module) -> int:
    """Parameter count, packed quantized weights counted as the values they hold."""
    from mlx.utils import tree_flatten

    layers = dict(module.named_modules())
    total = 0
    for path, value in tree_flatten(module.parameters()):
        owner, _, name = path.rpartition(".")
        layer = layers.get(owner)
        if layer is not None and _is_quantized(layer):
            if name == "weight":
                total += value.size * 32 // layer.bits
            elif name == "bias":
                total += value.size
            continue  # scales and biases are the quantization's, not the model's
        total += value.size
    return total


def available_memory() -> int:
    """Bytes a new allocation can get: MemAvailable on Linux, physical memory elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _native_covers(module) -> bool:
    """Whether specmlx's native INT4 kernel would run this model's quantized layers."""
    from . import native

    return native.available() and any(
        _is_quantized(m)
        and m.bits == 4
        and getattr(m, "mode", "affine") == "affine"
        and m.group_size in native.GROUP_SIZES
        for m in module.modules()
    )


def pick_cpu_weights(module, requested: str, backend: str) -> tuple[str, str]:
    """('int4' or 'fp32', why) for a freshly built model.

    'auto' expands to float32 only where it pays: the CPU backend, a fast BLAS under
    MLX (else dense matmuls are the reference BLAS's, slower than INT4), no native INT4
    kernel for these layers (it is faster still), and room for params x 4 bytes x
    MEMORY_MARGIN in the memory available now.
    """
    if requested not in CPU_WEIGHTS:
        raise SpecmlxError(
            f"unknown CPU weights mode {requested!r}; use one of {', '.join(CPU_WEIGHTS)}"
        )
    if not any(_is_quantized(m) for m in module.modules()):
        return "dense", "checkpoint is not quantized"
    if requested != "auto":
        return requested, "requested"
    if backend != "cpu":
        return "int4", f"backend is {backend}"
    if not fast_blas_active():
        return "int4", "no fast BLAS (see specmlx.blas)"
    if _native_covers(module):
        # Measured (bench/results/blas_verify.md): INT4 on the native kernel reads 8x fewer
        # bytes and beats float32 on OpenBLAS at every k from 1 to 8.
        return "int4", "native INT4 kernel is faster"
    need = dense_params(module) * 4 * MEMORY_MARGIN
    free = available_memory()
    if need > free:
        return "int4", f"float32 needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB available"
    return "fp32", f"fast BLAS and {free / 2**30:.1f} GiB available"


def expand_quantized(module, keep_bits: tuple[int, ...] = ()) -> int:
    """Replace quantized layers by float32 Linear / Embedding; returns how many.

    The new weights are lazy `mx.dequantize` of the packed ones, so nothing is computed
    here: each is expanded when first evaluated, and the packed copy is freed once no
    graph needs it. Tied heads work unchanged: Embedding.as_linear is a dense matmul.
    Layers with `keep_bits` stay packed: specmlx's 8-bit embeddings and output heads, which
    the native kernel runs 2-5x faster than OpenBLAS runs them in float32 at 1-8 rows
    (bench/head_matmul.py), so the fp32 mode keeps them there.
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_map_with_path

    def expands(layer) -> bool:
        return _is_quantized(layer) and layer.bits not in keep_bits

    def dense(_path: str, layer):
        if not expands(layer):
            return layer
        weight = mx.dequantize(
            layer["weight"],
            layer["scales"],
            layer.get("biases"),
            group_size=layer.group_size,
            bits=layer.bits,
            mode=getattr(layer, "mode", "affine"),
        ).astype(mx.float32)
        if isinstance(layer, nn.QuantizedEmbedding):
            new = nn.Embedding(1, 1)  # 1x1: its random init costs nothing; replaced below
        else:
            new = nn.Linear(1, 1, bias="bias" in layer)
            if "bias" in layer:
                new.bias = layer["bias"].astype(mx.float32)
        new.weight = weight
        return new

    count = sum(1 for m in module.modules() if expands(m))
    if count:
        leaves = tree_map_with_path(dense, module.leaf_modules(), is_leaf=nn.Module.is_module)
        module.update_modules(leaves)
    return count
