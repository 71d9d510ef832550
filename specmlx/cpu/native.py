"""The native INT4/INT8 CPU matmul (and softmax): availability, the ops, and patching a
model to use them.

MLX's CPU `quantized_matmul` is a scalar single-threaded loop on x86 Linux. specmlx ships
a C++ MLX primitive (specmlx/cpu/_native, see its README) that computes the same
x @ dequantize(w)^T for 4-, 6- and 8-bit affine weights (8 or 6 bits: the embeddings and
output heads of specmlx-quantized checkpoints, 6 the heavier layers of mlx-lm's mixed
recipes) with AVX-512/AVX2 and a thread pool. It is
optional: when it is not built, was built for another mlx release, or the call is not one
it handles (other bits or modes, a GPU stream), everything falls back to
`mx.quantized_matmul`.

Its 4- and 8-bit matmuls take x either as float32 or quantized to int8 per 32-block for
integer dot products (`set_activations`, SPECMLX_ACTIVATIONS; the kernel README has the
choice and its figures); its 6-bit ones take int8 x only, and MLX's kernel runs them under
float32 x.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import json
import os
import platform
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import mlx.core as mx
import mlx.nn as nn

from ..errors import SpecmlxError

NATIVE_DIR = Path(__file__).parent / "_native"
BUILD_INFO = "_ext_build.json"
GROUP_SIZES = (32, 64, 128)
BITS = (4, 6, 8)  # 6 bits on int8 activations only: the float32-x tiles read 4 and 8
FLOAT_TYPES = (mx.float32, mx.bfloat16, mx.float16)
ACTIVATIONS = ("int8", "float32")
ENV_ACTIVATIONS = "SPECMLX_ACTIVATIONS"
DEFAULT_ACTIVATIONS = "int8"  # the kernel README has the measurements behind it


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
        _ext.set_isa(text)
    except ValueError:
        return f"{ENV_ISA}={text}: this CPU's best is {_ext.isa()}; unset it or choose a lower one"
    return ""


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


# Read once, here: a bad value is reported when a model is prepared (patch_model), as one
# line from the CLI, rather than breaking `import specmlx`.
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


# Recurrent layers whose mlx-lm code is exact over a pass as it stands: the gated delta
# rule of Qwen3-Next and Qwen3.5 runs one token at a time whatever the pass's length, and
# LFM2's short conv gives each row the same bits over any length on the CPU
# (bench/row_exactness.py; tests/test_stepwise.py checks their INT4 copies too).
RECURRENT_EXACT = ("qwen3_next", "qwen3_5", "lfm2")


def rows_exact(module: nn.Module, windows_exact: bool = False) -> bool:
    """Whether the model's pass over k tokens gives each position bit for bit what a
    one-token step gives it: where every layer keeps a plain KV cache (global causal
    attention) or a sliding window that the native attention op runs (`windows_exact`:
    specmlx.cpu.attention.windows_exact, which imports this module), or a Mamba-2 state
    that specmlx.stepwise steps through short passes, or RECURRENT_EXACT's layers.
    Sliding windows on mlx-lm's attention (its masked multi-token path) and mlx-lm's
    chunked Mamba-2 scan differ in the logits' last bits (bench/row_exactness.py),
    harmless in float32 but enough for int8 x's rounding to carry a near-tie to another
    greedy token, so that speculation would not decode what the target alone does."""
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

    from .. import stepwise
    from ..caches import layers

    caches = layers(make_prompt_cache(module))
    kv_only = all(type(c) is KVCache for c in caches)
    windows = windows_exact and all(type(c) in (KVCache, RotatingKVCache) for c in caches)
    recurrent = getattr(module, "model_type", None) in RECURRENT_EXACT and all(
        type(c) in (KVCache, ArraysCache) for c in caches
    )
    return kv_only or windows or recurrent or stepwise.stepped(module)


def keep_exact(module: nn.Module, name: str, windows_exact: bool = False) -> None:
    """Put the kernel on float32 x for good in this process where int8 x would make
    `module` (called `name` in the stats) decode differently speculating and alone
    (`windows_exact`: see rows_exact)."""
    global _float32_why
    if activations() == "int8" and not rows_exact(module, windows_exact):
        set_activations("float32")
        _float32_why = f"{name}'s multi-token passes are not bit-exact"


def describe() -> str:
    """Which INT4 matmul runs, and how (specmlx.cpu.describe adds the attention)."""
    if _ext is None:
        return f"mx.quantized_matmul (native kernel unavailable: {_reason})"
    acts = activations()
    if acts == "int8":
        acts = f"int8 activations ({_ext.q8_kernel()})"
    else:
        acts = "float32 activations" + (f": {_float32_why}" if _float32_why else "")
    return f"specmlx native INT4/INT8 ({_ext.isa()}, {_ext.threads()} threads, {acts})"


@functools.cache
def build_id() -> str:
    """A short hash of the loaded extension's bytes ('' without one). The same describe()
    can hide a rebuilt kernel whose passes cost otherwise, so the cost cache keys on this
    too (bench/results/README.md, round 29)."""
    if _ext is None or not getattr(_ext, "__file__", None):
        return ""
    return hashlib.sha256(Path(_ext.__file__).read_bytes()).hexdigest()[:12]


def supports(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
    mode: str = "affine",
    transpose: bool = True,
) -> bool:
    """Whether this call can run on the native kernel."""
    return (
        _ext is not None
        and bits in BITS
        and (bits != 6 or activations() == "int8")
        and mode == "affine"
        and transpose
        and group_size in GROUP_SIZES
        and biases is not None
        and mx.default_device() == mx.cpu
        and w.dtype == mx.uint32
        and w.ndim == 2
        and x.ndim >= 1
        and x.shape[-1] == w.shape[1] * 32 // bits
        and x.dtype in FLOAT_TYPES
        and scales.dtype in FLOAT_TYPES
        and biases.dtype == scales.dtype
    )


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None = None,
    group_size: int = 64,
    bits: int = 4,
    mode: str = "affine",
    packed: mx.array | None = None,
) -> mx.array:
    """x @ dequantize(w, scales, biases).T: the native kernel where it applies, else MLX's.
    `packed`: pack_layers' layout of the same matrix (see there)."""
    if supports(x, w, scales, biases, group_size, bits, mode):
        return _ext.quantized_matmul(x, w, scales, biases, group_size, bits, None, packed)
    return mx.quantized_matmul(
        x,
        w,
        scales=scales,
        biases=biases,
        transpose=True,
        group_size=group_size,
        bits=bits,
        mode=mode,
    )


