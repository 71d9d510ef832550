"""γ for sequences that share a target pass (specmlx.batch): the round priced as a batch.

Alone, a sequence's auto policy (auto.AutoGamma) weighs its drafts against T(k), a pass
over k tokens. In a batch every row is padded to the round's widest proposal, so one
sequence's drafts widen everybody's pass, and the draft passes hold up every row too.
So each round the batch chooses, for every sequence, a γ no larger than the one its own
policy wanted, for the most tokens per second in all:

    Σ_s E_s(γ_s)  /  (T(B, max_s γ_s + 1) + drafting)

where E_s(γ) = 1 + Σ_{i<γ} passing_s[i] is the sequence's expected tokens (its own
acceptance, position by position). A draft model's steps are shared (specmlx.batch): its
k-th step is ONE pass over the n_k sequences drafting that far, so drafting is
Σ_k D(n_k) per draft model, D(n) a step over n rows of one token; a drafter whose passes
are its own (a head's) costs γ_s · draft_s, its pass's cost (0 for a free drafter such as
prompt lookup). T(B, k), a pass over B rows of k tokens, and D(n) are measured online
like T(k) (`BatchCosts`: the median of the recent passes of that shape); until a shape
has been seen, the sequence's own cost line prices T(B, k) as one pass over B·k tokens,
and D(n) as its draft pass scaled by that line at n tokens (the shape auto prices a
draft pass over several tokens by). A shape nobody can price is not chosen: the round
stays plain, which is exact and measures T(B, 1).

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

TARGET = "target"  # BatchCosts' key of the target's passes (a draft's is its cost_id)
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
    # Its draft model's cost_id where its steps share a pass with others of that key
    # (specmlx.batch); None: its drafts are its own passes
    draft_id: str | None = None

    def tokens(self, gamma: int) -> float:
        return 1.0 + sum(self.passing[:gamma])


class BatchCosts:
    """T(B, k) and each draft model's D(n) measured: the recent passes over B rows of k
    tokens, by whose model ran them (TARGET, or a draft's cost_id)."""

    def __init__(self):
        self.seen: dict[tuple[str, int, int], list[float]] = {}

    def observe(self, rows: int, width: int, seconds: float, model: str = TARGET) -> None:
        samples = self.seen.setdefault((model, rows, width), [])
        samples.append(seconds)
        del samples[:-WINDOW]

    def _measured(self, model: str, rows: int, width: int) -> float | None:
        samples = self.seen.get((model, rows, width), [])
        return median(samples) if len(samples) >= SEEN else None

    def draft_pricer(self, wants: list[Want]) -> Callable[[str, int], float | None]:
        """(draft id, n) -> seconds of one shared draft step over n rows of one token:
        measured where seen SEEN times, else a sequence's own draft pass of that id scaled
        by its target line at n tokens (n of them where it has no line)."""
        firsts = {w.draft_id: w for w in reversed(wants) if w.draft_id is not None}

        def price(draft_id: str, rows: int) -> float | None:
            measured = self._measured(draft_id, rows, 1)
            if measured is not None:
                return measured
            want = firsts[draft_id]
            ratio = want.ratio(rows)
            return want.draft_s * (rows if ratio is None else ratio)

        return price

    def pricer(self, rows: int, wants: list[Want]) -> Callable[[int], float | None]:
        """width -> seconds of a pass over `rows` rows that wide: measured where seen
        SEEN times, else the first priced sequence's line at rows · width tokens."""
        line = next((w for w in wants if w.t1 is not None), None)

        def price(width: int) -> float | None:
            measured = self._measured(TARGET, rows, width)
            if measured is not None:
                return measured
            if line is None:
                return None
            ratio = line.ratio(rows * width)
            return None if ratio is None else line.t1 * ratio

        return price


def drafting_s(
    gammas: list[int], wants: list[Want], draft_price: Callable[[str, int], float | None] | None
) -> float | None:
    """Seconds of a round's drafting: one shared pass per step of each draft id over the
    sequences drafting that far (with `draft_price`), γ · draft_s for the others."""
    total, shared = 0.0, {}
    for g, w in zip(gammas, wants, strict=True):
        if w.draft_id is None or draft_price is None:
            total += g * w.draft_s
        else:
            shared.setdefault(w.draft_id, []).append(g)
    for draft_id, gs in shared.items():
        for k in range(1, max(gs) + 1):
            step_s = draft_price(draft_id, sum(g >= k for g in gs))
            if step_s is None:
                return None
            total += step_s
    return total


def choose_gammas(
    wants: list[Want],
    price: Callable[[int], float | None],
    others: int = 0,
    draft_price: Callable[[str, int], float | None] | None = None,
) -> list[int]:
    """Each sequence's γ for the round (≤ what it wanted) for the most expected tokens per
    second in all, within the fairness bound; `others`: rows of sequences not priced here
    (a fixed γ), each counted as one token; `draft_price`: a shared draft step's cost
    (BatchCosts.draft_pricer; None: every draft pass priced as its own). All 0 where the
    plain round cannot be priced."""
    plain_s = price(1)
    zeros = [0] * len(wants)
    if plain_s is None:
        return zeros

    def rate(gammas: list[int]) -> float | None:
        width = max(gammas, default=0) + 1
        pass_s = price(width)
        draft_s = drafting_s(gammas, wants, draft_price)
        if pass_s is None or draft_s is None:
            return None
        round_s = pass_s + draft_s
        tokens = [w.tokens(g) for g, w in zip(gammas, wants, strict=True)]
        if any(t / round_s < FAIRNESS / plain_s for t in tokens):
            return None
        return (sum(tokens) + others) / round_s

    best, best_rate = zeros, rate(zeros)
    for width in range(2, max((w.gamma for w in wants), default=0) + 2):
        capped = [min(w.gamma, width - 1) for w in wants]
        # Grown from all-plain, and cut from all drafting: a shared draft step costs
        # little more per row, so a set that pays together may hold no one that pays alone.
        for gammas, current in (_search(zeros, capped, rate), _search(capped, zeros, rate)):
            if current is not None and (best_rate is None or current > best_rate):
                best, best_rate = gammas, current
    return best


def _search(
    start: list[int], goal: list[int], rate: Callable[[list[int]], float | None]
) -> tuple[list[int], float | None]:
    """From `start`, move one sequence at a time to its `goal` γ, the move that raises the
    rate most, while one does: the γs reached and their rate."""
    gammas, current = list(start), rate(start)
    while True:
        tries = []
        for i, (g, to) in enumerate(zip(gammas, goal, strict=True)):
            if g != to:
                trial = gammas[:i] + [to] + gammas[i + 1 :]
                r = rate(trial)
                if r is not None and (current is None or r > current):
                    tries.append((r, trial))
        if not tries:
            return gammas, current
        current, gammas = max(tries, key=lambda t: t[0])


class BatchPolicy:
    """A sequence's auto policy (auto.AutoGamma) inside a batch: it plans as alone, tells
    the batch what it wanted, and takes the batch's γ for the round while others share
    the pass; alone it is the inner policy, untouched. A batched pass's time is no figure
    of this sequence's T(k), nor its shared draft steps' of its draft pass: those rounds
    teach acceptance, never costs."""

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
        shared = None if scheduler.free_drafts else getattr(plan.drafter, "shared_key", None)
        return Want(plan.gamma, passing, draft, t1, costs.ratio, shared)

    def observe(self, r: RoundSummary) -> None:
        if self.shared_round:
            r = replace(r, verify_s=None, rewind_s=0.0)
        self.inner.observe(r)

    def while_running(self) -> None:
        self.inner.while_running()

    def finish(self) -> None:
        self.inner.finish()
