"""`mx.compile` of the small modules of a model's layers on the CPU: norms, RoPE, MLPs.

A one-token step of a 28-layer model is ~4000 MLX ops on the CPU, where MLX's fast ops
run as their decompositions (an RMSNorm ~10 ops, a RoPE ~20), each dispatched on its own.
Compiled, a module's elementwise chains fuse into one generated kernel each, and the
trace is replayed instead of being rebuilt op by op (bench/results/compile_cpu.md).

Only modules whose inputs keep their shapes from step to step are compiled, so a trace
serves every step: RMSNorms (MLX's, or an architecture's own of one weight) and dense
MLPs on (batch, tokens, features), RoPE on (batch, heads, tokens, head dim) with its
offset passed as an array (an int would be a constant of the trace: a new trace each
step), and only for passes of at most MAX_TOKENS tokens (decode steps and verify passes;
a prefill's chunk lengths vary, and it runs as it did). Attention and the KV caches stay
outside: each step sees a new cache length, which would retrace the whole pass.

The compiled modules compute what the uncompiled ones do, rounding included, on x86-64
(tests/test_compiled.py): MLX builds its kernels with `g++ -O3` and no -march, so no
multiply and add are contracted. Wherever that differs, every decode step and verify
pass still runs compiled alike, and a compiled pass's rows equal compiled one-token
steps', so a verify row still equals its plain step.

MLX compiles each new fused kernel with the system's C++ compiler the first time it is
met (cached under $TMPDIR/mlx); without a compiler it runs the ops unfused, same results.
SPECMLX_COMPILE=1 (default) or 0, read once at import; `set_enabled` switches it later.
"""

from __future__ import annotations

import inspect
import os
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from .errors import SpecmlxError

ENV = "SPECMLX_COMPILE"
MAX_TOKENS = 16  # longest pass compiled: more than a verify pass (settings.MAX_GAMMA + 1)
DENSE_MLP = {"gate_proj", "up_proj", "down_proj"}


def _env() -> tuple[bool, str]:
    """(whether ENV asks for compiled modules, '' or why its value is bad)."""
    text = os.environ.get(ENV, "").strip()
    if text in ("", "1"):
        return True, ""
    if text == "0":
        return False, ""
    return True, f"{ENV} must be 0 or 1, got {text!r}"


# A bad value is reported when a model is prepared (patch_model), as one line from the CLI.
_enabled, _env_problem = _env()


def enabled() -> bool:
    return _enabled


def set_enabled(on: bool) -> None:
    """Run patched modules compiled (True) or as they were (False) from the next call."""
    global _enabled
    _enabled = on


def describe() -> str:
    # Where specmlx.cpu.layers has swapped nn.RMSNorm and nn.RoPE for native ops, only the
    # other norms and RoPEs are left here to compile.
    return "compiled MLPs and the norms and RoPEs left to MLX" if _enabled else "uncompiled"


class _CompiledModule:
    """Mixed in before a module's own class: its call goes through `_compiled` (set per
    instance by patch_model) for inputs of the shapes it was compiled for."""

    _token_axis_ndim: int  # the input's rank where the token axis is the second to last

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        if _enabled and x.ndim == self._token_axis_ndim and x.shape[-2] <= MAX_TOKENS:
            return self._compiled(x, *args, **kwargs)
        return super().__call__(x, *args, **kwargs)


_subclasses: dict[type, type] = {}


def _swap(module: nn.Module, ndim: int, compiled) -> None:
    """Give `module` a subclass of its class that calls `compiled`; its parameters and its
    class ancestry stay as they were."""
    cls = type(module)
    sub = _subclasses.get(cls)
    if sub is None:
        sub = type(f"Compiled{cls.__name__}", (_CompiledModule, cls), {"_token_axis_ndim": ndim})
        _subclasses[cls] = sub
    object.__setattr__(module, "_compiled", compiled)
    module.__class__ = sub


def _rope(module: nn.RoPE):
    traced = mx.compile(partial(nn.RoPE.__call__, module))

    def call(x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return traced(x, offset if isinstance(offset, mx.array) else mx.array(offset, mx.int32))

    return call


def _norm(module: nn.Module) -> bool:
    """nn.RMSNorm, or an architecture's own RMSNorm (Gemma's scales by 1 + weight): one
    weight, no children, called on x alone."""
    cls = type(module)
    if cls is nn.RMSNorm:
        return True
    return (
        cls.__name__ == "RMSNorm"
        and set(module) == {"weight"}
        and list(inspect.signature(cls.__call__).parameters) == ["self", "x"]
    )


def _dense_mlp(module: nn.Module) -> bool:
    children = module.children()
    return set(children) == DENSE_MLP and all(
        isinstance(c, (nn.Linear, nn.QuantizedLinear)) for c in children.values()
    )


def patch_model(module: nn.Module, cpu_only: bool = True) -> int:
    """Compile `module`'s RMSNorms, RoPEs and dense MLPs (on the CPU); how many. Modules
    of other kinds are left as they are, and so is a model on the GPU unless `cpu_only`
    is False: there the exactness argument above is not established (a GPU's kernels
    may round differently at different shapes), so only bench/gpu_check.py asks, to
    measure what compiling would gain."""
    if _env_problem:
        raise SpecmlxError(_env_problem)
    if cpu_only and mx.default_device() != mx.cpu:
        return 0
    count = 0
    for layer in module.modules():
        cls = type(layer)
        if isinstance(layer, _CompiledModule):
            continue
        if _norm(layer):
            _swap(layer, 3, mx.compile(partial(cls.__call__, layer)))
        elif cls is nn.RoPE:
            _swap(layer, 4, _rope(layer))
        elif _dense_mlp(layer):
            _swap(layer, 3, mx.compile(partial(cls.__call__, layer)))
        else:
            continue
        count += 1
    return count