def softmax(x: mx.array) -> mx.array:
    """Softmax over the last axis: the native kernel for float32 on a CPU stream (MLX's CPU
    exp is scalar on x86), else MLX's."""
    kernel = getattr(_ext, "softmax", None)  # None too in a build from before it existed
    if kernel is not None and x.dtype == mx.float32 and mx.default_device() == mx.cpu:
        return kernel(x)
    return mx.softmax(x, axis=-1)


def argmax(x: mx.array, n: int | None = None) -> mx.array:
    """uint32 index of the largest of each row's first `n` entries (all by default), the
    first of equals: the native kernel for float32 on a CPU stream (MLX's CPU argmax is a
    scalar loop), else mx.argmax, with the same result."""
    n = x.shape[-1] if n is None else min(n, x.shape[-1])
    kernel = getattr(_ext, "argmax", None)
    if kernel is not None and x.dtype == mx.float32 and mx.default_device() == mx.cpu:
        return kernel(x, n)
    return mx.argmax(x[..., :n], axis=-1).astype(mx.uint32)


GATE_ACTIVATIONS = {"silu": nn.silu, "gelu_approx": nn.gelu_approx}


def gated_matmul(
    x: mx.array, gate: nn.QuantizedLinear, up: nn.QuantizedLinear, activation: str = "silu"
) -> mx.array:
    """act(gate(x)) * up(x), act silu or gelu_approx: the native gated op (x quantized
    once, one dispatch, a vector sigmoid) where both layers and the call suit it, else the
    two layers and MLX's activation."""
    op = getattr(_ext, "gated_matmul", None)  # None too in a build from before it existed
    if (
        op is not None
        and isinstance(gate, NativeQuantizedLinear)
        and isinstance(up, NativeQuantizedLinear)
        and "bias" not in gate
        and "bias" not in up
        and (gate.bits, gate.group_size) == (up.bits, up.group_size)
        and gate["weight"].shape == up["weight"].shape
        and gate["scales"].dtype == up["scales"].dtype
        and supports(
            x, gate["weight"], gate["scales"], gate.get("biases"), gate.group_size, gate.bits
        )
        and up.get("biases") is not None
    ):
        return op(
            x,
            gate["weight"],
            gate["scales"],
            gate["biases"],
            up["weight"],
            up["scales"],
            up["biases"],
            gate.group_size,
            gate.bits,
            activation,
            packed_of([gate, up]),
        )
    return GATE_ACTIVATIONS[activation](gate(x)) * up(x)


