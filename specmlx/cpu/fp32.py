"""The fp32 CPU weights mode: INT4 weights expanded to float32 at load, for a fast BLAS.

Why: MLX's own CPU INT4 matmul costs about k times one row to verify k rows, so
speculation cannot pay on it. Dense float32 matmuls go to BLAS (`cblas_sgemm`), which on
a fast BLAS (blas.py) is nearly flat in k: the memory-bound regime where speculation
pays, at 8x the weight memory. specmlx's native INT4 kernel (native.py) is flat in k too
and reads 8x fewer bytes, and it is faster at every k measured
(bench/results/blas_verify.md), so `auto` keeps INT4 wherever that kernel runs and fp32
is for machines without it, or for asking explicitly.
"""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from . import quantized
from .blas import fast_blas_active

# Headroom over the float32 weights for activations, KV caches and the draft's share.
MEMORY_MARGIN = 1.3


def is_quantized(layer: nn.Module) -> bool:
    return isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding))


def dequantized(layer: nn.Module) -> mx.array:
    """A quantized layer's weight as float32 (a dense layer's as it is, cast)."""
    if not is_quantized(layer):
        return layer["weight"].astype(mx.float32)
    return mx.dequantize(
        layer["weight"],
        layer["scales"],
        layer.get("biases"),
        group_size=layer.group_size,
        bits=layer.bits,
        mode=getattr(layer, "mode", "affine"),
    ).astype(mx.float32)


def dense_params(module: nn.Module) -> int:
    """Parameter count, packed quantized weights counted as the values they hold."""
    layers = dict(module.named_modules())
    total = 0
    for path, value in tree_flatten(module.parameters()):
        owner, _, name = path.rpartition(".")
        layer = layers.get(owner)
        if layer is not None and is_quantized(layer):
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


def pick_cpu_weights(
    module: nn.Module, requested: str, backend: str, use_native: bool = True
) -> tuple[str, str]:
    """('dense', 'int4' or 'fp32', why) for a freshly built model; `requested` is one of
    CPU_WEIGHTS (specmlx.cpu checks it).

    'auto' expands to float32 only where it pays: the CPU backend, no native INT4 kernel
    for these layers (asked first, so that the usual answer needs no BLAS look-up), a
    fast BLAS already under MLX (auto never loads one: the CLI does that at start-up, and
    only when fp32 is asked for), and room for params x 4 bytes x MEMORY_MARGIN in the
    memory available now.
    """
    if not any(is_quantized(m) for m in module.modules()):
        return "dense", "checkpoint is not quantized"
    if requested != "auto":
        return requested, "requested"
    if backend != "cpu":
        return "int4", f"backend is {backend}"
    if use_native and quantized.runs_int4(module):
        return "int4", "native INT4 kernel"
    if not fast_blas_active():
        return "int4", "no fast BLAS loaded (--cpu-weights fp32 loads one)"
    need = dense_params(module) * 4 * MEMORY_MARGIN
    free = available_memory()
    if need > free:
        return "int4", f"float32 needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB available"
    return "fp32", f"fast BLAS and {free / 2**30:.1f} GiB available"


def expand_quantized(module: nn.Module, keep_bits: tuple[int, ...] = ()) -> int:
    """Replace quantized layers by float32 Linear / Embedding; returns how many.

    The new weights are lazy `mx.dequantize` of the packed ones, so nothing is computed
    here: each is expanded when first evaluated, and the packed copy is freed once no
    graph needs it. Tied heads work unchanged: Embedding.as_linear is a dense matmul.
    Layers with `keep_bits` stay packed: specmlx's 8-bit embeddings and output heads,
    which the native kernel runs faster than a BLAS runs them in float32 at a few rows
    (bench/head_matmul.py), so the fp32 mode keeps them there.
    """

    def expands(layer: nn.Module) -> bool:
        return is_quantized(layer) and layer.bits not in keep_bits

    def dense(_path: str, layer: nn.Module) -> nn.Module:
        if not expands(layer):
            return layer
        weight = dequantized(layer)
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
