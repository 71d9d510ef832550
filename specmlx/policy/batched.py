"""γ for sequences that share a target pass (specmlx.batch): the round priced as a batch.

Alone, a sequence's auto policy (auto.AutoGamma) weighs its drafts against T(k), a pass
over k tokens. In a batch every row is padded to the round's widest proposal, so one
sequence's drafts widen everybody's pass, and a draft model's passes (one sequence's
each) hold up every row too. So each round the batch chooses, for every sequence, a γ
no larger than the one its own policy wanted, for the most tokens per second in all:

    Σ_s E_s(γ_s)  /  (T(B, max_s γ_s + 1) + Σ_s γ_s · draft_s)

where E_s(γ) = 1 + Σ_{i<γ} passing_s[i] is the sequence's expected tokens (its own
acceptance, position by position) and draft_s its draft pass's cost (0 for a free
drafter such as prompt lookup). T(B, k), a pass over B rows of k tokens, is measured
online like T(k) (`BatchCosts`: the median of the recent passes of that shape); until a
shape has been seen, the sequence's own cost line prices it as one pass over B·k tokens.
A shape nobody can price is not chosen: the round stays plain, which is exact and
measures T(B, 1).

Fairness bound: no sequence's expected tokens per second may fall below FAIRNESS of what
an all-plain round gives it (one token per T(B, 1)). Every sequence has a row in every
pass, so none ever waits a round out; this bound keeps one sequence's long proposals from
slowing the others' streams by more than that.

At one sequence nothing here runs: the policy is exactly the engine's auto.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from statistics import median

from .round import Plan, RoundSummary

FAIRNESS = 0.5  # the least share of an all-plain round's rate any sequence keeps
WINDOW = 16  # recent passes kept per (rows, width)
SEEN = 3  # passes of a shape before its own figure replaces the prior


@dataclass(frozen=True)
class Want:
    """What a sequence's own policy asked for its next round, and what prices it."""

    gamma: int  # the γ its own policy chose (the batch only lowers it)
    passing: tuple[float, ...]  # P(draft i is accepted and every one before it), i < gamma
    draft_s: float  # one draft pass, seconds (0 for a free drafter)
    t1: float | None = None  # its target's one-token pass, seconds, where measured
    ratio: Callable[[int], float | None] = lambda k: None  # its T(k) / T(1) line

    def tokens(self, gamma: int) -> float:
        return 1.0 + sum(self.passing[:gamma])


class BatchCosts:
    """T(B, k) measured: the recent passes over B rows of k tokens."""

    def __init__(self):
        self.seen: dict[tuple[int, int], list[float]] = {}

    def observe(self, rows: int, width: int, seconds: float) -> None:
        samples = self.seen.setdefault((rows, width), [])
        samples.append(seconds)
        del samples[:-WINDOW]

    def pricer(self, rows: int, wants: list[Want]) -> Callable[[int], float | None]:
        """width -> seconds of a pass over `rows` rows that wide: measured where seen
        SEEN times, else the first priced sequence's line at rows · width tokens."""
        line = next((w for w in wants if w.t1 is not None), None)

        def price(width: int) -> float | None:
            samples = self.seen.get((rows, width), [])
            if len(samples) >= SEEN:
                return median(samples)
            if line is None:
                return None
            ratio = line.ratio(rows * width)
            return None if ratio is None else line.t1 * ratio

        return price


def choose_gammas(
    wants: list[Want], price: Callable[[int], float | None], others: int = 0
) -> list[int]:
    """Each sequence's γ for the round (≤ what it wanted) for the most expected tokens per
    second in all, within the fairness bound; `others`: rows of sequences not priced here
    (a fixed γ), each counted as one token. All 0 where the plain round cannot be priced."""
    plain_s = price(1)
    zeros = [0] * len(wants)
    if plain_s is None:
        return zeros

    def rate(gammas: list[int]) -> float | None:
        width = max(gammas, default=0) + 1
        pass_s = price(width)
        if pass_s is None:
            return None
        round_s = pass_s + sum(g * w.draft_s for g, w in zip(gammas, wants, strict=True))
        tokens = [w.tokens(g) for g, w in zip(gammas, wants, strict=True)]
        if any(t / round_s < FAIRNESS / plain_s for t in tokens):
            return None
        return (sum(tokens) + others) / round_s

    best, best_rate = zeros, rate(zeros)
    for width in range(2, max((w.gamma for w in wants), default=0) + 2):
        gammas = list(zeros)
        current = rate(gammas)
        while True:  # add the sequence that raises the rate most, while one does
            tries = []
            for i, w in enumerate(wants):
                if gammas[i] == 0 and w.gamma > 0:
                    trial = gammas[:i] + [min(w.gamma, width - 1)] + gammas[i + 1 :]
                    r = rate(trial)
                    if r is not None and (current is None or r > current):
                        tries.append((r, trial))
            if not tries:
                break
            current, gammas = max(tries, key=lambda t: t[0])
        if current is not None and (best_rate is None or current > best_rate):
            best, best_rate = gammas, current
    return best


class BatchPolicy:
    """A sequence's auto policy (auto.AutoGamma) inside a batch: it plans as alone, tells
    the batch what it wanted, and takes the batch's γ for the round while others share
    the pass; alone it is the inner policy, untouched. A batched pass's time is no figure
    of this sequence's T(k): those rounds teach acceptance, never costs."""

    def __init__(self, inner, seat):
        self.inner, self.seat = inner, seat
        self.want: Want | None = None
        self.shared_round = False

    @property
    def drafters(self):
        return self.inner.drafters

    @property
    def helpers(self):
        return self.inner.helpers

    def plan(self, remaining: int, context: int = 0) -> Plan:
        plan = self.inner.plan(remaining, context)
        self.shared_round = self.seat.shared
        if not self.shared_round:
            self.want = None
            return plan
        self.want = self._want(plan)
        cap = self.seat.batch.cap(self.seat)
        probe = plan.drafter is not None and plan.drafter is getattr(self.inner, "probe", None)
        gamma = 0 if probe or cap is None else min(plan.gamma, cap)
        if gamma < plan.gamma:
            self.seat.capped += 1
        return replace(plan, gamma=gamma, tree=None)  # batched rounds verify chains

    def _want(self, plan: Plan) -> Want:
        scheduler = self.inner.scheduler
        if scheduler is None or plan.gamma == 0:
            return Want(0, (), 0.0)
        costs = scheduler.costs
        t1 = costs.t1
        draft = 0.0 if scheduler.free_drafts else (scheduler.draft_ratio or 0.0) * (t1 or 0.0)
        passing = tuple(scheduler.acceptance.passing(plan.gamma))
        return Want(plan.gamma, passing, draft, t1, costs.ratio)

    def observe(self, r: RoundSummary) -> None:
        if self.shared_round:
            r = replace(r, verify_s=None, rewind_s=0.0)
        self.inner.observe(r)

    def while_running(self) -> None:
        self.inner.while_running()

    def finish(self) -> None:
        self.inner.finish()
