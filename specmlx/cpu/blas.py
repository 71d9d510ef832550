"""A fast BLAS under MLX's dense CPU matmuls, for the fp32 weights mode (see fp32.py).

Why: the `mlx[cpu]` wheel on Linux links the netlib reference BLAS
(mlx_cpu.libs/libblas-*.so.3.10.0), single-threaded and linear in the rows of a matmul, so
float32 weights only pay on a real BLAS. specmlx puts OpenBLAS in front of it:

    pip install 'specmlx[cpu-fast]'              # ngsolve-openblas: DYNAMIC_ARCH OpenBLAS
    apt-get install libopenblas0-pthread         # or Debian/Ubuntu's OpenBLAS
    specmlx generate -m TARGET -d DRAFT --cpu-weights fp32 -p "..."

How: libmlx.so binds `cblas_sgemm` when it is loaded, looking in the process's global
scope before its own dependencies. So when fp32 weights are asked for, the CLI loads
OpenBLAS with RTLD_GLOBAL before anything imports mlx (`activate`), and MLX's matmuls run
on it with no environment tricks. When that cannot work in-process (mlx already imported,
or OpenBLAS needs a libgfortran.so.5 the system lacks: the pip wheel links it, and
mlx[cpu] bundles one under a hashed name), the CLI re-executes itself once with
LD_PRELOAD (and LD_LIBRARY_PATH pointing at a link to mlx's libgfortran);
SPECMLX_BLAS_REEXEC marks the child so it never loops. Library users call
`specmlx.cpu.blas.activate()` before importing mlx.

This module does not import mlx (only `probe_gflops` does, when called): it must run
before mlx is loaded.

Knobs (environment):
    SPECMLX_FAST_BLAS=0     keep MLX's bundled BLAS (CLI: `specmlx --no-fast-blas ...`)
    SPECMLX_NO_REEXEC=1     never re-exec; use a fast BLAS only if it loads in-process
    SPECMLX_BLAS=PATH       the BLAS library to use (must export plain `cblas_sgemm`;
                            scipy-openblas32/64 export `scipy_cblas_sgemm` and cannot)
    SPECMLX_THREADS=N       BLAS threads (shared with the native INT4 kernel)
    OPENBLAS_CORETYPE       left alone when set; else set from /proc/cpuinfo, because
                            Debian's OpenBLAS 0.3.21 picks its slowest kernels (Prescott)
                            on CPUs it does not know, as in many VMs

Threads: MLX runs each stream on one thread, and OpenBLAS adds its own, which spin while
they wait: on a busy machine oversubscribed BLAS threads collapse throughput. So the
default is the CPUs this process may use minus the 1-minute load average (rounded, at
least 1), and `blas_info()` reports the count and why. Set SPECMLX_THREADS for
reproducible benchmarks.
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

from ..errors import SpecmlxError
from ..paths import home

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
        return []
    bundled = Path(list(spec.submodule_search_locations)[0]).parent / "mlx_cpu.libs"
    copies = sorted(bundled.glob("libgfortran-*.so.5*"))
    if not copies:
        return []
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
    """At CLI start, when fp32 weights are asked for: put a fast BLAS under MLX, in-process
    or by re-executing once. INT4 weights never need it, so the CLI calls this only then."""
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
    # A wheel's OpenBLAS links libgfortran.so.5, which mlx[cpu] bundles under a hashed
    # name: its folder goes on the path whatever kept the library out in-process (mlx
    # imported first hides that it needs one), and the check below says if it is enough.
    folders = [str(f) for f in _gfortran_dirs()]
    if folders:
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
    """GFLOP/s of a float32 matmul on the CPU: proof of what MLX actually runs."""
    import mlx.core as mx  # here, not at the top: the module must load before mlx does

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
    """Whether MLX's dense CPU matmuls run on a fast BLAS (OpenBLAS, Accelerate) here."""
    return bool(blas_info()["fast"])
