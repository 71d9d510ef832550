"""Where draft tokens come from.

A drafter is told the context a call starts from, proposes g tokens with the
distributions q they were drawn from, and is told after every round what the target
emitted (and, when the proposal was its own, how many of its drafts passed), so it can
keep its own state in step. The accept/reject rule (verify.accept_reject) is the same for
every drafter; a new one implements `Drafter` and the engine needs no change.
`model_drafter` builds the draft model's, its head cut to a sub-vocabulary (subvocab).
"""

from .lookup import LookupDrafter
from .model import ModelDrafter
from .probe import CostProbe
from .protocol import Drafter, Draw, GoOn, Proposal, point_mass
from .subvocab import model_drafter

__all__ = [
    "CostProbe",
    "Draw",
    "Drafter",
    "GoOn",
    "LookupDrafter",
    "ModelDrafter",
    "model_drafter",
    "Proposal",
    "point_mass",
]
