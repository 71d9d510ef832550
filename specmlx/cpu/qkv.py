"""The q, k and v projections of one attention as one stacked native op: x quantized
once and one dispatch for the three products, each with its own output.

The line of mlx-lm's attentions (53 of its model files) that makes the three projections
of one x, in that order, is QKV_LINE: where an attention's __call__ has it as a statement
of its own, its three projections are stacked.
"""

from __future__ import annotations

import ast

import mlx.core as mx
import mlx.nn as nn

from . import native
from .ops import supports
from .packing import packed_of
from .quantized import NativeQuantizedLinear
from .source_match import call_tree

QKV_LINE = "queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)"
QKV = ("q_proj", "k_proj", "v_proj")


def _projects_qkv(cls: type) -> bool:
    """Whether cls.__call__ contains QKV_LINE as a statement of its own."""
    tree = call_tree(cls)
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
        self.outs = native._ext.stacked_matmul(x, weights, biases, q.group_size, q.bits, packed)
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
    QKV_LINE (see _Stack); returns how many attentions. Call after
    quantized.keep_stored_halves."""
    if native.op("stacked_matmul") is None:
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
