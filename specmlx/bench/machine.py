"""Facts about where a run ran: the CPU, cores, versions, BLAS, the models as loaded, the
process's memory and the CPU time the hypervisor stole.

A speed figure means little without them, so every result records them; none of it
calls out to other programs (git included): a label for the code is the caller's to give.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
from collections import Counter
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import mlx.core as mx

from .. import __version__
from ..cpu import describe as native_describe
from ..loading import Model, backend
from ..paths import portable

THREAD_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "LD_PRELOAD")


def cpu_times() -> tuple[int, int] | None:
    """(stolen, all) CPU time since boot in clock ticks, summed over CPUs, from
    /proc/stat; None where there is none (not Linux)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return (ticks[7] if len(ticks) > 7 else 0), sum(ticks)


def steal_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of all CPU time between two cpu_times() readings that was stolen."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def process_memory() -> tuple[int, int]:
    """(current, peak) resident set size of this process, in bytes."""
    status = Path("/proc/self/status")
    if status.exists():
        fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)

        def kib(name: str) -> int:
            return int(fields.get(name, "0 kB").split()[0]) * 1024

        return kib("VmRSS"), kib("VmHWM")
    import resource  # not on Windows; only reached where /proc is missing

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS
    return peak, peak


class DlInfo(ctypes.Structure):
    """dladdr's answer: which shared object holds an address."""

    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def blas_info() -> dict:
    """Which BLAS this process uses: the library `cblas_sgemm` resolves to, and all mapped.

    A BLAS interposed with LD_PRELOAD (or loaded globally by specmlx.cpu.blas) wins the
    global lookup; otherwise MLX calls the one it was linked against (the mlx-cpu wheel bundles
    netlib's reference BLAS). Other packages (scipy, numpy) may map their own BLAS, which
    MLX does not use.
    """
    maps = Path("/proc/self/maps")
    mapped = sorted(
        {
            line.split()[-1]
            for line in (maps.read_text().splitlines() if maps.exists() else [])
            if any(k in line.rsplit("/", 1)[-1].lower() for k in ("blas", "lapack", "mkl"))
        }
    )
    active = None
    try:
        sgemm = ctypes.cast(ctypes.CDLL(None).cblas_sgemm, ctypes.c_void_p)
    except (AttributeError, OSError):  # not in the global scope: MLX's own linked BLAS
        mlx_dir = Path(mx.__file__).resolve().parents[1]
        active = next((m for m in mapped if Path(m).resolve().is_relative_to(mlx_dir)), None)
    else:
        info = DlInfo()
        libdl = ctypes.CDLL(ctypes.util.find_library("dl") or None)
        if libdl.dladdr(sgemm, ctypes.byref(info)):
            active = info.dli_fname.decode()
    return {
        "active": Path(active).name if active else None,
        "mapped": [Path(m).name for m in mapped],
    }


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def load_average() -> tuple[float, float, float] | None:
    return os.getloadavg() if hasattr(os, "getloadavg") else None


def machine_info() -> dict:
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "mlx": mx.__version__,
        "mlx_lm": package_version("mlx-lm"),
        "specmlx": __version__,
        "backend": backend(),
        "device": str(mx.default_device()),
        "blas": blas_info(),
        "int4_kernel": native_describe(),
        "env": {k: os.environ[k] for k in THREAD_ENV if k in os.environ},
        "load_average": load_average(),
    }


def describe_model(model: Model) -> dict:
    return {
        "path": portable(model.path),
        "name": model.name,
        "model_type": model.config.get("model_type"),
        "dtype": model.dtype,
        "quantization": model.quantization,
        "description": model.describe(),
        "cpu_weights": model.weights,  # "int4" | "fp32" (expanded for a fast BLAS) | ""
        "cpu_weights_why": model.weights_why,
        # Which layer classes actually run (e.g. mlx's QuantizedLinear or a native kernel).
        "layer_types": dict(
            Counter(
                type(m).__name__
                for m in model.module.modules()
                if "Linear" in type(m).__name__ or "Embedding" in type(m).__name__
            )
        ),
        "load_info": model.info,
    }
