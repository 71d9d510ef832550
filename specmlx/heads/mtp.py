"""The MTP layers a checkpoint ships inside the target itself, read as a feature head.

Each is one decoder layer of the target's own class with EAGLE's inputs (feature.py); the
layouts differ in names and in three details (D the hidden size, N num_hidden_layers):

- Qwen3-Next, `mtp.*` (vLLM's qwen3_next_mtp.py): fc (D, 2 D) over
  [pre_fc_norm_embedding(embedding), pre_fc_norm_hidden(feature)], `layers.0` a
  full-attention decoder layer, `norm`, whose output is both fed back and read by the
  target's lm_head. Its RMSNorms scale by 1 + weight, so the upstream files store
  weight - 1: mlx-lm's sanitize adds the 1 to the target's norms, and here to these.
- DeepSeek-V3 and GLM-4.x MoE, NextN as `model.layers.{N}.*` (vLLM's deepseek_mtp.py and
  glm4_moe_mtp.py): eh_proj over [enorm(embedding), hnorm(feature)], the decoder layer's
  own keys beside them (built as layer N: a MoE layer where N is), `shared_head.norm`.
  The layer's output before that norm is fed back; lm_head reads the normed one.
  `embed_tokens` and `shared_head.head` are copies of the target's, which are used.
- MiMo, `model.mtp_layers.{i}.*` (vLLM's mimo_mtp.py): input_proj over
  [hidden_layernorm(feature), token_layernorm(embedding)], feature first;
  final_layernorm's output fed back.

vLLM zeroes the embedding at position 0 for NextN and MiMo ("not needed by MTP"); so does
this. Only the first MTP layer is read (every such checkpoint ships one). The decoder
layer's keys go through the target class's own sanitize, renamed as its layer 0, so that
experts are stacked, norms shifted and attention weights split exactly as the target's
are. `specmlx quantize` keeps them in MLX's layout under these names, in MTP_FILE beside
the model's shards: there a converted model's own load never reads them, and a
sanitize that drops the upstream keys only from an upstream checkpoint is not asked to.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from ..errors import SpecmlxError
from ..loading import Model
from ..mlxlm import MODEL_REMAPPING, stored_quantization
from ..safetensors import read_header
from .feature import FeatureHead
from .head import Head, head_vocab, ready, target_rows

MTP_FILE = "mtp.safetensors"  # where `specmlx quantize` keeps them
LAYER_0 = "model.layers.0."  # what the layer's keys are renamed to for the target's sanitize
NORM_PROBE = LAYER_0 + "input_layernorm.weight"  # every layout's layer has it
FIX = (
    "load the original checkpoint, or convert it with `specmlx quantize`, which keeps the "
    "MTP layers (mlx-lm's convert drops them); or draft with a model or a head"
)
PARTIAL_FIX = "re-download the checkpoint, or draft with a model or a head"


@dataclass(frozen=True)
class Layout:
    """Where an architecture keeps its first MTP layer and how that layer computes."""

    prefix: str  # of the layer's keys; {n}: num_hidden_layers
    own: dict[str, str]  # the head's fc and norms -> their names under prefix
    layer: str = ""  # under prefix: the decoder layer's keys (beside `own` where "")
    copies: tuple[str, ...] = ()  # under prefix: copies of the target's embedding and head
    index: Callable[[Any], int] | None = None  # the decoder layer's index, from the args
    offset_norms: bool = False  # upstream norms stored as weight - 1
    feature_first: bool = False  # fc reads [feature, embedding]
    feeds_normed: bool = True  # the normed output is fed back, else the layer's own
    zero_first: bool = False  # position 0's embedding zeroed
    array_mask: bool = False  # its attention takes a mask array, not "causal" (MLA's)
    every: str = ""  # regex of every MTP key (all layers, copies included)


NEXTN = Layout(
    prefix="model.layers.{n}.",
    own={"fc": "eh_proj", "enorm": "enorm", "hnorm": "hnorm", "norm": "shared_head.norm"},
    copies=("embed_tokens.", "shared_head.head."),
    index=lambda args: args.num_hidden_layers,
    feeds_normed=False,
    zero_first=True,
    every=r"model\.layers\.(\d+)\.",  # the ones at N and above
)
LAYOUTS = {
    "qwen3_next": Layout(
        prefix="mtp.",
        own={
            "fc": "fc",
            "enorm": "pre_fc_norm_embedding",
            "hnorm": "pre_fc_norm_hidden",
            "norm": "norm",
        },
        layer="layers.0.",
        index=lambda args: args.full_attention_interval - 1,  # a full-attention layer
        offset_norms=True,
        every=r"mtp\.",
    ),
    "deepseek_v3": replace(NEXTN, array_mask=True),
    "glm4_moe": NEXTN,
    "mimo": Layout(
        prefix="model.mtp_layers.0.",
        own={
            "fc": "input_proj",
            "enorm": "token_layernorm",
            "hnorm": "hidden_layernorm",
            "norm": "final_layernorm",
        },
        feature_first=True,
        zero_first=True,
        every=r"model\.mtp_layers\.",
    ),
}


class MTPHead(FeatureHead):
    """A FeatureHead computing as `layout` says (the module docstring)."""

    def __init__(self, layer: nn.Module, dim: int, eps: float, layout: Layout):
        super().__init__(layer, dim, eps)
        self.layout = layout  # not an array, list or dict: an attribute, not a parameter

    def __call__(self, embedded: mx.array, features: mx.array, cache: KVCache) -> tuple:
        layout = self.layout
        if layout.zero_first and cache.offset == 0:
            embedded = mx.concatenate([mx.zeros_like(embedded[:, :1]), embedded[:, 1:]], axis=1)
        parts = [self.enorm(embedded), self.hnorm(features)]
        x = self.fc(mx.concatenate(parts[::-1] if layout.feature_first else parts, axis=-1))
        mask = create_attention_mask(x, cache, return_array=layout.array_mask)
        h = self.layer(x, mask, cache)
        out = self.norm(h)
        return (out if layout.feeds_normed else h), out


@dataclass
class Found:
    """The MTP keys of a checkpoint: its first layer's, copies left out."""

    layout: Layout | None
    prefix: str = ""
    keys: list[str] = field(default_factory=list)

    def missing(self) -> list[str]:
        """What a complete layer has and this one lacks (names, not shapes)."""
        if self.layout is None:
            return []
        need = [f"{self.prefix}{name}.weight" for name in self.layout.own.values()]
        layer = self.prefix + self.layout.layer
        need += [
            f"{layer}{norm}.weight" for norm in ("input_layernorm", "post_attention_layernorm")
        ]
        return [key for key in need if key not in self.keys]