class NativeQuantizedLinear(nn.QuantizedLinear):
    """A QuantizedLinear whose matmul goes through `quantized_matmul` above; on the kernel
    a float32 product takes its bias in the same op (the same one rounding as y + bias,
    without the three graph nodes MLX's add of a half bias makes).

    `packed_tiles`: pack_layers' copy of the weights in the layout the four-row tiles
    stream, or None; None too once the weight, scales or biases it was made from are
    replaced, so a stale copy is never read."""

    _packed: tuple | None = None  # ((weight, scales, biases) packed, the copy): not a parameter

    @property
    def packed_tiles(self) -> mx.array | None:
        if self._packed is None:
            return None
        (w, s, b), packed = self._packed
        fresh = self["weight"] is w and self["scales"] is s and self.get("biases") is b
        return packed if fresh else None

    def __call__(self, x: mx.array) -> mx.array:
        w, scales, biases = self["weight"], self["scales"], self.get("biases")
        bias = self.get("bias")
        if (
            bias is not None
            and bias.dtype == scales.dtype
            and mx.float32 in (x.dtype, scales.dtype)
            and supports(x, w, scales, biases, self.group_size, self.bits, self.mode)
        ):
            return _ext.quantized_matmul(
                x, w, scales, biases, self.group_size, self.bits, bias, self.packed_tiles
            )
        y = quantized_matmul(
            x, w, scales, biases, self.group_size, self.bits, self.mode, self.packed_tiles
        )
        if bias is not None:
            y = y + bias
        return y


class NativeQuantizedEmbedding(nn.QuantizedEmbedding):
    """A QuantizedEmbedding whose as_linear (tied output heads) uses `quantized_matmul`,
    and whose float32 lookups are one native op (`quantized_rows`) on the CPU.

    `lookup_dtype` (set by keep_stored_halves): the lookup widens its gathered rows of
    scales and biases to it before dequantizing, as widening the whole table at load did.
    """

    lookup_dtype: mx.Dtype | None = None

    def __call__(self, x: mx.array) -> mx.array:
        rows = getattr(_ext, "quantized_rows", None)
        scales = self["scales"]
        if (
            rows is not None
            and (self.lookup_dtype or scales.dtype) == mx.float32
            and self.bits in BITS
            and self.mode == "affine"
            and x.dtype in (mx.int32, mx.uint32)
            and mx.default_device() == mx.cpu
        ):
            # One op for the ~38 nodes of the gathers and MLX's dequantize; the same bits.
            return rows(x, self["weight"], scales, self["biases"], self.group_size, self.bits)
        if self.lookup_dtype is None:
            return super().__call__(x)
        return mx.dequantize(
            self["weight"][x],
            scales=self["scales"][x].astype(self.lookup_dtype),
            biases=self["biases"][x].astype(self.lookup_dtype),
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )

    def as_linear(self, x: mx.array) -> mx.array:
        return quantized_matmul(
            x,
            self["weight"],
            self["scales"],
            self.get("biases"),
            self.group_size,
            self.bits,
            self.mode,
        )


# The bodies of mlx-lm's gated MLPs (silu: Llama, Qwen2/3, Mistral and ~45 others;
# gelu_approx: Gemma), each with its activation and the name it must resolve to: an MLP is
# given the gated op only when its __call__ is exactly one of these, so a variant (a clamp,
# another activation) never is.
GATED_BODIES = {
    "return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))": ("silu", "swiglu"),
    "return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))": ("silu", "nn"),
    "return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))": (
        "gelu_approx",
        "nn",
    ),
}


