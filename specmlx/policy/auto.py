"""Auto γ as the engine sees it: which drafter, how many drafts, what each round teaches.

The choice itself is choice.Scheduler's, one per draft source (the draft model, prompt
lookup), both over one measured cost curve kept by the Session across calls.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from ..drafters import CostProbe, LookupDrafter, ModelDrafter, Proposal
from ..verify import top_probabilities, top_probability
from .choice import Scheduler
from .round import Plan, Round


class AutoGamma:
    def __init__(
        self,
        schedulers: dict[str, Scheduler],
        model: ModelDrafter | None,
        lookup: LookupDrafter | None,
        probe: CostProbe,
        vocab_size: int,
        sampled: bool,
        keep: Callable[[], None] = lambda: None,
    ):
        self.keep = keep  # saves what was learnt (the Session's shared costs)
        self.schedulers, self.model, self.lookup, self.probe = schedulers, model, lookup, probe
        self.vocab_size = vocab_size
        for scheduler in schedulers.values():
            scheduler.start_call(sampled=sampled)
        self.scratch = np.empty(vocab_size, np.float32)
        self.scheduler: Scheduler | None = None  # the one that chose this round
        self.draft_tops: list[float] = []  # the draft's top probability at each draft so far
        self.rounds = 0
        self.unread: Round | None = None  # a plain round whose confidence is still unread

    def plan(self, remaining: int) -> Plan:
        longest = max(s.max_gamma for s in self.schedulers.values())
        found = self.lookup.find(longest) if self.lookup is not None else []
        choice = None
        if self.lookup is not None and (self.model is None or found):
            source, drafter = "lookup", self.lookup
            choice = self.schedulers[source].choose(remaining)
            if self.model is not None and (choice.gamma == 0 or choice.cost_probe):
                # Lookup declines (a match whose guesses seldom pass: a one-token match is
                # found in almost any long text): the draft model may still pay here.
                choice = None
        if choice is None and self.model is not None:
            source, drafter = "model", self.model
            choice = self.schedulers[source].choose(remaining, self.model.behind)
        if choice is None:
            self.scheduler = None
            return Plan(None, 0)
        self.scheduler = scheduler = self.schedulers[source]
        if choice.cost_probe:
            if self.model is not None and not scheduler.free_drafts:
                # Re-time the draft too: a figure taken in a burst of load must not keep
                # it out for good (these probes never run the draft otherwise).
                scheduler.costs.observe_draft(self.model.time_pass())
            return Plan(self.probe, choice.gamma, predicted_tps=choice.predicted_tps)
        if source == "lookup":
            return Plan(drafter, len(found[: choice.gamma]), predicted_tps=choice.predicted_tps)
        self.draft_tops = []
        alpha = scheduler.acceptance.alpha if scheduler.acceptance.seen else None
        return Plan(
            drafter, choice.gamma, self._go_on, choice.predicted_tps, scheduler.draft_ratio, alpha
        )

    def _go_on(self, logits: mx.array, probs: mx.array | None) -> bool:
        """The draft's own confidence may end the round before the γ chosen."""
        self.draft_tops.append(top_probability(logits, probs, self.vocab_size, self.scratch))
        return self.scheduler.keep_drafting(self.draft_tops)

    def observe(self, r: Round) -> None:
        self.rounds += 1
        if r.proposal is None and self.model is not None and self.rounds > 1:
            # Plain rounds show how sure the target is: a forecast of acceptance, read in
            # while_running. A reply's first token is no sign of its text: it follows the
            # chat template's header.
            self.unread = r
        if self.scheduler is None:
            return
        g, n = r.drafted, r.accepted
        model_round = r.source == "model"
        tops = judged = None
        if model_round:  # what the target's and the draft's confidence said, draft by draft
            tops = top_probabilities(
                r.logits, r.probs, min(n + 1, g), self.vocab_size, self.scratch
            )
            judged = self.draft_tops[: min(n + 1, g)]
        draft_s = None if r.source == "probe" else r.draft_s
        passes = self._passes(r.proposal, g) if model_round else g
        self.scheduler.record(g, n, r.verify_s, draft_s, passes, tops, judged, r.rewind_s)

    def while_running(self) -> None:
        """Read the last plain round's confidence while the next pass runs: the numpy read
        over the vocabulary would otherwise hold that pass back every plain round. The
        next plan sees a forecast one round older: bench/schedule_sim.py's replay moves
        by under half a percent either way (bench/results/README.md, round 34)."""
        if self.unread is not None:
            r, self.unread = self.unread, None
            top = top_probability(r.logits, r.probs, self.vocab_size, self.scratch)
            self.schedulers["model"].observe_confidence(top)

    def _passes(self, proposal: Proposal | None, g: int) -> float | None:
        """How many one-token draft passes a model round's draft time stands for, or None
        when it is no clean figure of one: a Session's first proposal (it pays the draft
        model's one-time work: taken as its cost, auto never drafted again in that
        process), or a first pass that also took a backlog of missed tokens."""
        if proposal is None or proposal.first or proposal.fed > 1:
            return None if proposal is not None else g
        if proposal.fed == 1:  # after a fully accepted round: its last draft rode along
            two = self.scheduler.costs.ratio(2)  # priced on the target's curve: same shape
            return g - 1 + two if two else None
        return g

    def finish(self) -> None:
        self.keep()
