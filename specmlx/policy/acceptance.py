"""This text's acceptance α: what drafts showed and what the target's confidence forecasts."""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import mul

DECAY = 0.9  # weight kept by old acceptance observations per round: adapts within ~10 rounds
PRIOR_ALPHA = 0.6  # acceptance assumed before anything is known
PRIOR_WEIGHT = 1.0  # how many drafts' worth of evidence that guess counts as
# Each draft position's own acceptance is shrunk toward the pooled α by this many
# drafts' worth: a position seen a few times leans on the rest, one seen often speaks.
POSITION_PRIOR = 2.0
# How much of a judged draft's evidence one plain step's top target probability counts
# as. It forecasts agreement at its position well (bench/results/confidence_agreement.md),
# and a start must come early: where a pass over many tokens costs several one-token
# passes, a draft that starts late in a short reply has its catch-up to pay back first.
# The policy's replay (bench/results/ARCHIVE.md, 'schedule_sim.py') found lower weights
# start drafting code too late to gain, and this one losing nothing on prose.
CONFIDENCE_WEIGHT = 2.0
# The calibration of confidence to acceptance is kept per band of top probability (upper
# edges; the last band runs to 1): at T = 1 the top under-forecasts acceptance where the
# target is unsure (0.22 -> 0.47, 0.40 -> 0.57) and over-forecasts a little where it is
# sure (0.97 -> 0.90), so one factor for all fits none (bench/results/confidence_agreement.md).
BANDS = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
# In a tree, the chance that a later sibling passes once those before it failed, before
# this text shows any (a drafter's second choice is the target's where its first is
# not about a third of the time); shrunk toward with POSITION_PRIOR drafts' worth.
SIBLING_PRIOR = 0.3


