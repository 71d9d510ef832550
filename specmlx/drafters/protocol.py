"""The drafter protocol and what a proposal carries."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

# draw(logits, key) -> (probs, token): the call's compiled sampler (probs None when greedy)
Draw = Callable[[mx.array, mx.array], tuple[mx.array | None, mx.array]]
# go_on(logits, probs) -> bool, shown each draft as it is made: False ends the proposal
GoOn = Callable[[mx.array, mx.array | None], bool]


@dataclass
class Proposal:
    """What a drafter proposed for one round. `tokens` (g,) and `q` (g, V), or q None at
    temperature 0, may still be lazy. The other fields tell the γ policy how clean a
    figure of the draft's cost the round's draft time is."""

    tokens: mx.array
    q: mx.array | None
    # Tokens the draft model took with its first pass besides the one it drafted from
    # (what it missed while it sat out); 0 for drafters without a model.
    fed: int = 0
    # A Session's first proposal from a model: it pays one-time work (first use of the
    # weights, kernels built) and is no figure of a pass.
    first: bool = False
    # Seconds spent taking the call's prompt before drafting: prefill, not decode.
    prompt_s: float = 0.0


class Drafter(Protocol):
    name: str  # "model", "lookup", "probe": how Stats counts the rounds it drafted

    def start(self, context: list[int]) -> None:
        """A new call: the text so far (the prompt) is `context`."""

    def propose(self, g: int, key: mx.array, draw: Draw, go_on: GoOn | None = None) -> Proposal:
        """At most g tokens that may follow the text so far (fewer where go_on says stop)."""

    def commit(self, proposal: Proposal | None, accepted: int, emitted: list[int]) -> int:
        """The round is over: the target accepted `accepted` drafts of `proposal` (None:
        this drafter sat the round out) and the text grew by `emitted`. Returns how many
        tokens it had to run again to undo the rejected ones (see caches.rewind)."""


def point_mass(drafts: mx.array, vocab_size: int) -> mx.array:
    """The one-hot q of drafts that are guesses rather than samples (lookup, probes)."""
    return (mx.arange(vocab_size)[None] == drafts[:, None]).astype(mx.float32)
