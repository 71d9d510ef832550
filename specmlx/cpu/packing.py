"""4-bit weights laid out as the kernel's four-row tiles read them.

A tile of four rows reads each row's codes, scales and biases: twelve streams through
memory, which the hardware prefetchers follow worse than one. `pack_layers` gives each
kernel-patched 4-bit linear layer a private copy with, per tile, its codes, scales and
biases in one stream (see bench/results/ARCHIVE.md, "Packed weights"). The values are the
same, so each product's result is too, bitwise.
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn

from . import native
from .quantized import NativeQuantizedLinear

ENV_PACK = "SPECMLX_PACK"


def packed_of(layers: list[nn.Module]) -> list[mx.array]:
    """The layers' packed tiles, one each, for an op over all of them; [] unless all have them."""
    packs = [getattr(layer, "packed_tiles", None) for layer in layers]
    return packs if all(p is not None for p in packs) else []


def pack_layers(module: nn.Module) -> int:
    """Give each kernel-patched 4-bit linear layer a packed copy of its weights (see the
    module's docstring). Only where those tiles run (int8 x on AVX-512 VNNI or AVX2),
    unless SPECMLX_PACK=0. The copy is private memory beside the mapped weights, which the
    other paths (float32 x, AMX prefill, MLX's fallback) still read. Call once the scales'
    type is final (after quantized.keep_stored_halves); returns how many were packed."""
    pack_quads = native.op("pack_quads")
    if (
        pack_quads is None
        or os.environ.get(ENV_PACK, "1") == "0"
        or not native._ext.reads_packed()
        or native.activations() != "int8"
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
        packs = pack_quads(parts, group_size)
        for layer, sources, packed in zip(chosen, parts, packs, strict=True):
            # not a parameter: never saved
            object.__setattr__(layer, "_packed", (tuple(sources), packed))
    return len(layers)