def model_type(config: dict) -> str:
    kind = config.get("model_type")
    return MODEL_REMAPPING.get(kind, kind) if isinstance(kind, str) else ""


def layout_of(config: dict) -> Layout | None:
    return LAYOUTS.get(model_type(config))


def layer_prefix(layout: Layout, config: dict) -> str:
    return layout.prefix.format(n=config.get("num_hidden_layers"))


def is_mtp_key(layout: Layout, config: dict, name: str) -> bool:
    """Whether `name` is any MTP layer's (what the target's own load leaves out)."""
    match = re.match(layout.every, name)
    if match is None:
        return False
    return not match.groups() or int(match.group(1)) >= config.get("num_hidden_layers", 0)


def stored_keys(path: Path) -> dict[str, Path]:
    """Every tensor name in the model's safetensors files (headers only) and MTP_FILE."""
    files = sorted(path.glob("model*.safetensors")) + [path / MTP_FILE]
    return {name: file for file in files if file.is_file() for name in read_header(file).tensors}


def find(config: dict, names: Iterable[str]) -> Found:
    """The first MTP layer's keys among `names`."""
    layout = layout_of(config)
    if layout is None:
        return Found(None)
    prefix = layer_prefix(layout, config)
    skip = tuple(prefix + copy for copy in layout.copies)
    keys = [k for k in names if k.startswith(prefix) and not k.startswith(skip)]
    return Found(layout, prefix, keys)


def has_mtp(path: Path) -> bool:
    """Whether the model in `path` ships a complete MTP layer specmlx reads: from
    config.json and the safetensors headers, no tensor read."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
        found = find(config, stored_keys(Path(path)))
    except (OSError, ValueError, SpecmlxError):
        return False
    return bool(found.keys) and not found.missing()


def text_model(model: nn.Module) -> nn.Module:
    return model.language_model if "language_model" in model else model


def skeleton(model: nn.Module, config: dict) -> MTPHead:
    """A random MTP head for `model` (an mlx-lm model), its layer of the model's own
    decoder-layer class, built as the layout says."""
    layout = layout_of(config)
    inner = text_model(model)
    args = inner.args
    # a pipeline split (specmlx.distributed) leaves other ranks' layers as None
    layer_class = type(next(layer for layer in inner.model.layers if layer is not None))
    layer = layer_class(args) if layout.index is None else layer_class(args, layout.index(args))
    return MTPHead(layer, args.hidden_size, getattr(args, "rms_norm_eps", 1e-6), layout)


def head_weights(model: nn.Module, config: dict, weights: dict[str, mx.array]) -> dict:
    """The first MTP layer's `weights` (stored names, upstream or MLX layout) under the
    head's parameter names, in MLX's layout: all of them go through the target's own
    sanitize as keys of its layer 0 (the head's fc and norms under their attribute names,
    which no decoder layer has), so that experts are stacked, attention weights split and
    FP8 weights dequantized exactly as the target's are."""
    layout = layout_of(config)
    prefix = layer_prefix(layout, config)
    own = {f"{prefix}{name}.": f"{attr}." for attr, name in layout.own.items()}
    layer = prefix + layout.layer
    renamed = {}
    for key, value in weights.items():
        head = next((attr + key[len(up) :] for up, attr in own.items() if key.startswith(up)), None)
        if head is None and key.startswith(layer):
            head = key[len(layer) :]
        if head is not None:
            renamed[LAYER_0 + head] = value
    sanitized = model.sanitize(dict(renamed)) if hasattr(model, "sanitize") else renamed
    out = {}
    for key, value in sanitized.items():
        name = key[len(LAYER_0) :]
        out[name if name.split(".")[0] in layout.own else "layer." + name] = value
    # The target's sanitize shifts a layer's norms only where it reads upstream weights
    # (Qwen3-Next's: unstacked experts), and never the head's own: shifted as the layer's.
    if layout.offset_norms and sanitized.get(NORM_PROBE) is not renamed.get(NORM_PROBE):
        for name in ("enorm.weight", "hnorm.weight", "norm.weight"):
            if name in out:
                out[name] = out[name] + 1.0
    return out


