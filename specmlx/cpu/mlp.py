"""Gated MLPs whose gate and up projections run as one native op: act(gate(x)) * up(x),
act silu or gelu_approx, with x quantized once, one dispatch and a vector sigmoid.

An MLP is given the op only when its __call__ is exactly one of mlx-lm's gated bodies
(GATED_BODIES) with the activation it names, so that a variant (a clamp, another
activation) never is.
"""

from __future__ import annotations

import ast

import mlx.core as mx
import mlx.nn as nn

from . import native
from .ops import supports
from .packing import packed_of
from .quantized import NativeQuantizedLinear
from .source_match import call_body, mixed_class

GATE_ACTIVATIONS = {"silu": nn.silu, "gelu_approx": nn.gelu_approx}

# The bodies of mlx-lm's gated MLPs (silu: Llama, Qwen2/3, Mistral and ~45 others;
# gelu_approx: Gemma), each with its activation and the name it must resolve to.
GATED_BODIES = {
    "return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))": ("silu", "swiglu"),
    "return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))": ("silu", "nn"),
    "return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))": (
        "gelu_approx",
        "nn",
    ),
}


def gated_matmul(
    x: mx.array, gate: nn.QuantizedLinear, up: nn.QuantizedLinear, activation: str = "silu"
) -> mx.array:
    """act(gate(x)) * up(x), act silu or gelu_approx: the native gated op where both layers
    and the call suit it, else the two layers and MLX's activation."""
    op = native.op("gated_matmul")
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


_gated_classes: dict[type, type | None] = {}


def _gated_attrs(cls: type) -> dict | None:
    activation = _gated_activation(cls)
    return None if activation is None else {"_activation": activation}


def _gated_class(cls: type) -> type | None:
    """cls with _GatedMLP mixed in, or None where cls is not a gated MLP the op has."""
    return mixed_class(_gated_classes, cls, _GatedMLP, "NativeGated", _gated_attrs)


def patch_mlps(module: nn.Module) -> int:
    """Give the model's gated MLPs whose gate and up projections run on the kernel the
    gated op; returns how many. Call after quantized.patch_model."""
    if native.op("gated_matmul") is None:
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
