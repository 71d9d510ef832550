"""A draft head over the N most frequent tokens only (FR-Spec, Zhao et al. 2025).

On a CPU a draft pass is memory-bound, and a small model's output head is a large share of
the bytes it reads (Qwen2.5-Coder-0.5B: 151,936 x 896 at 8 bits, over a quarter of its
weights). The draft computes logits over the sub-vocabulary's rows of its head only,
draws from them, and its q is zero outside: modified rejection sampling stays exact for
any q (verify.accept_reject compares p and q over the full vocabulary), and greedy output
still equals the target's; only acceptance can drop, where the target's token lies outside.

Which tokens: those of a counted table for the draft's tokenizer first (TABLE, keyed by
the SHA-256 of its tokenizer.json: counts of a target's greedy tokens on tune prompts,
written by draft_head.py, whose last commit bench/results/ARCHIVE.md names), then the
rest in token id order (byte-level BPE ids follow merge order, roughly frequency, but
chat answers' code fence ``` is id 73,594 of Qwen2's), and every special token (EOS
among them) always in, so the draft can propose the end. bench/results/draft_head.md has
coverage, acceptance and pass time per N.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import weakref
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import SpecmlxError
from ..lm_head import cuttable, head_layer
from ..loading import Model

# The default size (None: the full head), by measurement: bench/results/draft_head.md.
DEFAULT_SIZE: int | None = 65536
ENV = "SPECMLX_DRAFT_VOCAB"
# {tokenizer.json's SHA-256: {"source": how it was counted, "ids": most frequent first}}
TABLE = Path(__file__).with_name("frequent_tokens.json")


@dataclass
class SubHead:
    """The rows of a model's output head for `ids` (ascending token ids), and what maps a
    draw over them back to the full vocabulary of `width` tokens that verify compares over."""

    ids: mx.array  # (N,) uint32
    width: int
    rows: nn.Module  # the head layer's own class, holding only the rows of `ids`
    tied: bool  # the head is the embedding's as_linear

    def logits(self, module: nn.Module, x: mx.array, cache: list, every: bool = False) -> mx.array:
        """(1, N) logits of the last position after a pass over tokens x (lazy); the head
        runs on that position only. `every`: (len(x), N), at every position (a tree's
        nodes)."""
        hidden = module.model(x[None], cache=cache)[0]
        hidden = hidden if every else hidden[-1:]
        return self.rows.as_linear(hidden) if self.tied else self.rows(hidden)

    def token(self, index: mx.array) -> mx.array:
        """The full token id of a draw's index into the sub-vocabulary."""
        return self.ids[index]

    def widen_logits(self, logits: mx.array) -> mx.array:
        """Logits over the full vocabulary: the head's, -inf outside its ids."""
        full = mx.full((logits.shape[0], self.width), -mx.inf, logits.dtype)
        index = mx.broadcast_to(self.ids, logits.shape)
        return mx.put_along_axis(full, index, logits, axis=-1)

    def widen(self, probs: mx.array) -> mx.array:
        """q over the full vocabulary: the draw's distribution, zero outside the ids."""
        q = mx.zeros((probs.shape[0], self.width), probs.dtype)
        return mx.put_along_axis(q, mx.broadcast_to(self.ids, probs.shape), probs, axis=-1)


def token_order(model: Model) -> mx.array:
    """Every token id the model can produce, most frequent first: its tokenizer's counted
    ids (TABLE), then the rest in id order."""
    file = model.path / "tokenizer.json"
    counted = counted_ids(str(file), file.stat().st_mtime) if file.is_file() else ()
    counted = np.array([t for t in counted if t < model.vocab_size], np.int64)
    rest = np.ones(model.vocab_size, bool)
    rest[counted] = False
    return mx.array(np.concatenate([counted, np.flatnonzero(rest)]), mx.uint32)


def tokenizer_key(file: Path) -> str:
    """What TABLE is keyed by: the tokenizer file's SHA-256."""
    return hashlib.sha256(file.read_bytes()).hexdigest()


