"""The CPU backend: specmlx's native INT4/INT8 kernel, and the fp32 weights mode on a fast BLAS.

    native.py     loading the C++ extension (specmlx/cpu/_native), its switches
                  (instruction set, activations, threads) and what it is (describe, build_id)
    ops.py        its ops on arrays (INT4/INT8 matmul, row softmax, argmax), each falling
                  back to MLX's
    quantized.py  MLX's quantized layers on the kernel, and `patch_model`, which swaps a
                  model's layers for them
    packing.py    4-bit weights laid out as the kernel's four-row tiles read them
    mlp.py        gated MLPs whose gate and up projections run as one op
    qkv.py        an attention's q, k and v projections as one op
    source_match.py  which mlx-lm classes a patch takes, by their __call__'s code
    attention.py  mlx-lm's attention function, replaced in a model's modules by one that
                  runs the extension's attention op where it applies (SPECMLX_ATTENTION)
    blocks.py     a decoder layer whose block and parts are mlx-lm's plain ones and native,
                  run as one op (norms, q/k/v, attention, o, MLP and residuals)
    fp32.py       the fp32 weights mode: INT4 expanded to float32 at load, and the auto choice
    blas.py       finding a fast BLAS and putting it under MLX before mlx is loaded

`specmlx.load` calls `prepare` once per model, handing it the model's exactness rule
(specmlx.exactness.passes_exact): the rules need the caches and specmlx.stepwise, which
sit above this package, so they are an argument here rather than an import. The CLI
calls `setup_cli` at start-up, and only when fp32 weights are asked for: INT4 weights
never touch the BLAS's hot path.

Importing this package does not import mlx, so that `setup_cli` can run before libmlx binds
its BLAS; the names that need mlx load on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from ..errors import SpecmlxError
from .blas import blas_info, setup_cli

if TYPE_CHECKING:
    from collections.abc import Callable

    import mlx.core as mx
    import mlx.nn as nn

    from .native import available, build_id
    from .ops import argmax, softmax

__all__ = [
    "CPU_WEIGHTS",
    "argmax",
    "available",
    "blas_info",
    "build_id",
    "describe",
    "prepare",
    "setup_cli",
    "softmax",
]

# What `--cpu-weights` accepts: auto (see fp32.pick_cpu_weights), int4 as stored, or fp32.
CPU_WEIGHTS = ("auto", "int4", "fp32")

_LAZY = {"argmax": "ops", "available": "native", "build_id": "native", "softmax": "ops"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'specmlx.cpu' has no attribute {name!r}")
    value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


def describe() -> str:
    """One line for stats, benchmarks and the cost cache's keys: which INT4 matmul runs,
    and how, which attention, whether norms, RoPE and gated MLPs run as native ops, whether
    whole decoder layers do, and whether the layers' small modules are compiled."""
    from .. import compiled
    from . import attention, blocks, layers, native

    parts = (
        native.describe(),
        attention.describe(),
        layers.describe(),
        blocks.describe(),
        compiled.describe(),
    )
    return "; ".join(parts)


def prepare(
    module: nn.Module,
    cpu_weights: str,
    backend: str,
    use_native: bool = True,
    stored: dict[str, mx.array] | None = None,
    *,
    passes_exact: Callable[[nn.Module], bool],
) -> tuple[str, str]:
    """Make a freshly built model (floating parameters already cast) ready for the CPU:
    choose its weights mode, expand INT4 to float32 in the fp32 mode, and with
    `use_native` route the layers left quantized through the native kernel, and attention
    through the native op (specmlx.cpu.attention), and compile its norms, RoPE and MLPs
    (specmlx.compiled). `stored`: the parameters before the cast (by path); the kernel's
    layers get their fp16/bf16 scales, biases and bias back from it, used in place (see
    quantized.keep_stored_halves). `passes_exact(module)`: whether the model's pass over
    k tokens gives each position the bits a one-token step gives it
    (specmlx.exactness.passes_exact); where not, the kernel leaves int8 activations for
    good, so that speculation decodes what the target alone does.

    Returns (mode, why): mode 'int4', 'fp32', or 'dense' for an unquantized checkpoint.
    On the GPU nothing is patched (the kernel is CPU-only) and 'auto' keeps INT4.
    """
    if cpu_weights not in CPU_WEIGHTS:
        raise SpecmlxError(
            f"unknown CPU weights mode {cpu_weights!r}; use one of {', '.join(CPU_WEIGHTS)}"
        )
    import mlx.core as mx

    from .. import compiled
    from . import attention, blocks, fp32, layers, mlp, native, packing, qkv, quantized

    mode, why = fp32.pick_cpu_weights(module, cpu_weights, backend, use_native)
    if mode == "fp32":
        # Before the native patch, which then takes only the 8-bit layers left packed (and
        # the 6-bit ones, on int8 x: the only x its 6-bit tiles take).
        int8 = native.activations() == "int8"
        keep = ((6, 8) if int8 else (8,)) if use_native and native.available() else ()
        fp32.expand_quantized(module, keep_bits=keep)
    if use_native and native.available() and mx.default_device() == mx.cpu:
        # Before the patch: 6-bit layers run on the kernel only under int8 x.
        if native.activations() == "int8" and not passes_exact(module):
            name = getattr(module, "model_type", type(module).__name__)
            native.keep_float32(f"{name}'s multi-token passes are not bit-exact")
    if use_native and quantized.patch_model(module):
        if stored:
            quantized.keep_stored_halves(module, stored)
        packing.pack_layers(module)  # after the scales' type is final
        mlp.patch_mlps(module)
        qkv.patch_projections(module)
    if use_native:
        attention.patch_model(module)
        layers.patch_model(module)  # before compiled: the native norms and RoPEs stay uncompiled
        attention.patch_attentions(module)
        blocks.patch_blocks(module)
        compiled.patch_model(module)
    return mode, why
