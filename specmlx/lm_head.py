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
HEAD_OF_BODY = {"llama", "qwen2", "qwen3", "qwen3_moe", "phi3", "olmo2", "smollm3", "gemma3_text"}


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


def body_and_head(model: Model, x: mx.array, cache: list) -> tuple[mx.array, mx.array]:
    """(logits (1, L, V), last hidden states (1, L, D)) of a pass over tokens x (1, L):
    what model.module(x, cache) computes, with the hidden states kept."""
    layer, tied = head_layer(model)
    hidden = model.module.model(x, cache=cache)
    return (layer.as_linear(hidden) if tied else layer(hidden)), hidden
