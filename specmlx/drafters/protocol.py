"""The drafter protocol, what a proposal carries, and what a drafter is told afterwards.

A drafter needs three methods: `start` (a new call's context), `propose` (drafts, as a
chain or a tree, with the distributions they were drawn from) and `commit` (the target's
`Verdict` on the round). Optional members, read through the functions below, let the
auto policy price it: `behind` (tokens it must take before it can draft), `available(g)`
(drafts it can offer now), `time_pass()` (seconds of one draft pass, for a drafter that
runs a model), `cost_id` (what its cost depends on) and `interrupted()` (a call was
stopped mid-pass). A drafter with `trees` true is asked for a tree by a keyword
`tree` to propose (a tree.Shape: the most nodes at each depth and children of a node;
drafters.treedraft.grow grows one from any step function); others are never passed it.
A user's own class with the three methods runs through `specmlx.generate(...,
drafter=obj)`.
"""

from __future__ import annotations

from typing import Any, Protocol

import mlx.core as mx

from ..proposal import Draw, GoOn, Proposal, Verdict, point_mass

__all__ = ["Draw", "Drafter", "GoOn", "Proposal", "Verdict", "point_mass"]


class Drafter(Protocol):
    name: str  # how Stats counts the rounds it drafted, and which γ policy prices it

    def start(self, context: list[int]) -> None:
        """A new call: the text so far (the prompt) is `context`. A drafter with
        `reads_hidden` is called start(context, features): the target's features
        (target.Features) at every position of context but the last."""

    def propose(self, g: int, keys: mx.array, draw: Draw, go_on: GoOn | None = None) -> Proposal:
        """At most g drafts that may follow the text so far (fewer where go_on says stop);
        keys (g, 2): the random key for each draft position, in order, to draw with."""

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
