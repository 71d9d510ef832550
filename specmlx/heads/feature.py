"""A feature head: one decoder layer that drafts from the target's own features.

Its input at position i is the target's feature there (the last hidden state, after the
final norm: what the target's output head reads) beside the embedding of the token that
came next; one decoder layer of the target's own mlx-lm class (its own small KV cache)
turns them into the feature it expects at i + 1, which the target's output head (cut to a
sub-vocabulary) reads as the next token's logits. It drafts further from its own output
features. This is the layout of EAGLE (Li et al. 2024) with MTP's input norms, which
Qwen3-Next's `mtp.*` and DeepSeek-V3's NextN layers share, so one class reads all three.
"""

from __future__ import annotations

import copy
from dataclasses import fields, replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, make_prompt_cache

from ..loading import Model


class FeatureHead(nn.Module):
    def __init__(self, layer: nn.Module, dim: int, eps: float):
        super().__init__()
        self.enorm = nn.RMSNorm(dim, eps=eps)  # on the next token's embedding
        self.hnorm = nn.RMSNorm(dim, eps=eps)  # on the feature
        self.fc = nn.Linear(2 * dim, dim, bias=False)
        self.layer = layer
        self.norm = nn.RMSNorm(dim, eps=eps)

    def __call__(self, embedded: mx.array, features: mx.array, cache: KVCache) -> tuple:
        """(the features it drafts further from, what the output head reads), both
        (1, L, D), for L positions: embeddings and features (1, L, D)."""
        x = self.fc(mx.concatenate([self.enorm(embedded), self.hnorm(features)], axis=-1))
        h = self.layer(x, create_attention_mask(x, cache), cache)
        out = self.norm(h)
        return out, out


def text_args(target: Model):
    """The target's mlx-lm ModelArgs (a multimodal wrapper's language model's)."""
    module = target.module
    inner = module.language_model if "language_model" in module else module
    return inner, inner.args


def attention_layer(target: Model) -> nn.Module:
    """A new decoder layer of the target's own mlx-lm class, one with full attention (a
    hybrid target's linear-attention layers keep a recurrent state, which a head's
    cache must not): the first such layer of a few-layer model built from its args."""
    inner, args = text_args(target)
    for n in range(1, 9):
        module = type(inner)(fewer_layers(args, n))
        for i, c in enumerate(make_prompt_cache(module)):
            if type(c) is KVCache:
                return module.model.layers[i]
    arch = target.config.get("model_type", "this architecture")
    raise ValueError(f"{arch} has no full-attention layer in its first 8 for a head")


def fewer_layers(args, n: int):
    """The args of the same model with its first n layers: per-layer lists (SmolLM3's
    `no_rope_layers`, layer types) cut to them as well."""
    layers = args.num_hidden_layers
    cut = {
        f.name: getattr(args, f.name)[:n]
        for f in fields(args)
        if isinstance(getattr(args, f.name), list | tuple) and len(getattr(args, f.name)) == layers
    }
    return replace(args, num_hidden_layers=n, **cut)


def new_head(target: Model, seed: int = 0) -> FeatureHead:
    """A randomly initialised head for `target` (what `specmlx head train` starts from);
    its output norm starts as a copy of the target's final norm (of its class: Gemma's
    scales by 1 + weight), which it then learns on its own."""
    inner, args = text_args(target)
    mx.random.seed(seed)
    dim, eps = args.hidden_size, getattr(args, "rms_norm_eps", 1e-6)
    head = FeatureHead(attention_layer(target), dim, eps)
    head.norm = copy.copy(inner.model.norm)
    return head
