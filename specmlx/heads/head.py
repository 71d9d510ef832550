"""A loaded head: the module that drafts from the target's features, and the output rows
it reads its logits from."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..drafters.subvocab import sized, sub_head, sub_vocab
from ..lm_head import head_layer
from ..loading import Model, backend, cast_floating


@dataclass
class Head:
    """`module(embedded (1, L, D), features (1, L, F), cache) -> (features it drafts
    further from (1, L, D), what its output rows read (1, L, D))`; F is the target's
    feature width (Target.set_hidden with `taps`), D its hidden size.

    `rows` holds the output head's rows for token ids `ids` (ascending): the target's own
    head cut to a sub-vocabulary (shared with it, not copied: MLX slices views of
    quantized rows lazily into a new array once), or the head's own draft vocabulary
    (EAGLE-3's lm_head and d2t)."""

    module: nn.Module
    rows: nn.Module
    tied: bool  # rows are an embedding, read as a linear layer
    ids: mx.array | None  # (N,) uint32; None: the target's whole vocabulary, in order
    target: Model
    kind: str  # what it was read from: "specmlx", "EAGLE-3", "MTP"
    path: Path | None = None
    taps: tuple[int, ...] | None = None  # target layers whose outputs are its features
    info: dict = field(default_factory=dict)  # as a Model's: "weights_s", its load time

    is_head = True  # what `--draft` loaded is a head, not a draft model (heads.is_head)

    @property
    def weights(self) -> str:
        """Its linear layers' form: "int4" where the target keeps INT4, else its dtype's."""
        quantized = any(isinstance(m, nn.QuantizedLinear) for _, m in self.module.named_modules())
        return "int4" if quantized else self.target.weights

    def describe(self) -> str:
        taps = f", target layers {list(self.taps)}" if self.taps else ""
        return f"{self.name} ({self.kind} head for {self.target.name}, {self.weights}{taps})"

    def logits(self, out: mx.array) -> mx.array:
        return self.rows.as_linear(out) if self.tied else self.rows(out)

    def embed(self, tokens: mx.array) -> mx.array:
        """The target's own embedding of tokens (shared, never copied)."""
        module = self.target.module
        inner = module.language_model if "language_model" in module else module
        return inner.model.embed_tokens(tokens)

    @property
    def name(self) -> str:
        return self.path.name if self.path is not None else self.kind


# A head's sub-vocabulary, by measurement (bench/results/heads-zen4.md): its output rows
# are a larger share of its pass than of a draft model's, so it keeps fewer: a pass over
# 32,768 rows costs 0.07 of a target step on the offline 1.5B where 65,536 cost 0.09, and
# they hold 95.4% of the target's greedy tokens on the tune answers (65,536: 98.3%).
HEAD_VOCAB = 32768


def head_vocab(target: Model) -> int | None:
    """The sub-vocabulary size a new head gets: $SPECMLX_DRAFT_VOCAB, else HEAD_VOCAB."""
    return sized(target, HEAD_VOCAB)


def target_rows(target: Model, size: int | None) -> tuple[nn.Module, bool, mx.array | None]:
    """(rows, tied, ids) of the target's own output head, cut to `size` tokens (the most
    frequent: drafters.subvocab), or whole (size None: ids None)."""
    if size is None:
        layer, tied = head_layer(target)
        return layer, tied, None
    cut = sub_head(target, sub_vocab(target, size), target.vocab_size)
    return cut.rows, cut.tied, cut.ids


def quantize_linears(module: nn.Module, group_size: int, bits: int) -> None:
    """A head's linear layers quantized in MLX's format, where their inputs divide into
    groups (the norms and the target's shared rows are not the head's to quantize)."""
    nn.quantize(
        module,
        group_size=group_size,
        bits=bits,
        class_predicate=lambda _, m: (
            isinstance(m, nn.Linear) and m.weight.shape[-1] % group_size == 0
        ),
    )


def ready(module: nn.Module, target: Model) -> None:
    """Put a head in the target's form: its linear layers in INT4 where the target keeps
    INT4, else cast to the target's dtype; on the CPU, prepared as the target was."""
    quantization = target.quantization
    if quantization and target.weights != "fp32":
        quantize_linears(module, quantization["group_size"], quantization["bits"])
    cast_floating(module, target.dtype)
    module.eval()
    if backend() == "cpu":
        from .. import cpu

        # A draft pass need not give the bits a one-token pass gives: verify judges it.
        cpu.prepare(module, "auto", "cpu", passes_exact=lambda _: True)
    mx.eval(module.parameters())
