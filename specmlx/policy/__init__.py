"""The γ policy: how many tokens to draft each round, and from which drafter.

`FixedGamma` is the few lines a fixed γ needs; `AutoGamma` picks γ each round from
measured costs (costs.py) and this text's acceptance (acceptance.py), by the choice in
choice.py. The engine asks `plan` before each round and shows `observe` what happened;
a policy never edits a drafter, and the engine never edits a policy.
"""

from __future__ import annotations

from .auto import AutoGamma
from .costs import Costs, load_costs, save_costs
from .fixed import FixedGamma
from .round import Plan, Policy, Round

__all__ = [
    "AutoGamma",
    "Costs",
    "FixedGamma",
    "Plan",
    "Policy",
    "Round",
    "load_costs",
    "save_costs",
]