@dataclass
class Acceptance:
    """α from decayed evidence: drafts the target accepted out of those it judged, and
    plain steps' top target probabilities, each counting as CONFIDENCE_WEIGHT of a judged
    draft, calibrated per band of BANDS when α is read (what drafts teach the calibration
    reweighs the plain steps already seen). It starts from a weak guess (PRIOR_ALPHA),
    evidence that ages like the rest: it keeps a step or two from deciding alone, and
    fades as the text shows itself.

    Drafts are also counted per position in the round: α_i, the chance that draft i
    passes once the drafts before it have. Acceptance is not the same at every position:
    a prompt-lookup draft that passes its first token is usually copying a span and
    passes the rest (α_0 0.6, α_1+ 0.9), so the series 1 + α_0 + α_0·α_1 + … prices long
    proposals where one pooled α would cut them short."""

    accepted: float = PRIOR_ALPHA * PRIOR_WEIGHT
    judged: float = PRIOR_WEIGHT  # drafts the target ruled on (not those after a rejection)
    # Per band of BANDS: plain steps' top probabilities summed, and how many steps.
    sure: list[float] = field(default_factory=lambda: [0.0] * (len(BANDS) + 1))
    steps: list[float] = field(default_factory=lambda: [0.0] * (len(BANDS) + 1))
    seen: bool = False  # evidence of this text, not only the guess
    # Per band: acceptance per unit of top probability, for this pair and sampling.
    calibration: list[float] = field(default_factory=lambda: [1.0] * (len(BANDS) + 1))
    # Per draft position i ≥ 1: [accepted, judged] (judged: every draft before it passed).
    # α_0 reads the pooled evidence, so the first position keeps no counts of its own.
    later: list[list[float]] = field(default_factory=list)
    # In trees, per sibling rank r >= 1: [accepted, judged] (judged: every sibling before
    # it failed).
    siblings: list[list[float]] = field(default_factory=list)

    def observe(self, g: int, n: int) -> None:
        """A round drafted g and the target accepted n (and rejected the next, if n < g)."""
        self._age()
        self.accepted += n
        self.judged += min(n + 1, g)
        self.seen = True
        while len(self.later) < g - 1:
            self.later.append([0.0, 0.0])
        for i in range(1, min(n + 1, g)):
            self.later[i - 1][0] += i < n
            self.later[i - 1][1] += 1

    def observe_tree(self, walk: list[tuple[int, int]]) -> None:
        """A tree round, as tree.walk tells it: at the root and each accepted node, how
        many children it had and the rank of the one accepted (-1: none). A node's first
        child counts as a chain's draft at its depth; the later ones as siblings."""
        self._age()
        self.seen = True
        for i, (children, taken) in enumerate(walk):
            if not children:
                continue
            first = taken == 0
            self.accepted += first
            self.judged += 1
            if i:
                while len(self.later) < i:
                    self.later.append([0.0, 0.0])
                self.later[i - 1][0] += first
                self.later[i - 1][1] += 1
            tried = children - 1 if taken < 0 else taken
            while len(self.siblings) < tried:
                self.siblings.append([0.0, 0.0])
            for r in range(1, tried + 1):
                self.siblings[r - 1][0] += r == taken
                self.siblings[r - 1][1] += 1

    def sibling_alphas(self, ranks: int) -> list[float]:
        """c_1 … c_ranks: the chance that a later sibling of each rank passes once those
        before it failed, shrunk toward SIBLING_PRIOR."""
        prior = POSITION_PRIOR * SIBLING_PRIOR
        seen = self.siblings
        return [
            (seen[r][0] + prior) / (seen[r][1] + POSITION_PRIOR) if r < len(seen) else SIBLING_PRIOR
            for r in range(ranks)
        ]

    def observe_confidence(self, top: float) -> None:
        """A plain step where the target's top probability was `top`."""
        self._age()  # what drafts showed ages by a step too: the text moves on
        b = band(top)
        self.sure[b] += top
        self.steps[b] += 1
        self.seen = True

    def _age(self) -> None:
        self.accepted *= DECAY
        self.judged *= DECAY
        self.sure = [DECAY * x for x in self.sure]
        self.steps = [DECAY * x for x in self.steps]
        for counts in (*self.later, *self.siblings):
            counts[0] *= DECAY
            counts[1] *= DECAY

    @property
    def alpha(self) -> float:
        # Each band's calibrated sum, capped at its steps: no step forecasts more than 1.
        forecast = sum(map(min, map(mul, self.calibration, self.sure), self.steps))
        accepted = self.accepted + CONFIDENCE_WEIGHT * forecast
        return accepted / (self.judged + CONFIDENCE_WEIGHT * sum(self.steps))

    def by_position(self, g: int) -> list[float]:
        """α_0 … α_(g-1): the first draft's chance is the pooled α (all the evidence: its
        position holds most of the rejections, so its own count would be shrunk toward
        itself); each later position's own drafts are shrunk toward it."""
        alpha = self.alpha  # a property over all the evidence: read once, not per position
        prior = POSITION_PRIOR * alpha
        seen = self.later
        later = [
            (seen[i][0] + prior) / (seen[i][1] + POSITION_PRIOR) if i < len(seen) else alpha
            for i in range(g - 1)
        ]
        return [alpha, *later][:g]

    def passing(self, g: int) -> list[float]:
        """The chance that drafts 0 … i all pass, for i < g: α_0, α_0·α_1, …"""
        out, chance = [], 1.0
        for a in self.by_position(g):
            chance *= a
            out.append(chance)
        return out

    def expected_judged(self, g: int) -> float:
        """Drafts the target rules on out of g: 1 + α_0 + α_0·α_1 + … (g terms)."""
        return 1.0 + sum(self.passing(g - 1)) if g > 0 else 0.0

    def expected_tokens(self, g: int) -> float:
        """E[N] for g drafts: 1 + α_0 + … + α_0·…·α_(g-1) (the judged drafts' series,
        one term on)."""
        return self.expected_judged(g + 1)


def band(top: float) -> int:
    """Which band of BANDS a top probability falls in."""
    return next((i for i, edge in enumerate(BANDS) if top < edge), len(BANDS))
