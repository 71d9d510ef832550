"""Where a model's logits are its output head over its body's last hidden states.

A draft head cut to a sub-vocabulary (drafters.subvocab) and a drafter that reads the
target's hidden states (the Target's `hidden` mode) both split a model's forward pass
into body and head, which is exact only where mlx-lm's Model computes
head(self.model(inputs, cache)) and nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

if TYPE_CHECKING:
    from .loading import Model

# Architectures whose mlx-lm Model computes logits as exactly head(self.model(inputs, cache)),
# the head being `lm_head` or, when tied, `model.embed_tokens.as_linear` (no softcapping,
# scaling or wrapper in between).
HEAD_OF_BODY = {
    *("llama", "qwen2", "qwen3", "qwen3_moe", "phi3", "olmo2", "smollm3", "gemma3_text"),
    *("qwen3_next", "deepseek_v3", "glm4_moe", "mimo"),
}


def cuttable(model: Model) -> bool:
    """Whether this model's forward pass splits into body and head (see HEAD_OF_BODY)."""
    module = model.module
    return (
        isinstance(module, nn.Module)  # not a wrapper around one
        and model.config.get("model_type") in HEAD_OF_BODY
        and "model" in module
    )


def head_layer(model: Model) -> tuple[nn.Module, bool]:
    """(the output head layer, whether it is the tied embedding)."""
    module = model.module
    if "lm_head" in module:
        return module.lm_head, False
    return module.model.embed_tokens, True


def body_and_head(
    model: Model, x: mx.array, cache: list, taps: tuple[int, ...] | None = None
) -> tuple[mx.array, mx.array]:
    """(logits (1, L, V), features (1, L, F)) of a pass over tokens x (1, L): what
    model.module(x, cache) computes, with the features kept (see `body`)."""
    layer, tied = head_layer(model)
    hidden, features = body(model, x, cache, taps)
    return (layer.as_linear(hidden) if tied else layer(hidden)), features


def body(
    model: Model, x: mx.array, cache: list, taps: tuple[int, ...] | None = None
) -> tuple[mx.array, mx.array]:
    """(last hidden states (1, L, D), features (1, L, F)) of the body's pass over x. The
    features are the last hidden states themselves, or with `taps` the outputs of those
    decoder layers (0-based) side by side (EAGLE-3 reads three: F = 3 D)."""
    if not taps:
        hidden = model.module.model(x, cache=cache)
        return hidden, hidden
    stack, seen = model.module.model.layers, {}
    for i in taps:
        stack[i] = _Tap(stack[i], seen, i)
    try:
        hidden = model.module.model(x, cache=cache)
    finally:
        for i in taps:
            stack[i] = stack[i].inner
    return hidden, mx.concatenate([seen[i] for i in taps], axis=-1)


class _Tap:
    """A decoder layer that keeps its output: mlx-lm's model runs it as the layer itself
    (its attributes, e.g. which kind of layer it is, read through)."""

    def __init__(self, inner, seen: dict, index: int):
        self.inner, self.seen, self.index = inner, seen, index

    def __call__(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        self.seen[self.index] = out
        return out

    def __getattr__(self, name: str):
        return getattr(self.inner, name)
