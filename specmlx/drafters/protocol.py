"""The drafter protocol, what a proposal carries, and what a drafter is told afterwards.

A drafter needs three methods: `start` (a new call's context), `propose` (drafts, as a
chain or a tree, with the distributions they were drawn from) and `commit` (the target's
`Verdict` on the round). Optional members, read through the functions below, let the
auto policy price it: `behind` (tokens it must take before it can draft), `available(g)`
(drafts it can offer now), `time_pass()` (seconds of one draft pass, for a drafter that
runs a model), `cost_id` (what its cost depends on) and `interrupted()` (a call was
stopped mid-pass). A user's own class with the three methods runs through
`specmlx.generate(..., drafter=obj)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx

from .. import tree

# draw(logits, key) -> (probs, token): the call's compiled sampler (probs None when greedy)
Draw = Callable[[mx.array, mx.array], tuple[mx.array | None, mx.array]]
# go_on(tops) -> bool: shown the drafter's own top probability at each draft made so far
# in this round (it reads its own confidence); False ends the proposal there.
GoOn = Callable[[list[float]], bool]


@dataclass
class Proposal:
    """What a drafter proposed for one round.

    `tokens` (g,) and `q` (g, V) may still be lazy. q None means: greedy (not needed), or,
    at temperature > 0, drafts that are guesses rather than samples (the target judges
    them as point masses). `parents` None is a chain; else node j hangs under node
    parents[j] (-1: the last emitted token), parents before children (specmlx.tree).
    The other fields tell the γ policy how clean a figure of the draft's cost this is.
    """

    tokens: mx.array
    q: mx.array | None = None
    parents: list[int] | None = None
    # Tokens the draft model took with its first pass besides the one it drafted from
    # (what it missed while it sat out); 0 for drafters without a model.
    fed: int = 0
    # A Session's first proposal from a model: it pays one-time work (first use of the
    # weights, kernels built) and is no figure of a pass.
    first: bool = False
    # Seconds spent taking the call's prompt before drafting: prefill, not decode.
    prompt_s: float = 0.0
    # Seconds of a draft pass that a cost probe re-timed for the policy, or None.
    timed_draft_s: float | None = None
    # The drafter's own top probability at each draft, where it read them (go_on).
    tops: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.parents is not None:
            tree.check(self.parents)
            if len(self.parents) != self.tokens.shape[0]:
                raise ValueError("a tree proposal needs one parent per token")
            if tree.is_chain(self.parents):
                self.parents = None

    @property
    def is_chain(self) -> bool:
        return self.parents is None

    def along(self, path: list[int]) -> Proposal:
        """The chain of the nodes on `path`, with their q."""
        index = mx.array(path, mx.uint32)
        q = None if self.q is None else self.q[index]
        tops = [self.tops[j] for j in path if j < len(self.tops)]
        return Proposal(self.tokens[index], q, None, self.fed, self.first, self.prompt_s, tops=tops)


@dataclass
class Verdict:
    """The target's judgement of a round, shown to every drafter.

    `accepted` drafts of the proposal passed (the nodes on `path`, root's child first),
    then the target chose `token`; `emitted` is the text's growth. `hidden`: the target's
    last hidden states at [root, *accepted drafts] (one row each), where a drafter that
    reads them asked for them (None otherwise). `tops(k)` reads the target's top
    probability at the round's first k judged positions (the policy's forecast of
    acceptance; read only when asked, off the path from one pass to the next)."""

    accepted: int
    token: int
    path: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)  # the accepted drafts' tokens
    hidden: mx.array | None = None
    verify_s: float = 0.0
    rewind_s: float = 0.0  # rolling back a cache that cannot be trimmed, by running again
    rerun: int = 0  # tokens run again for that
    tree_as_chain: bool = False  # a tree this target could not verify whole: its first path
    tops: Callable[[int], list[float]] = lambda k: []

    @property
    def emitted(self) -> list[int]:
        return [*self.drafts, self.token]


class Drafter(Protocol):
    name: str  # how Stats counts the rounds it drafted, and which γ policy prices it

    def start(self, context: list[int]) -> None:
        """A new call: the text so far (the prompt) is `context`."""

    def propose(self, g: int, key: mx.array, draw: Draw, go_on: GoOn | None = None) -> Proposal:
        """At most g drafts that may follow the text so far (fewer where go_on says stop)."""

    def commit(self, proposal: Proposal | None, verdict: Verdict) -> int:
        """The round is over: `proposal` was this drafter's (None: it sat the round out)
        and the target's `verdict` on it. Returns how many tokens it had to run again to
        undo rejected drafts (see caches.rewind)."""


def behind(drafter: Any) -> int:
    """Tokens it must take before it drafts (its model's catch-up), 0 if it has none."""
    return getattr(drafter, "behind", 0)


def available(drafter: Any, g: int) -> int:
    """How many of g drafts it can offer now (prompt lookup: what the context matched)."""
    offer = getattr(drafter, "available", None)
    return g if offer is None else offer(g)


def cost_id(drafter: Any) -> str:
    """What a drafter's cost depends on, for the measured costs' key."""
    return getattr(drafter, "cost_id", drafter.name)


def interrupted(drafter: Any) -> None:
    """A call stopped mid-pass: let a drafter with a cache forget what it cannot trust."""
    hook = getattr(drafter, "interrupted", None)
    if hook is not None:
        hook()


def point_mass(drafts: mx.array, vocab_size: int) -> mx.array:
    """The one-hot q of drafts that are guesses rather than samples (lookup, probes)."""
    return (mx.arange(vocab_size)[None] == drafts[:, None]).astype(mx.float32)