def _call_tree(cls: type) -> ast.Module | None:
    """The syntax tree of cls.__call__'s source, or None where it has none to read."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(cls.__call__)))
    except (OSError, TypeError, SyntaxError):
        return None


def call_body(cls: type, params: list[str]) -> list[str] | None:
    """The statements of cls.__call__ (its docstring left out), each as its syntax tree's
    dump, where its parameters are `params`; None where they are not, or there is no
    source. Comments, layout and docstrings do not count: a body matches a kept copy of
    mlx-lm's source when the code is the same."""
    tree = _call_tree(cls)
    fn = tree.body[0] if tree is not None and tree.body else None
    if not isinstance(fn, ast.FunctionDef) or [a.arg for a in fn.args.args] != params:
        return None
    return [
        ast.dump(stmt)
        for stmt in fn.body
        if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant))
    ]


def _gated_activation(cls: type) -> str | None:
    """The activation of cls.__call__(self, x) if it is down_proj(act(gate_proj(x)) *
    up_proj(x)) for an activation the gated op has, else None."""
    from mlx_lm.models import activations

    call = cls.__call__
    body = call_body(cls, ["self", "x"])
    if body is None or len(body) != 1:
        return None
    names = {"swiglu": activations.swiglu, "nn": nn}
    for text, (activation, name) in GATED_BODIES.items():
        if body[0] == ast.dump(ast.parse(text).body[0]):
            return activation if call.__globals__.get(name) is names[name] else None
    return None


class _GatedMLP:
    """Mixed in before a gated MLP's class: its gate and up projections run as one native
    gated op (`_activation` set per class)."""

    _activation: str

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(gated_matmul(x, self.gate_proj, self.up_proj, self._activation))


def mixed_class(
    memo: dict[type, type | None], cls: type, mixin: type, prefix: str, attrs: Callable
) -> type | None:
    """cls with `mixin` before it in its bases, named prefix + cls's name and given the
    class attributes attrs(cls) returns, or None where that is None; made once per class
    and kept in `memo` (one subclass per class, however many layers are patched). It keeps
    cls's module: the architecture's, whose functions (its attention) the patches route."""
    if cls not in memo:
        found = attrs(cls)
        if found is None:
            memo[cls] = None
        else:
            namespace = {"__module__": cls.__module__, **found}
            memo[cls] = type(prefix + cls.__name__, (mixin, cls), namespace)
    return memo[cls]


_gated_classes: dict[type, type | None] = {}


def _gated_attrs(cls: type) -> dict | None:
    activation = _gated_activation(cls)
    return None if activation is None else {"_activation": activation}


def _gated_class(cls: type) -> type | None:
    """cls with _GatedMLP mixed in, or None where cls is not a gated MLP the op has."""
    return mixed_class(_gated_classes, cls, _GatedMLP, "NativeGated", _gated_attrs)


def patch_mlps(module: nn.Module) -> int:
    """Give the model's gated MLPs whose gate and up projections run on the kernel the
    gated op; returns how many. Call after patch_model."""
    if getattr(_ext, "gated_matmul", None) is None:
        return 0
    patched = 0
    for layer in module.modules():
        gate, up = layer.get("gate_proj"), layer.get("up_proj")
        if not (isinstance(gate, NativeQuantizedLinear) and isinstance(up, NativeQuantizedLinear)):
            continue
        if isinstance(layer, _GatedMLP) or "down_proj" not in layer:
            continue
        gated = _gated_class(type(layer))
        if gated is not None:
            layer.__class__ = gated
            patched += 1
    return patched


# The line of mlx-lm's attentions (53 of its model files) that makes the q, k and v
# projections of one x, in that order: where an attention's __call__ has it, the three run
# as one stacked op.
QKV_LINE = "queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)"
QKV = ("q_proj", "k_proj", "v_proj")


def _projects_qkv(cls: type) -> bool:
    """Whether cls.__call__ contains QKV_LINE as a statement of its own."""
    tree = _call_tree(cls)
    if tree is None:
        return False
    line = ast.dump(ast.parse(QKV_LINE).body[0])
    return any(ast.dump(node) == line for node in ast.walk(tree) if isinstance(node, ast.Assign))


