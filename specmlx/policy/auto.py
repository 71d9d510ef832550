"""Auto γ as the engine sees it: which drafter, how many drafts, what each round teaches.

The choice itself is choice.Scheduler's, one per drafter, over measured cost curves kept
by the Session across calls. Drafters are asked in the order given (free ones first):
one that has nothing to offer, or whose scheduler declines, leaves the round to the next,
and the last one's choice stands.
"""

from __future__ import annotations

from collections.abc import Callable

from .. import tree
from ..drafters import grows_trees, is_free
from ..drafters.probe import CostProbe
from ..drafters.protocol import Drafter, available, behind
from .choice import Scheduler
from .costs import Costs, context_band
from .round import Plan, RoundSummary


class AutoGamma:
    def __init__(
        self,
        drafters: list[Drafter],
        schedulers: dict[str, Scheduler],
        sampled: bool,
        keep: Callable[[], None] = lambda: None,
        costs_at: Callable[[int], dict[str, Costs]] | None = None,
        trees: int = 0,
    ):
        """`trees`: the most nodes of a tree a round may draft, where a drafter grows trees
        (0: chains only)."""
        self.keep = keep  # saves what was learnt (the Session's costs)
        self.drafters, self.schedulers = drafters, schedulers
        # each drafter's costs in a band of context length (costs.context_band), where
        # they are kept apart; None: one curve for every context
        self.costs_at, self.band = costs_at, None
        self.probe = CostProbe()
        self.helpers: list[Drafter] = [self.probe]
        for d in drafters:
            schedulers[d.name].start_call(sampled, trees if grows_trees(d) else 0)
        # Plain rounds forecast acceptance for drafters that cost a pass (lookup's is its
        # match, not the target's confidence).
        self.forecast = [schedulers[d.name] for d in drafters if not is_free(d)]
        self.scheduler: Scheduler | None = None  # the one that chose this round
        self.rounds = 0
        self.unread: RoundSummary | None = None  # a plain round whose confidence is unread

    def plan(self, remaining: int, context: int = 0) -> Plan:
        """`context`: the tokens the target's cache holds, which its costs depend on."""
        band = context_band(context)
        if self.costs_at is not None and band != self.band:
            for name, costs in self.costs_at(band).items():
                self.schedulers[name].costs = costs
        self.band = band
        self.scheduler, choice = None, None
        for i, drafter in enumerate(self.drafters):
            last = i == len(self.drafters) - 1
            scheduler = self.schedulers[drafter.name]
            offer = available(drafter, scheduler.max_gamma)
            if not offer and not last:
                continue
            choice = scheduler.choose(remaining, behind(drafter))
            # A drafter that declines (a match whose guesses seldom pass: a one-token match
            # is found in almost any long text) leaves the round to the next.
            if last or (choice.gamma and not choice.cost_probe):
                break
        if choice is None:
            return Plan(None, 0)
        self.scheduler = scheduler
        if choice.cost_probe:
            if not scheduler.free_drafts and hasattr(drafter, "time_pass"):
                self.probe.retime = drafter  # a figure taken in a burst of load must not
                # keep it out for good (cost probes never run it otherwise)
            return Plan(self.probe, choice.gamma, predicted_tps=choice.predicted_tps)
        if scheduler.free_drafts:
            gamma = choice.gamma if choice.tree else min(offer, choice.gamma)
            return Plan(drafter, gamma, predicted_tps=choice.predicted_tps, tree=choice.tree)
        alpha = scheduler.acceptance.alpha if scheduler.acceptance.seen else None
        go_on = scheduler.keep_drafting
        ratio = scheduler.draft_ratio
        return Plan(drafter, choice.gamma, go_on, choice.predicted_tps, ratio, alpha, choice.tree)

    def observe(self, r: RoundSummary) -> None:
        self.rounds += 1
        if r.source == "plain" and self.forecast and self.rounds > 1:
            # Plain rounds show how sure the target is: a forecast of acceptance, read in
            # while_running. A reply's first token is no sign of its text: it follows the
            # chat template's header.
            self.unread = r
        scheduler = self.scheduler
        if scheduler is None:
            return
        if r.timed_draft_s is not None:
            scheduler.costs.observe_draft(r.timed_draft_s)
        g, n = r.drafted, r.accepted
        if r.parents is not None:
            scheduler.record_tree(g, r.verify_s, tree.walk(r.parents, r.path))
            return
        costly = r.plan.drafter is not self.probe and not scheduler.free_drafts
        tops = judged = None
        if costly:  # what the target's and the draft's confidence said, draft by draft
            tops = r.target_tops(min(n + 1, g))
            judged = r.draft_tops[: min(n + 1, g)]
        draft_s = None if r.plan.drafter is self.probe else r.draft_s
        passes = self._passes(r, g) if costly else g
        scheduler.record(g, n, r.verify_s, draft_s, passes, tops, judged, r.rewind_s)

    def while_running(self) -> None:
        """Read the last plain round's confidence while the next pass runs: the read over
        the vocabulary would otherwise hold that pass back every plain round. The next
        plan sees a forecast one round older (bench/results/ARCHIVE.md, 'schedule_sim.py')."""
        if self.unread is not None:
            r, self.unread = self.unread, None
            # A draft behind for the rest of the call needs no forecast: the read over the
            # vocabulary, on the host while the next pass runs, costs that pass a core.
            readers = [s for s in self.forecast if not s.out_for_call]
            if readers:
                top = r.target_tops(1)[0]
                for scheduler in readers:
                    scheduler.observe_confidence(top)

    def _passes(self, r: RoundSummary, g: int) -> float | None:
        """How many one-token draft passes a round's draft time stands for, or None when it
        is no clean figure of one: a Session's first proposal (it pays the draft model's
        one-time work: taken as its cost, auto never drafted again in that process), or a
        first pass that also took a backlog of missed tokens."""
        if r.first or r.fed > 1:
            return None
        if r.fed == 1:  # after a fully accepted round: its last draft rode along
            two = self.scheduler.costs.ratio(2)  # priced on the target's curve: same shape
            return g - 1 + two if two else None
        return g

    def finish(self) -> None:
        self.keep()
