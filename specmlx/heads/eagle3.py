"""EAGLE-3 checkpoints as EAGLE (SafeAILab) and SpecForge publish them.

The layout (EAGLE's eagle/model/cnets.py `Model`, SpecForge's LlamaForCausalLMEagle3, vLLM's
llama_eagle3.py loader): `fc` (D, 3 D), no bias, folds the outputs of three target layers
into one D-wide feature; `midlayer` is one Llama decoder layer whose q/k/v read 2 D:
[input_layernorm(embedding of the next token), hidden_norm(feature)], its residual the
feature itself (or the normed feature, with `norm_before_residual`, as vLLM reads it);
`norm` and `lm_head` (draft_vocab, D) give the logits over a draft vocabulary whose row i
is target token i + d2t[i]; `t2d` (vocab,) marks those tokens in the target's vocabulary.
The midlayer's output before `norm` is the feature it drafts further from, without fc.
Row r of its cache took the feature of position r, so RoPE runs at the cache's offset, as
EAGLE's position ids do. Its embedding is the target's (a shipped embed_tokens is ignored).

Which target layers: EAGLE and SpecForge tap the outputs of layers 1, N/2 - 1 and N - 4
(0-based; HF's hidden_states[2], [N/2], [N-3]); a config may name them in
`eagle_aux_hidden_state_layer_ids` (top level, or in `eagle_config`) in one of two
conventions, told apart as SGLang does (sgl-project/sglang#25454): ids from 1 are layers'
outputs (SpecForge's, which SGLang shifts by one), other ids count hidden-state
boundaries, 0 the embedding (vLLM's; the same layers by default: 2, N/2, N - 3).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from ..errors import SpecmlxError
from ..loading import Model
from ..safetensors import read_header
from .feature import text_args
from .head import Head, quantize_linears, ready

WEIGHTS = "model.safetensors"  # the quantized copy's one file
MAPPING = ("d2t", "t2d")  # buffers, not parameters of the module
IGNORED = "embed_tokens.weight"  # the target's embedding is used


class Midlayer(nn.Module):
    """EAGLE-3's decoder layer: mlx-lm's Llama attention built 2 D wide, its o_proj back
    to D; the Llama MLP; three norms."""

    def __init__(self, args: llama.ModelArgs, norm_before_residual: bool):
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = llama.Attention(replace(args, hidden_size=2 * dim))
        width = args.num_attention_heads * self.self_attn.head_dim
        self.self_attn.o_proj = nn.Linear(width, dim, bias=args.attention_bias)
        self.mlp = llama.MLP(args)
        self.input_layernorm = nn.RMSNorm(dim, eps=eps)
        self.hidden_norm = nn.RMSNorm(dim, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(dim, eps=eps)
        self.norm_before_residual = norm_before_residual

    def __call__(self, embedded: mx.array, feature: mx.array, cache: KVCache) -> mx.array:
        normed = self.hidden_norm(feature)
        x = mx.concatenate([self.input_layernorm(embedded), normed], axis=-1)
        h = normed if self.norm_before_residual else feature
        h = h + self.self_attn(x, create_attention_mask(x, cache), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3(nn.Module):
    """The Head module: (embedded, features, cache) -> (midlayer output, what lm_head
    reads). Features 3 D wide (the target's) go through fc first; D wide (its own) not.
    `lm_head` is Head.rows, kept here so that one head.ready puts it in the target's form
    too."""

    def __init__(self, config: dict, rows: int):
        super().__init__()
        args = model_args(config)
        dim, eps = args.hidden_size, args.rms_norm_eps
        tapped = config.get("target_hidden_size") or dim
        if config.get("fc_norm"):  # SpecForge's: each tapped layer's output normed first
            self.fc_norm = [nn.RMSNorm(tapped, eps=eps) for _ in range(3)]
        self.fc = nn.Linear(3 * tapped, dim, bias=False)
        self.midlayer = Midlayer(args, bool(config.get("norm_before_residual")))
        self.norm = nn.RMSNorm(dim, eps=eps)
        self.lm_head = nn.Linear(dim, rows, bias=False)
        self.dim = dim
        self.norm_output = config.get("norm_output", True)  # SpecForge's; False: raw output

    def __call__(self, embedded: mx.array, features: mx.array, cache: KVCache) -> tuple:
        if features.shape[-1] != self.dim:
            if "fc_norm" in self:
                parts = zip(self.fc_norm, mx.split(features, 3, axis=-1), strict=True)
                features = mx.concatenate([norm(p) for norm, p in parts], axis=-1)
            features = self.fc(features)
        h = self.midlayer(embedded, features, cache)
        return h, self.norm(h) if self.norm_output else h


def model_args(config: dict) -> llama.ModelArgs:
    """mlx-lm's Llama args of the checkpoint's one layer (RoPE from rope_theta and
    rope_scaling, or transformers 5's rope_parameters)."""
    fields = {**config, "model_type": "llama", "num_hidden_layers": 1}
    rope = config.get("rope_parameters")
    if rope and "rope_theta" not in config:
        fields["rope_theta"] = rope.get("rope_theta", 10000.0)
        default = rope.get("rope_type", "default") == "default"
        fields["rope_scaling"] = None if default else rope
    # the attention is built 2 D wide: its head size must not follow from that width
    fields["head_dim"] = (
        config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    )
    return llama.ModelArgs.from_dict(fields)


def read_checkpoint(path: Path) -> tuple[dict, dict[str, mx.array]]:
    """(config, weights) of an EAGLE-3 checkpoint directory, safetensors only; a shipped
    embed_tokens is dropped."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise SpecmlxError(f"cannot read the EAGLE-3 config in {path} ({e})") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SpecmlxError(
            f"{path} holds no .safetensors file (specmlx reads EAGLE-3 weights from "
            "safetensors only); convert its pytorch_model.bin with safetensors' "
            "save_file, or download the checkpoint's safetensors"
        )
    weights: dict[str, mx.array] = {}
    for file in files:
        read_header(file)  # a truncated or corrupt file refused in one line, not by mx.load
        weights.update(mx.load(str(file)))
    weights.pop(IGNORED, None)
    if "lm_head.weight" not in weights:
        raise SpecmlxError(f"{path} has no lm_head.weight: it is not an EAGLE-3 checkpoint")
    return config, weights


def build(config: dict, weights: dict[str, mx.array], path: Path) -> Eagle3:
    """The module holding `weights` (quantized layers where they come with .scales), strictly
    by the published key names; refused in one line where they do not match."""
    try:
        module = Eagle3(config, weights["lm_head.weight"].shape[0])
        quantization = config.get("quantization")
        if quantization:
            nn.quantize(
                module,
                group_size=quantization["group_size"],
                bits=quantization["bits"],
                class_predicate=lambda name, _: f"{name}.scales" in weights,
            )
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise SpecmlxError(f"{path} is not an EAGLE-3 checkpoint specmlx reads ({e!r})") from None
    try:
        module.load_weights([(k, v) for k, v in weights.items() if k not in MAPPING])
    except ValueError as e:
        why = str(e).splitlines()[0]
        raise SpecmlxError(
            f"the weights in {path} do not match the EAGLE-3 layout specmlx reads ({why})"
        ) from None
    return module


def layer_taps(config: dict, layers: int) -> tuple[int, ...]:
    """The target layers (0-based) whose outputs the checkpoint reads (module docstring)."""
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = config.get("eagle_aux_hidden_state_layer_ids") or nested
    if not ids:
        return 1, layers // 2 - 1, layers - 4
    return tuple(int(i) if ids[0] == 1 else int(i) - 1 for i in ids)


def draft_ids(weights: dict[str, mx.array]) -> np.ndarray:
    """The target id of each draft row: i + d2t[i] (no d2t: a full draft vocabulary)."""
    rows = np.arange(weights["lm_head.weight"].shape[0])
    d2t = weights.get("d2t")
    return rows if d2t is None else rows + np.asarray(d2t).astype(np.int64)


def check_fit(
    config: dict, weights: dict, ids: np.ndarray, taps: tuple[int, ...], target: Model, path: Path
) -> None:
    """Refuse, in one line, a checkpoint made for another target."""
    inner, args = text_args(target)
    layers = len(inner.model.layers)
    hidden = config.get("hidden_size", args.hidden_size)  # none: refused when built
    for size in (hidden, config.get("target_hidden_size") or hidden):
        if size != args.hidden_size:
            raise SpecmlxError(
                f"the EAGLE-3 head in {path} is {size} wide, but {target.name} has hidden "
                f"size {args.hidden_size}; use a head trained for this target"
            )
    t2d = weights.get("t2d")
    for vocab in (config.get("vocab_size", args.vocab_size), None if t2d is None else t2d.shape[0]):
        if vocab not in (None, args.vocab_size):
            raise SpecmlxError(
                f"the EAGLE-3 head in {path} is for a vocabulary of {vocab} tokens, but "
                f"{target.name} has {args.vocab_size}; use a head trained for this target"
            )
    if not all(0 <= i < layers for i in taps):
        raise SpecmlxError(
            f"the EAGLE-3 head in {path} reads target layers {list(taps)}, but "
            f"{target.name} has {layers}; use a head trained for this target"
        )
    if ids.min(initial=0) < 0 or len(np.unique(ids)) != len(ids):
        raise SpecmlxError(
            f"the EAGLE-3 head in {path} maps two draft rows to one token, or one to a "
            "negative id (its d2t is broken); download it again"
        )


def load_eagle3(path: Path, target: Model) -> Head:
    """The EAGLE-3 head in directory `path`, for `target`, in the target's form (INT4
    where the target keeps INT4; a checkpoint quantized by quantize_eagle3 as stored);
    refused in one line where it was made for another target."""
    start = time.perf_counter()
    config, weights = read_checkpoint(path)
    taps = layer_taps(config, len(text_args(target)[0].model.layers))
    ids = draft_ids(weights)
    check_fit(config, weights, ids, taps, target, path)
    # Head.ids ascend; ids past the tokenizer's (padding rows) are never the target's token
    order = np.argsort(ids, kind="stable")
    keep = order[ids[order] < target.vocab_size]
    for name in [k for k in weights if k.startswith("lm_head.")]:
        weights[name] = weights[name][mx.array(keep)]  # row-wise: quantized rows cut exactly
    module = build(config, weights, path)
    ready(module, target)
    head = Head(
        module,
        module.lm_head,
        False,
        mx.array(ids[keep], mx.uint32),
        target,
        "EAGLE-3",
        path,
        taps,
    )
    head.info["weights_s"] = time.perf_counter() - start
    return head


def quantize_eagle3(src: Path, out: Path, group_size: int = 64, bits: int = 4) -> None:
    """Write an INT`bits` copy of the EAGLE-3 checkpoint in `src` to `out`, atomically, in
    MLX's format (.scales/.biases beside each linear layer's packed weight, config.json's
    "quantization"); d2t, t2d and the norms as they were, a shipped embedding left out."""
    from ..convert.output import atomic_directory, check_output, check_writable
    from ..convert.quantize import check_settings

    check_settings(bits, group_size, bits, None)
    check_output(out, src, force=True)
    check_writable(out)
    config, weights = read_checkpoint(src)
    if config.get("quantization"):
        raise SpecmlxError(f"{src} is already quantized; quantize the original checkpoint")
    module = build(config, weights, src)
    quantize_linears(module, group_size, bits)
    tensors = dict(tree_flatten(module.parameters()))
    tensors.update({k: weights[k] for k in MAPPING if k in weights})
    config = {**config, "quantization": {"group_size": group_size, "bits": bits}}
    with atomic_directory(out) as tmp:
        mx.save_safetensors(str(tmp / WEIGHTS), tensors, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
