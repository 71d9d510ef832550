"""The native extension (specmlx/cpu/_native, see its README): loading it, its switches
(instruction set, AMX, activations, threads), and what it is (describe, build_id).

MLX's CPU `quantized_matmul` is a scalar single-threaded loop on x86 Linux; the extension
is a C++ MLX primitive library that runs the quantized matmuls and the ops around them
with AVX-512/AVX2 and a thread pool. It is optional: when it is not built, or was built
for another mlx release, everything falls back to MLX's own ops.

Its 4- and 8-bit matmuls take x either as float32 or quantized to int8 per 32-block for
integer dot products (`set_activations`, SPECMLX_ACTIVATIONS; the kernel README has the
choice and the reasons behind the default); its 6-bit ones take int8 x only.

`_ext` is the loaded module or None. The cpu package's own modules call its ops through
it, reading it on every call (so that a test can swap it); code outside the package uses
`op`.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import platform
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import mlx.core as mx

from ..errors import SpecmlxError

NATIVE_DIR = Path(__file__).parent / "_native"
BUILD_INFO = "_ext_build.json"
ACTIVATIONS = ("int8", "float32")
ENV_ACTIVATIONS = "SPECMLX_ACTIVATIONS"
DEFAULT_ACTIVATIONS = "int8"  # why: _native/README.md, "Accuracy and speed; the default"


def _load(
    native_dir: Path = NATIVE_DIR,
    mlx_version: str = mx.__version__,
    module: str = "specmlx.cpu._native._ext",
) -> tuple[ModuleType | None, str]:
    """(the extension module, '') or (None, why it cannot be used)."""
    if os.environ.get("SPECMLX_NATIVE", "1") == "0":
        return None, "disabled by SPECMLX_NATIVE=0"
    machine = platform.machine().lower()
    if sys.platform != "linux" or machine not in ("x86_64", "amd64"):
        return None, f"built only for Linux x86_64, not {sys.platform} {machine}"
    info_file = native_dir / BUILD_INFO
    if not info_file.exists():
        return None, (
            "not built; reinstall with `pip install -e .` on a machine with a C++ compiler "
            "(see specmlx/cpu/_native/README.md)"
        )
    try:
        built_for = json.loads(info_file.read_text())["mlx"]
    except (ValueError, KeyError) as e:
        return None, f"unreadable build info {info_file} ({e})"
    if built_for != mlx_version:
        # Loading it anyway could fail on missing symbols or, worse, run with a stale ABI.
        return None, (
            f"built for mlx {built_for} but mlx {mlx_version} is installed; "
            "reinstall specmlx to rebuild (`pip install -e .` in a checkout)"
        )
    try:
        return importlib.import_module(module), ""
    except ImportError as e:  # missing .so, undefined symbols, nanobind mismatch
        return None, f"failed to import {module} ({e})"


def _platform_expects_native() -> bool:
    return sys.platform == "linux" and platform.machine().lower() in ("x86_64", "amd64")


_ext: ModuleType | None
_ext, _reason = _load()
if _ext is None and _platform_expects_native() and os.environ.get("SPECMLX_NATIVE") != "0":
    warnings.warn(
        f"specmlx: native quantized CPU kernel unavailable: {_reason}. "
        "Using mx.quantized_matmul (much slower on x86).",
        RuntimeWarning,
        stacklevel=2,
    )


# AMX (int8 passes of 16 rows and more, same results as without it) is on where the CPU
# and Linux grant it; SPECMLX_AMX=0 keeps the kernel on its vector tiles, for a VM whose
# AMX misbehaves or to time one against the other.
if _ext is not None and os.environ.get("SPECMLX_AMX", "1") == "0":
    _ext.set_amx(False)

ENV_ISA = "SPECMLX_ISA"
ISAS = ("avx512", "avx2", "scalar")


def _env_isa() -> str:
    """Force the kernel's instruction set from SPECMLX_ISA (below the best this CPU has:
    an AVX-512 machine can run and time the AVX2 code); '' or why the value is bad."""
    text = os.environ.get(ENV_ISA, "").strip()
    if not text or _ext is None:
        return ""
    if text not in ISAS:
        return f"{ENV_ISA} must be one of {', '.join(ISAS)}, got {text!r}"
    try:
        set_isa(text)
    except SpecmlxError:
        return f"{ENV_ISA}={text}: this CPU's best is {_ext.isa()}; unset it or choose a lower one"
    return ""


def set_isa(name: str) -> None:
    """Hold the kernels to instruction set `name` (one of ISAS) from now on, at most the
    best this CPU has: an AVX-512 machine can run, and time, the code an AVX2-only CPU runs."""
    if _ext is None:
        raise RuntimeError(f"native kernel unavailable: {_reason}")
    if name not in ISAS:
        raise SpecmlxError(f"unknown instruction set {name!r}; use one of {', '.join(ISAS)}")
    try:
        _ext.set_isa(name)
    except ValueError:
        best = _ext.isa()
        raise SpecmlxError(f"this CPU's best instruction set is {best}, below {name}") from None


def _env_activations() -> tuple[str, str]:
    """(the activations SPECMLX_ACTIVATIONS asks for, or the default; '' or why it is bad)."""
    text = os.environ.get(ENV_ACTIVATIONS, "").strip()
    if not text:
        return DEFAULT_ACTIVATIONS, ""
    if text not in ACTIVATIONS:
        return DEFAULT_ACTIVATIONS, (
            f"{ENV_ACTIVATIONS} must be one of {', '.join(ACTIVATIONS)}, got {text!r}"
        )
    return text, ""


# Read once, here: a bad value is reported when a model is prepared (check_settings), as
# one line from the CLI, rather than breaking `import specmlx`.
_activations, _env_problem = _env_activations()
_env_problem = _env_isa() or _env_problem
_float32_why = ""  # why a model's load put the kernel on float32 x, if one did
if _ext is not None and hasattr(_ext, "set_activations"):  # a build from before int8 x lacks it
    _ext.set_activations(_activations)


def available() -> bool:
    """Whether the native kernel is built and loadable with the installed mlx."""
    return _ext is not None


def reason() -> str:
    """Why the native kernel is not available ('' when it is)."""
    return _reason


def threads() -> int:
    """Threads the kernel may use (SPECMLX_THREADS, default: the CPUs this process may use)."""
    return _ext.threads() if _ext is not None else 0


def set_threads(n: int) -> None:
    """Let the kernel use n threads from now on."""
    if _ext is None:
        raise RuntimeError(f"native kernel unavailable: {_reason}")
    _ext.set_threads(n)


def activations() -> str:
    """What the kernel's 4- and 8-bit matmuls multiply: 'int8' (x quantized per 32-block)
    or 'float32' x. Its 6-bit matmuls always take int8 x."""
    if _ext is None or not hasattr(_ext, "activations"):
        return "float32"
    return _ext.activations()


def set_activations(mode: str) -> None:
    """Choose 'int8' or 'float32' activations for the matmuls evaluated from now on."""
    if mode not in ACTIVATIONS:
        raise SpecmlxError(f"unknown activations {mode!r}; use one of {', '.join(ACTIVATIONS)}")
    if _ext is None or not hasattr(_ext, "set_activations"):
        raise RuntimeError(f"native kernel without int8 activations: {_reason or 'old build'}")
    global _float32_why
    _ext.set_activations(mode)
    _float32_why = ""


def keep_float32(why: str) -> None:
    """Put the kernel on float32 x for the rest of the process; describe() shows `why`."""
    global _float32_why
    set_activations("float32")
    _float32_why = why


def check_settings() -> None:
    """Raise SpecmlxError, one line for the CLI, where SPECMLX_ISA or SPECMLX_ACTIVATIONS
    holds a value the kernel cannot take."""
    if _env_problem:
        raise SpecmlxError(_env_problem)


def op(name: str) -> Callable | None:
    """The extension's function `name`, or None without the extension or in a build from
    before that function existed."""
    return getattr(_ext, name, None)


def q8_kernel() -> str:
    """Which tiles run the products on int8 x (e.g. 'vnni512+vbmi, amx from 16 rows'), ''
    without the extension."""
    return _ext.q8_kernel() if _ext is not None else ""


def describe() -> str:
    """Which INT4 matmul runs, and how (specmlx.cpu.describe adds the attention)."""
    if _ext is None:
        return f"mx.quantized_matmul (native kernel unavailable: {_reason})"
    acts = activations()
    if acts == "int8":
        acts = f"int8 activations ({q8_kernel()})"
    else:
        acts = "float32 activations" + (f": {_float32_why}" if _float32_why else "")
    return f"specmlx native INT4/INT8 ({_ext.isa()}, {_ext.threads()} threads, {acts})"


@functools.cache
def build_id() -> str:
    """A short hash of the loaded extension's bytes ('' without one). The same describe()
    can hide a rebuilt kernel whose passes cost otherwise, so the cost cache keys on this
    too (bench/results/ARCHIVE.md, "stale costs": a kernel rebuilt under the same describe()
    read another kernel's cost figures)."""
    if _ext is None or not getattr(_ext, "__file__", None):
        return ""
    return hashlib.sha256(Path(_ext.__file__).read_bytes()).hexdigest()[:12]
