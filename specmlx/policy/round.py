"""What a policy plans for a round, and the summary of the round it is shown afterwards."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ..drafters.protocol import Drafter, GoOn
from ..tree import Shape


@dataclass
class Plan:
    drafter: Drafter | None  # None: a plain round
    gamma: int  # drafts to ask for (the engine never drafts past max_tokens)
    go_on: GoOn | None = None  # shown the draft's top probabilities; False ends the proposal
    predicted_tps: float = 0.0  # the cost model's forecast for this choice (auto only)
    # What an auto choice for a costly drafter rested on: its measured cost per target
    # pass (None until measured), and this text's forecast α (None until seen).
    draft_ratio: float | None = None
    alpha: float | None = None
    # A tree within this shape rather than a chain (`gamma`: its nodes), where the drafter
    # grows trees (drafters.grows_trees).
    tree: Shape | None = None


@dataclass
class RoundSummary:
    """A finished round in numbers: what the policy and the statistics learn from."""

    plan: Plan
    source: str  # "plain", or the name of the drafter that proposed
    asked: int  # drafts asked for, after the engine's cap
    drafted: int  # drafts made (fewer than asked where go_on ended the proposal)
    accepted: int
    draft_s: float  # drafting, less any of the prompt the draft took
    verify_s: float  # the target's pass and the accept/reject
    # Rewinding caches that cannot be trimmed (a pass over the kept tokens again, in the
    # target or a drafter), or 0 where nothing was run again.
    rewind_s: float = 0.0
    prompt_s: float = 0.0  # the drafter taking the call's prompt: prefill, not decode
    fed: int = 0  # tokens the draft model caught up on with its first pass (Proposal.fed)
    first: bool = False  # a Session's first proposal from this drafter (one-time work)
    timed_draft_s: float | None = None  # a draft pass a cost probe re-timed
    tree_as_chain: bool = False  # a tree verified by its first path (Verdict)
    # A tree verified whole: its parents (specmlx.tree) and the accepted nodes (Verdict);
    # None for a chain.
    parents: list[int] | None = None
    path: list[int] = field(default_factory=list)
    # The target's top probability at the round's first k judged positions, read when
    # asked (Verdict.tops): the policy's forecast of acceptance.
    target_tops: Callable[[int], list[float]] = field(default=lambda k: [])
    draft_tops: list[float] = field(default_factory=list)  # the draft's, where it read them


class Policy(Protocol):
    drafters: list[Drafter]  # the call's drafters, in the order the policy asks them

    def plan(self, remaining: int, context: int = 0) -> Plan:
        """The next round; `remaining`: the most tokens the call may still emit; `context`:
        the tokens the target's cache will hold when it starts."""

    def observe(self, round: RoundSummary) -> None:
        """A finished round."""

    def while_running(self) -> None:
        """The engine has set the next pass running (or has none to run): what the policy
        learns from a round that the next plan can do without happens here, off the path
        from one pass to the next."""

    def finish(self) -> None:
        """The call is over (keep what was learnt)."""

    @property
    def helpers(self) -> list[Drafter]:
        """Drafters the policy itself plans rounds for (cost probes): the engine keeps them
        in step with the text like the call's own."""
