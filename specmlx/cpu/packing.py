"""4-bit weights laid out as the kernel's four-row tiles read them.

A tile of four rows reads each row's codes, scales and biases: twelve streams through
memory, which the hardware prefetchers follow worse than one. `pack_layers` gives each
kernel-patched 4-bit linear layer a private copy with, per tile, its codes, scales and
biases in one stream (see bench/results/ARCHIVE.md, "Packed weights"). The values are the
same, so each product's result is too, bitwise.

Made at every load, the copies would be private memory beside the mapped weights, as large
as the 4-bit layers, in every process. Where every part comes from a mapped file
(specmlx.loading notes each mapped array's file and tensor name here), the copies are a
function of those files and this extension's build alone, so they are kept in
$SPECMLX_HOME/mapped (specmlx.aligned: written once, bounded, forgotten with the model)
and mapped: a second start and a second process pack nothing and hold no copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref

import mlx.core as mx
import mlx.nn as nn

from .. import aligned
from ..errors import SpecmlxError
from . import native
from .quantized import NativeQuantizedLinear

ENV_PACK = "SPECMLX_PACK"

# id(array) -> (a weak reference to it, [its file's aligned.identity, its tensor name])
_sources: dict[int, tuple[weakref.ref, list]] = {}


def note_source(array: mx.array, file: list, name: str) -> None:
    """Record that `array` is tensor `name` of `file` (aligned.identity), as on disk."""
    key = id(array)
    # The callback runs as the array dies, before its id can be another array's.
    _sources[key] = (weakref.ref(array, lambda _: _sources.pop(key, None)), [file, name])


def source_of(array: mx.array) -> list | None:
    entry = _sources.get(id(array))
    return entry[1] if entry is not None and entry[0]() is array else None


def packed_of(layers: list[nn.Module]) -> list[mx.array]:
    """The layers' packed tiles, one each, for an op over all of them; [] unless all have them."""
    packs = [getattr(layer, "packed_tiles", None) for layer in layers]
    return packs if all(p is not None for p in packs) else []


def pack_layers(module: nn.Module) -> int:
    """Give each kernel-patched 4-bit linear layer a packed copy of its weights (see the
    module's docstring). Only where those tiles run (int8 x on AVX-512 VNNI or AVX2),
    unless SPECMLX_PACK=0. The copies are mapped from the cache where they can be
    (`cached_packs`), else private memory; beside the weights, which the other paths
    (float32 x, AMX prefill, MLX's fallback) still read. Call once the scales' type is
    final (after quantized.keep_stored_halves); returns how many were packed."""
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
        packs = cached_packs(parts, group_size) or pack_quads(parts, group_size)
        for layer, sources, packed in zip(chosen, parts, packs, strict=True):
            # not a parameter: never saved
            object.__setattr__(layer, "_packed", (tuple(sources), packed))
    return len(layers)


def cached_packs(parts: list[list[mx.array]], group_size: int) -> list[mx.array] | None:
    """The packed copies of the (weight, scales, biases) `parts`, mapped from the cache,
    packed (one layer at a time) and stored there first where they are not; None where
    they cannot be: a part not mapped from a file, SPECMLX_MAPPED_CACHE_GB=0, a cache that
    cannot be written or mapped."""
    named = [[source_of(a) for a in triple] for triple in parts]
    names = [triple[0][1] if triple[0] else "" for triple in named]
    if (
        not parts
        or not native.build_id()
        or any(s is None for triple in named for s in triple)
        or len(set(names)) < len(names)
        or aligned.limit_bytes() == 0
    ):
        return None
    files = sorted({json.dumps(s[0]) for triple in named for s in triple})
    sources = [json.loads(f) for f in files]
    # What the bytes are: this build's layout of these tensors. A rebuilt extension, whose
    # layout may differ, never reads another build's copies.
    recipe = [[[files.index(json.dumps(f)), name] for f, name in triple] for triple in named]
    text = json.dumps(["packed", native.build_id(), group_size, recipe])
    kind = "packed tiles " + hashlib.sha256(text.encode()).hexdigest()[:40]
    pack_quads = native.op("pack_quads")
    try:
        header = aligned.find_blobs(kind, sources, names)
        if header is None:
            about = sum(a.nbytes for triple in parts for a in triple)  # what packing keeps
            if not aligned.fits(sources, about, aligned.cache_path(sources, kind)):
                return None
            blobs = ((n, pack_quads([p], group_size)[0]) for n, p in zip(names, parts, strict=True))
            header = aligned.store_blobs(kind, sources, names, blobs)
        entries = []
        for name in names:
            t = header.tensors[name]
            entries.append((t.begin, [t.end - t.begin], mx.uint8))
        packs = native.op("map_tensors")(str(header.path), entries)
    except (OSError, ValueError, SpecmlxError):  # the cache unwritable, a file gone
        return None
    return packs if all(p is not None for p in packs) else None