@lru_cache(maxsize=8)  # a drafter is made at every Session reset; hashing 11 MB is not free
def counted_ids(tokenizer_file: str, mtime: float) -> tuple[int, ...]:
    """TABLE's ids for this tokenizer, most frequent first; none when it has no entry."""
    table = json.loads(TABLE.read_text()) if TABLE.is_file() else {}
    entry = table.get(tokenizer_key(Path(tokenizer_file)))
    return tuple(entry["ids"]) if entry else ()


def always_in(model: Model) -> list[int]:
    """Token ids every sub-vocabulary keeps: the EOS ids and the tokenizer's special
    (added) tokens, which sit at the end of BPE id order but end or shape a turn."""
    tokenizer = model.tokenizer
    special = set(tokenizer.eos_token_ids)
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special.update(int(i) for i in added)
    return sorted(t for t in special if 0 <= t < model.vocab_size)


def sub_vocab(model: Model, size: int, order: mx.array | None = None) -> mx.array:
    """The `size` token ids of the sub-vocabulary, ascending: every one of always_in, then
    the first of `order` (default: token_order)."""
    kept = np.array(always_in(model), np.int64)
    ranked = np.asarray(token_order(model) if order is None else order).astype(np.int64)
    special = np.zeros(model.vocab_size, bool)
    special[kept] = True
    fill = ranked[~special[ranked]][: max(0, size - kept.size)]
    return mx.array(np.sort(np.concatenate([kept, fill])), mx.uint32)


def sub_head(model: Model, ids: mx.array, width: int) -> SubHead:
    """The head's rows for `ids`, lazily (read on the first draft pass). MLX's quantized
    layers pack and scale each row on its own, so their rows slice exactly; the copy keeps
    the layer's class, so it runs the same kernel (native or MLX's) as the full head."""
    layer, tied = head_layer(model)
    rows = copy.copy(layer)
    for name in ("weight", "scales", "biases", "bias"):
        if name in layer:
            rows[name] = layer[name][ids]
    return SubHead(ids, width, rows, tied)


def draft_size(model: Model) -> int | None:
    """The sub-vocabulary size for this draft model, None for the full head: $SPECMLX_DRAFT_VOCAB
    (a number of tokens, or "full"), else DEFAULT_SIZE, where the head can be cut."""
    return sized(model, DEFAULT_SIZE)


def sized(model: Model, default: int | None) -> int | None:
    """As draft_size, with `default` where $SPECMLX_DRAFT_VOCAB is unset (a head's own)."""
    text = os.environ.get(ENV, "").strip().lower()
    if text == "full" or (not text and default is None):
        return None
    size = default if not text else int(text) if text.isdigit() else 0
    if size < 1:
        raise SpecmlxError(
            f"{ENV}={os.environ[ENV]!r} is not a number of tokens; "
            "set it to a positive integer (e.g. 32768) or 'full'"
        )
    if size >= model.vocab_size or not cuttable(model):
        return None
    return size


# Cut heads by (id of the draft Model, size, width, its EOS ids: the sub-vocabulary keeps
# them), each with a weak reference to its Model. Every Session of a draft model (a chat's
# /reset, each bench call, the server's pool) shares one cut head instead of building the
# sub-vocabulary and copying the head's rows again.
_heads: dict[tuple, tuple[weakref.ref, SubHead]] = {}


def shared_sub_head(model: Model, size: int, width: int) -> SubHead:
    """sub_head over sub_vocab(model, size), made once per draft model while it lives."""
    key = (id(model), size, width, tuple(sorted(model.tokenizer.eos_token_ids)))
    hit = _heads.get(key)
    if hit is not None and hit[0]() is model:
        return hit[1]

    def forget(ref: weakref.ref) -> None:  # the model is gone (its id may be reused)
        if _heads.get(key, (None,))[0] is ref:
            del _heads[key]

    head = sub_head(model, sub_vocab(model, size), width)
    _heads[key] = (weakref.ref(model, forget), head)
    return head