class _Stack:
    """One attention's q, k and v projections as one stacked op: q's call computes all
    three and keeps k's and v's outputs for their calls that follow with the same x (by
    identity: the kept x cannot be freed and its id reused while it is kept)."""

    def __init__(self, layers: list[NativeQuantizedLinear]):
        self.layers = layers
        self.x: mx.array | None = None
        self.outs: list[mx.array] = []

    def first(self, x: mx.array) -> mx.array | None:
        """q's output, having made k's and v's too; None where the stacked op does not take
        the call (each layer then runs on its own)."""
        self.x, self.outs = None, []
        q = self.layers[0]
        scales = q["scales"]
        biased = "bias" in q
        if not supports(x, q["weight"], scales, q.get("biases"), q.group_size, q.bits, q.mode):
            return None
        if biased and mx.float32 not in (x.dtype, scales.dtype):
            return None  # the kernel adds a bias to float32 products only
        parts = ("weight", "scales", "biases")
        weights = [layer[part] for layer in self.layers for part in parts]
        biases = [layer["bias"] for layer in self.layers] if biased else []
        packed = packed_of(self.layers)
        self.outs = _ext.stacked_matmul(x, weights, biases, q.group_size, q.bits, packed)
        self.x = x
        return self.outs[0]

    def kept(self, x: mx.array, slot: int) -> mx.array | None:
        if self.x is not x:
            return None
        out = self.outs[slot]
        if slot == len(self.layers) - 1:
            self.x, self.outs = None, []
        return out


class NativeStackedLinear(NativeQuantizedLinear):
    """A q, k or v projection whose call goes through its attention's _Stack."""

    _stack: _Stack
    _slot: int

    def __call__(self, x: mx.array) -> mx.array:
        out = self._stack.first(x) if self._slot == 0 else self._stack.kept(x, self._slot)
        return super().__call__(x) if out is None else out


def _stackable(layers: list[nn.Module]) -> bool:
    """Whether the stacked op can take these layers together: native, of one K, bits, group
    size and scale type, a bias on all of them (of the scales' type) or on none."""
    first = layers[0]
    if not all(type(layer) is NativeQuantizedLinear for layer in layers):
        return False
    same = all(
        (layer.bits, layer.group_size, layer.mode) == (first.bits, first.group_size, first.mode)
        and layer["weight"].shape[1] == first["weight"].shape[1]
        and layer["scales"].dtype == first["scales"].dtype
        and ("bias" in layer) == ("bias" in first)
        for layer in layers
    )
    return same and all(
        "bias" not in layer or layer["bias"].dtype == layer["scales"].dtype for layer in layers
    )


def patch_projections(module: nn.Module) -> int:
    """Stack the q, k and v projections of each attention whose __call__ makes them in
    QKV_LINE (see _Stack); returns how many attentions. Call after keep_stored_halves."""
    if getattr(_ext, "stacked_matmul", None) is None:
        return 0
    patched = 0
    checked: dict[type, bool] = {}
    for layer in module.modules():
        projections = [layer.get(name) for name in QKV]
        if any(p is None for p in projections) or not _stackable(projections):
            continue
        cls = type(layer)
        if cls not in checked:
            checked[cls] = _projects_qkv(cls)
        if not checked[cls]:
            continue
        stack = _Stack(projections)
        for slot, projection in enumerate(projections):
            projection.__class__ = NativeStackedLinear
            projection._stack, projection._slot = stack, slot
        patched += 1
    return patched


def _qualifies(layer: nn.Module) -> bool:
    # 6-bit products need int8 x; a 6-bit embedding's lookups do not (its as_linear then
    # falls back to MLX's product call by call, through supports)
    six_ok = activations() == "int8" or isinstance(layer, nn.QuantizedEmbedding)
    return (
        layer.bits in BITS
        and (layer.bits != 6 or six_ok)
        and getattr(layer, "mode", "affine") == "affine"
        and layer.group_size in GROUP_SIZES
        and layer.get("biases") is not None
    )


def runs_int4(module: nn.Module) -> bool:
    """Whether `patch_model` would put some of this model's 4-bit layers on the kernel."""
    return (
        _ext is not None
        and mx.default_device() == mx.cpu
        and any(
            isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding))
            and layer.bits == 4
            and _qualifies(layer)
            for layer in module.modules()
        )
    )


