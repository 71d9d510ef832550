"""What a policy plans for a round, and what it is shown of the round afterwards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from ..drafters import Drafter, GoOn, Proposal


@dataclass
class Plan:
    drafter: Drafter | None  # None: a plain round
    gamma: int  # drafts to ask for (the engine never drafts past max_tokens)
    go_on: GoOn | None = None  # shown each draft as it is made; False ends the proposal
    predicted_tps: float = 0.0  # the cost model's forecast for this choice (auto only)
    # What an auto choice for the draft model rested on: the draft's measured cost per
    # target pass (None until measured), and this text's forecast α (None until seen).
    draft_ratio: float | None = None
    alpha: float | None = None


@dataclass
class Round:
    plan: Plan
    source: str  # "plain", or the name of the drafter that proposed
    asked: int  # drafts asked for, after the engine's cap
    drafted: int  # drafts made (fewer than asked where go_on ended the proposal)
    accepted: int
    draft_s: float  # drafting, less any of the prompt the draft took
    verify_s: float  # the target's pass and the accept/reject
    # Rewinding caches that cannot be trimmed (a pass over the kept tokens again, in the
    # target or the draft), or 0 where nothing was run again.
    rewind_s: float
    proposal: Proposal | None
    logits: mx.array  # the target's logits over the round's positions
    probs: mx.array | None  # the distribution the target was judged or sampled with


class Policy(Protocol):
    def plan(self, remaining: int) -> Plan:
        """The next round; `remaining`: the most tokens the call may still emit."""

    def observe(self, round: Round) -> None:
        """A finished round."""

    def while_running(self) -> None:
        """The engine has set the next pass running (or has none to run): what the policy
        learns from a round that the next plan can do without happens here, off the path
        from one pass to the next."""

    def finish(self) -> None:
        """The call is over (keep what was learnt)."""
