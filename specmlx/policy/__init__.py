"""The γ policy: how many tokens to draft each round, and from which drafter.

`FixedGamma` is the few lines a fixed γ needs; `AutoGamma` picks γ each round from
measured costs (costs.py) and this text's acceptance (acceptance.py), by the choice in
choice.py, one Scheduler per drafter. The engine asks `plan` before each round and shows
`observe` a RoundSummary of what happened (numbers, never logits); a policy never runs a
model pass itself: re-timing a draft is a cost probe's round, a drafter like any other.
"""

from __future__ import annotations

from .auto import AutoGamma
from .costs import Costs, load_costs, save_costs
from .fixed import FixedGamma
from .round import Plan, Policy, RoundSummary

__all__ = [
    "AutoGamma",
    "Costs",
    "FixedGamma",
    "Plan",
    "Policy",
    "RoundSummary",
    "load_costs",
    "save_costs",
]