# A patched layer's parameters that may stay in the checkpoint's half type under float32
# activations: the kernel widens scales and biases exactly before the same float32
# arithmetic, `y + bias` promotes to float32 exactly, and an embedding's lookup widens the
# rows it gathers, so the result is bitwise the one with float32 copies. Norms (Gemma adds 1
# in the weight's type) would change, so everything else keeps the dtype policy.
HALF_IN_PLACE = ("scales", "biases", "bias")


def keep_stored_halves(module: nn.Module, stored: dict[str, mx.array]) -> int:
    """Put back the checkpoint's own fp16/bf16 arrays (mapped, not copied) where the dtype
    policy widened a patched layer's scales, biases or bias to float32: ~15% of an INT4
    model's bytes that would otherwise be private copies. Call after `patch_model`; returns
    how many arrays were put back."""
    restored = []
    for path, layer in module.named_modules():
        if not isinstance(layer, (NativeQuantizedLinear, NativeQuantizedEmbedding)):
            continue
        policy = layer["scales"].dtype
        for name in HALF_IN_PLACE:
            original = stored.get(f"{path}.{name}" if path else name)
            if (
                name in layer
                and original is not None
                and original.dtype in (mx.float16, mx.bfloat16)
                and layer[name].dtype == mx.float32
            ):
                layer[name] = original
                restored.append(original)
        if isinstance(layer, NativeQuantizedEmbedding) and layer["scales"].dtype != policy:
            layer.lookup_dtype = policy
    return len(restored)


ENV_PACK = "SPECMLX_PACK"


def packed_of(layers: list[nn.Module]) -> list[mx.array]:
    """The layers' packed tiles, one each, for an op over all of them; [] unless all have them."""
    packs = [getattr(layer, "packed_tiles", None) for layer in layers]
    return packs if all(p is not None for p in packs) else []


def pack_layers(module: nn.Module) -> int:
    """Lay each kernel-patched 4-bit linear layer's weights out as the four-row tiles read
    them: per tile of four rows, its codes, scales and biases in one stream instead of
    twelve, which the prefetchers follow better (whole decode 1.11-1.18x on AVX-512 VNNI,
    bench/results/README.md, round 25; AVX2 1.03-1.07x, round 29). Only where those tiles run
    (int8 x on AVX-512 VNNI or AVX2),
    unless SPECMLX_PACK=0. The packed copy is private memory beside the mapped weights,
    which the other paths (float32 x, AMX prefill, MLX's fallback) still read. The values
    are the same, so each product's result is too, bitwise. Returns how many were packed."""
    if (
        _ext is None
        or not hasattr(_ext, "pack_quads")
        or os.environ.get(ENV_PACK, "1") == "0"
        or not _ext.reads_packed()
        or activations() != "int8"
        or mx.default_device() != mx.cpu
    ):
        return 0
    layers = [
        layer
        for layer in module.modules()
        if isinstance(layer, NativeQuantizedLinear)
        and layer.bits == 4
        and layer["weight"].shape[0] % 4 == 0
    ]
    for group_size in sorted({layer.group_size for layer in layers}):
        chosen = [layer for layer in layers if layer.group_size == group_size]
        parts = [[layer["weight"], layer["scales"], layer["biases"]] for layer in chosen]
        packs = _ext.pack_quads(parts, group_size)
        for layer, sources, packed in zip(chosen, parts, packs, strict=True):
            # not a parameter: never saved
            object.__setattr__(layer, "_packed", (tuple(sources), packed))
    return len(layers)


def patch_model(module: nn.Module) -> int:
    """Route the model's 4- and 8-bit affine QuantizedLinear / QuantizedEmbedding.as_linear
    layers, and its 6-bit ones under int8 x, through the native kernel; returns how many
    layers were patched (0 when unavailable).

    Layers keep their parameters and class ancestry (only __class__ changes to a subclass),
    and every call still checks it runs on a CPU stream, so a patched model stays usable
    anywhere. Other layers are left alone.
    """
    if _ext is None or mx.default_device() != mx.cpu:
        return 0
    if _env_problem:
        raise SpecmlxError(_env_problem)
    swaps = {
        nn.QuantizedLinear: NativeQuantizedLinear,
        nn.QuantizedEmbedding: NativeQuantizedEmbedding,
    }
    patched = 0
    for layer in module.modules():
        native_class = swaps.get(type(layer))
        if native_class is not None and _qualifies(layer):
            layer.__class__ = native_class
            patched += 1
    return patched