def stored_name(config: dict, name: str) -> str:
    """Where a head parameter lies in a checkpoint (`head_weights`' inverse for names)."""
    layout = layout_of(config)
    prefix = layer_prefix(layout, config)
    attr, _, rest = name.partition(".")
    if attr == "layer":
        return prefix + layout.layer + rest
    return f"{prefix}{layout.own[attr]}.{rest}"


def quantize_as_stored(module: nn.Module, weights: dict[str, mx.array]) -> None:
    """Quantize the layers that come with .scales, their bits and group size read off the
    stored shapes (as specmlx.mlxlm.build_model does for a model)."""
    nn.quantize(module, class_predicate=lambda path, m: stored_quantization(path, m, weights))


def build(model: nn.Module, config: dict, weights: dict[str, mx.array], where: str) -> MTPHead:
    """The MTP head holding `weights` (stored names); refused in one line where they do
    not make a whole layer of the model's shape."""
    module = skeleton(model, config)
    weights = head_weights(model, config, weights)
    quantize_as_stored(module, weights)
    expected = {name for name, _ in tree_flatten(module.parameters())}
    missing = sorted(expected - set(weights))
    if missing:
        names = ", ".join(stored_name(config, name) for name in missing[:3])
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise SpecmlxError(
            f"{where}'s MTP layer is incomplete: {names}{more} missing; {PARTIAL_FIX}"
        )
    try:
        module.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        why = " ".join(str(e).split())
        raise SpecmlxError(
            f"{where}'s MTP layer does not fit its config.json ({why}); {FIX}"
        ) from None
    return module


def load_mtp(target: Model) -> Head:
    """The MTP head `target`'s own checkpoint ships, in the target's form (head.ready),
    drafting into the target's own output head; refused in one line where it has none,
    or an incomplete one."""
    start = time.perf_counter()
    config = target.config
    if layout_of(config) is None:
        readable = ", ".join(sorted(LAYOUTS))
        raise SpecmlxError(
            f"{target.name} is a {config.get('model_type')} model: specmlx reads the MTP "
            f"layers of {readable} checkpoints; draft with a model or a head instead"
        )
    stored = stored_keys(target.path)
    found = find(config, stored)
    if not found.keys:
        raise SpecmlxError(f"{target.name}'s checkpoint has no MTP layers; {FIX}")
    missing = found.missing()
    if missing:
        raise SpecmlxError(
            f"{target.name}'s MTP layer is incomplete: {', '.join(missing)} missing; {PARTIAL_FIX}"
        )
    weights = read({name: stored[name] for name in found.keys})
    module = build(target.module, config, weights, target.name)
    ready(module, target)
    head = Head(module, *target_rows(target, head_vocab(target)), target, "MTP", target.path)
    head.info["weights_s"] = time.perf_counter() - start
    return head


def read(keys: dict[str, Path]) -> dict[str, mx.array]:
    """The tensors `keys` names, each from its file (lazily)."""
    weights = {}
    for file in sorted(set(keys.values())):
        loaded = mx.load(str(file))
        weights.update({name: loaded[name] for name in keys if keys[name] == file})
    return weights


def mtp_keys(config: dict, names: Iterable[str]) -> list[str]:
    """Every MTP key among `names` (all layers, copies included): what the target's own
    load leaves out and what `specmlx quantize` sets aside."""
    layout = layout_of(config)
    if layout is None:
        return []
    return [name for name in names if is_mtp_key(layout, config, name)]
