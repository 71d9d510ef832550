"""Choosing the draft length γ each round so that speculation never loses.

A round with γ drafts costs γ·t_draft + T(γ+1) (T(k): one target pass over k new
tokens) and yields E[N] = 1 + α + … + α^γ tokens, α being the chance that a draft is
accepted. γ = 0 is plain decoding: one token per T(1). Each round picks the γ with the
most expected tokens per second.

Costs are kept as ratios to T(1). On a shared machine load moves every pass's time
together, and one pass can be slow for reasons of its own (a burst of load, the first
call at a new shape), so each multi-token target pass and each draft pass is recorded as
its ratio to the T(1) of the moment, and a figure is the median of its recent ratios:
one outlier cannot lock a draft length out. The choice depends on ratios and α alone.

α is estimated per generate() call, from two kinds of evidence. Rounds with drafts count
what the target accepted. Plain rounds cost nothing to read: the target's own top
probability at each step forecasts whether a draft would have passed there (a draft of
the same family agrees with the target about as often as the target is sure: 0.98 on
code, 0.6 on prose, bench/results/confidence_agreement.md). So a call starts drafting when
its text is forecast to pay, with no look at a guess, and draft evidence ages with the
text (a reply moves from prose into code). Drafting then goes on while the forecast stays
near even (hysteresis). Where the forecast says no, plain decoding still looks now and
then, in case the draft does better than the target's confidence says, once the rounds
since can afford the look. A look drafts as many tokens as learn α most cheaply: one on
this CPU's INT4 kernel, where each extra verified token costs a quarter of a pass, more
where the cost curve is flat. A model draft that sat out must first catch up on every
token it missed: cheap where a pass over many tokens costs about one (a fast BLAS, a
GPU), several target passes where it does not, so how often it looks follows the cost
curve. bench/schedule_sim.py replays this policy on synthetic texts.

Within a round the draft's own confidence decides how far it goes: after each draft
pass, the next draft is made only while its expected yield (the chance that every draft
so far passes, forecast from the draft's top probabilities, times the next one's α)
beats plain decoding's for the pass and the verified token it adds. A round that meets
an unsure draft ends there instead of paying for guesses that will not pass. The stop
reads only the draft's side, so the output's distribution is unchanged.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from functools import cached_property
from math import prod
from operator import mul
from pathlib import Path
from statistics import median

DECAY = 0.9  # weight kept by old acceptance observations per round: adapts within ~10 rounds
WINDOW = 16  # recent ratios kept per figure
PRIOR_ALPHA = 0.6  # acceptance assumed before anything is known
PRIOR_WEIGHT = 1.0  # how many drafts' worth of evidence that guess counts as
# Prompt lookup's guess weighs more: its drafts come in bursts (a copied span passes
# whole, then the match runs out), so one miss says little about the next match, and a
# look costs only the verify's extra tokens. At 1, a summary's first miss left lookup
# plain for 3 rounds, and again after each later miss (10 plain rounds of 24, seen).
LOOKUP_PRIOR_WEIGHT = 4.0
# Each draft position's own acceptance is shrunk toward the pooled α by this many
# drafts' worth: a position seen a few times leans on the rest, one seen often speaks.
POSITION_PRIOR = 2.0
# How much of a judged draft's evidence one plain step's top target probability counts
# as. It forecasts agreement at its position well (bench/results/confidence_agreement.md:
# at ≥ 0.99, 258 of 258), and a start must come early: on this CPU's INT4 kernel a draft
# that starts at a 48-token reply's tenth token has its catch-up to pay back first.
# bench/schedule_sim.py: at 0.5 auto drafts code too late to gain (1.01x, best fixed γ
# 1.09x), at 2 it gains 1.09-1.11x and loses nothing on prose or short replies.
CONFIDENCE_WEIGHT = 2.0
# Draft length of the round that first measures the draft's cost and T(k), and the
# longest look at a text's α (probe_length picks the cheapest up to it).
FIRST_PROBE = 3
COST_PROBE = 2  # draft length of a probe that re-measures the verify cost curve only
# Clean draft passes timed before the draft's cost is priced: with one, a pass timed in a
# burst of load (0.93 of T(1) where it is 0.48) priced drafting out for a whole bench run,
# whose cost probes never time the draft again.
DRAFT_FIGURES = 3
FIRST_BACKOFF = 32  # plain rounds before a cost-only probe; doubles after each
# After this many rounds with drafts in a row, one plain round re-measures T(1), to which
# every other cost is relative (a stale T(1) would make speculation look better or worse).
REFRESH = 32
# The calibration of confidence to acceptance is kept per band of top probability (upper
# edges; the last band runs to 1): at T = 1 the top under-forecasts acceptance where the
# target is unsure (0.22 -> 0.47, 0.40 -> 0.57) and over-forecasts a little where it is
# sure (0.97 -> 0.90), so one factor for all fits none (bench/results/confidence_agreement.md).
BANDS = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
# Each band's prior, in drafts judged at its middle (at 1: the measured greedy
# calibration), and the weight its old drafts keep per new one judged in the band.
CALIBRATION_PRIOR = 8.0
CALIBRATION_DECAY = 0.98
TARGET, DRAFT = "", " draft"  # whose top probability a calibration maps (Costs.calibration)
# A look at acceptance that the forecast does not call for may cost at most this share
# of the plain rounds since the last (forecast: the draft's catch-up plus the round, less
# the tokens it yields).
EXPLORE = 0.05
# Speculate only when the forecast beats plain decoding by this much: timings on a busy
# machine are noisy, and a marginal forecast that is wrong costs more than it can gain.
MARGIN = 1.05
# Plain steps (after the process's first) that T(1) needs before any ratio is taken to
# it: every cost is relative to T(1), so one noisy step would skew them all for a call.
SETTLE = 3
# The cost cache's format. 2: draft figures no longer include the draft model's first
# one-token pass in a process (one-time work, 4x a pass); a cache written before may hold
# such a figure, which kept auto from ever drafting, so it is measured afresh. 3: the
# calibration is kept per band of top probability.
COSTS_FORMAT = 3


def _push(samples: list[float], value: float) -> None:
    samples.append(value)
    del samples[:-WINDOW]


@dataclass
class Costs:
    """Pass costs as ratios to T(1): a target pass over k new tokens, a draft pass; and
    how far the target's confidence forecasts this pair's acceptance (`calibration`).

    T(1) itself is the median of this process's recent plain steps but its first, which
    pays one-time work (weights read or expanded on first use, compiles): 0.45 s against
    0.15 s after, on this CPU. A T(1) from the cache (another run) only stands in until then.
    """

    plain: list[float] = field(default_factory=list)  # this process's plain steps, seconds
    target: dict[int, list[float]] = field(default_factory=dict)  # k ≥ 2 -> T(k)/T(1) seen
    draft: list[float] = field(default_factory=list)  # draft pass / T(1) seen
    cached_t1: float | None = None
    # How a top probability maps to acceptance for this pair, per sampling ("greedy" or
    # "sampled") and whose top it is (the target's at a plain step or in the verify; the
    # draft's, " draft" appended), per band of BANDS: [drafts accepted, their top
    # probabilities summed], decayed. Kept with the costs, across calls and runs: a call
    # that starts from no evidence rarely drafts at T = 1 and so never learns it (a
    # Session per call: auto 1.03x on sampled code where γ = 4 gained 1.19x).
    calibration: dict[str, list[list[float]]] = field(default_factory=dict)

    @property
    def settled(self) -> bool:
        """Whether T(1) rests on enough of this process's steps after its first."""
        return len(self.plain) > SETTLE

    @cached_property
    def t1(self) -> float | None:
        if self.settled:
            return median(self.plain[1:])
        return self.cached_t1 or (self.plain[0] if self.plain else None)

    def observe_target(self, k: int, seconds: float) -> None:
        self._changed()
        if k == 1:
            self.plain.append(seconds)
            del self.plain[1:-WINDOW]  # keep the first (to leave out) and the recent
        elif self.settled:
            _push(self.target.setdefault(k, []), seconds / self.t1)

    def observe_draft(self, seconds_per_pass: float) -> None:
        self._changed()
        if self.settled:
            _push(self.draft, seconds_per_pass / self.t1)

    def _changed(self) -> None:
        """Forget the figures read from the samples. Each choice reads them dozens of
        times (0.3 ms a plain round in medians, 0.2% of a step on this CPU), and they
        change only here: the samples are to be changed through observe_* alone."""
        for name in ("t1", "slope", "draft_ratio", "_ratios"):
            self.__dict__.pop(name, None)

    @cached_property
    def slope(self) -> float | None:
        """The extra cost of each new token beyond the first, as a fraction of T(1): the
        median over every multi-token pass seen (a Theil–Sen line through T(1) = 1)."""
        slopes = [(r - 1) / (k - 1) for k, seen in self.target.items() for r in seen]
        return max(median(slopes), 0.0) if slopes else None

    def ratio(self, k: int) -> float | None:
        """T(k)/T(1): the median seen at k once there are a few, else on the line."""
        ratios = self._ratios
        if k not in ratios:
            seen = self.target.get(k, [])
            if k == 1:
                ratios[k] = 1.0
            elif len(seen) >= 3:
                ratios[k] = median(seen)
            else:
                ratios[k] = None if self.slope is None else 1 + self.slope * (k - 1)
        return ratios[k]

    @cached_property
    def _ratios(self) -> dict[int, float | None]:
        return {}

    @cached_property
    def draft_ratio(self) -> float | None:
        return median(self.draft) if len(self.draft) >= DRAFT_FIGURES else None

    def to_json(self) -> dict:
        return {
            "format": COSTS_FORMAT,
            "t1": self.t1,  # one figure: it stands in until this process has its own
            "target": {str(k): v for k, v in self.target.items()},
            "draft": self.draft,
            # This process's plain steps: its next Session goes on from them rather than
            # from one or two new steps (whose noise would skew every ratio of a call).
            "plain": {"pid": os.getpid(), "seconds": self.plain},
            "calibration": self.calibration,
        }

    @classmethod
    def from_json(cls, data: dict) -> Costs:
        if data.get("format") != COSTS_FORMAT:
            raise ValueError(f"cost cache format {data.get('format')}, not {COSTS_FORMAT}")
        target = {int(k): [float(r) for r in v] for k, v in data["target"].items()}
        plain = data.get("plain") or {}
        ours = plain.get("pid") == os.getpid()  # another process's steps are not its T(1)
        mine = [float(t) for t in plain.get("seconds", [])] if ours else []
        calibration = {
            kind: [[float(accepted), float(tops)] for accepted, tops in bands]
            for kind, bands in data.get("calibration", {}).items()
            if len(bands) == len(BANDS) + 1
        }
        return cls(mine, target, [float(r) for r in data["draft"]], float(data["t1"]), calibration)


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
        for counts in self.later:
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


@dataclass
class Choice:
    gamma: int
    # A cost-only probe: measure T(γ+1) with free point-mass guesses instead of the draft
    # model, whose catch-up after many plain steps would cost more than the probe learns.
    cost_probe: bool = False
    predicted_tps: float = 0.0


@dataclass
class Scheduler:
    """Picks γ for one draft source; target costs are shared between sources.

    `free_drafts` is for prompt lookup, whose cost is negligible next to a forward pass.
    """

    costs: Costs
    max_gamma: int = 8
    free_drafts: bool = False
    acceptance: Acceptance = field(default_factory=Acceptance)
    rounds_since_probe: int = 0  # plain rounds since the last with drafts
    drafting: int = 0  # rounds with drafts since the last plain one
    backoff: int = FIRST_BACKOFF
    paused: bool = False  # the last round was plain only to re-measure T(1)
    opening: bool = False  # the next round is a call's first: its token is the target's
    # Which of the costs' calibrations this call reads and teaches: greedy, drafts pass
    # about as often as the target is sure; at T = 1 more often where it is unsure (a
    # close draft is unsure the same way); a weak draft would pass less often.
    sampling: str = "greedy"

    def start_call(self, sampled: bool = False) -> None:
        """A new generate() call: a new text, whose acceptance is learnt afresh (a question
        after code must not start from the code's α: γ = 8 on prose, seen)."""
        self.sampling = "sampled" if sampled else "greedy"
        weight = LOOKUP_PRIOR_WEIGHT if self.free_drafts else PRIOR_WEIGHT
        self.acceptance = Acceptance(PRIOR_ALPHA * weight, weight, calibration=self.calibration)
        self.paused = False
        self.opening = not self.free_drafts
        self.rounds_since_probe = 0
        self.backoff = FIRST_BACKOFF

    @property
    def draft_ratio(self) -> float | None:
        return 0.0 if self.free_drafts else self.costs.draft_ratio

    def rate(self, g: int, perfect: bool = False) -> float | None:
        """Expected tokens per T(1) with γ = g (perfect: as if every draft were accepted)."""
        verify = self.costs.ratio(g + 1)
        if verify is None or (g > 0 and self.draft_ratio is None):
            return None
        passing = [1.0] * g if perfect else self.acceptance.passing(g)
        tokens = 1.0 + sum(passing)
        c = self.draft_ratio or 0.0
        # When every draft passes, the last one was never fed to the draft model: the
        # next round's first draft pass takes it too, a two-token pass.
        carry = passing[-1] * c * ((self.costs.ratio(2) or 2.0) - 1) if g > 0 else 0.0
        return tokens / (g * c + carry + verify)

    def tps(self, rate: float) -> float:
        return rate / self.costs.t1 if self.costs.t1 else 0.0

    def choose(self, remaining: int | None = None) -> Choice:
        """γ for the next round; `remaining`: the most tokens the call may still emit."""
        if not self.costs.settled:
            return Choice(0)  # plain steps measure T(1) and still emit tokens
        if self.opening:
            # A reply's first token follows the chat template's header, where the draft
            # is rarely right (7 of 52 replies, 2 of 40 on code: bench/results/
            # opening_agreement.md): drafting it wastes the round and misreads the text.
            self.opening = False
            self.rounds_since_probe += 1
            return Choice(0)
        first = min(FIRST_PROBE, self.max_gamma)
        if self.rate(first) is None:
            return Choice(first)  # measure the draft's cost and T(k)
        rates = {g: self.rate(g) or 0.0 for g in range(self.max_gamma + 1)}
        plain = Choice(0, predicted_tps=self.tps(rates[0]))
        best = max(range(1, self.max_gamma + 1), key=rates.get)
        # Hysteresis: starting to draft needs the forecast to win by the margin, stopping
        # needs it to lose by as much. A draft model that stops falls behind, and bringing
        # it back costs a pass over every token it missed; going on while the forecast is
        # near even keeps learning this text's α at a small cost.
        going_on, self.paused = self.drafting > 0 or self.paused, False
        need = 1 / MARGIN if going_on else MARGIN
        # This text's α, not only a guess: drafts seen, or the target's confidence in it.
        known = self.free_drafts or self.acceptance.seen
        if known and self.pays(rates[0], rates[best], need, remaining):
            if self.drafting >= REFRESH:
                self.paused = True
                return plain
            self.rounds_since_probe = 0
            self.backoff = FIRST_BACKOFF
            return Choice(best, predicted_tps=self.tps(rates[best]))
        self.rounds_since_probe += 1
        if self.hopeless(rates[0]):
            # Even perfect drafts would lose: only the costs are in question. Measure T(k)
            # now and then with free guesses, and the draft by one pass (the engine): its
            # catch-up on the rounds it missed would cost more than the probe learns.
            if self.rounds_since_probe < self.backoff:
                return plain
            self.rounds_since_probe = 0
            self.backoff = min(self.backoff * 2, 1024)
            return Choice(min(COST_PROBE, self.max_gamma), cost_probe=True)
        # This text's α may be higher than estimated: look once the plain rounds since the
        # last look (or since the call began) can afford the look's forecast loss.
        backlog = self.rounds_since_probe
        g = self.probe_length(first)
        if self.probe_loss(g, backlog) > EXPLORE * backlog:
            return plain
        self.rounds_since_probe = 0
        return Choice(g, predicted_tps=self.tps(rates[0]))

    def pays(self, plain: float, best: float, need: float, remaining: int | None) -> bool:
        """Whether drafting beats plain decoding by `need` over the rest of the call. A
        draft model that sat out first catches up on what it missed: on this CPU's INT4
        kernel a pass over 20 tokens costs 3 target steps, more than drafting the rest of
        a 48-token reply can win back (auto 0.89x on code at T = 1, seen)."""
        if best < need * plain:  # the margin is for the forecast's noise
            return False
        catch_up = self.catch_up(self.rounds_since_probe)  # a known cost: no margin
        return remaining is None or remaining / best + catch_up <= remaining / plain

    def catch_up(self, backlog: int) -> float:
        """The draft's extra cost, in T(1)s, of taking `backlog` missed tokens with its
        first pass (priced on the target's cost curve: the same shape of pass)."""
        c = self.draft_ratio or 0.0
        return c * ((self.costs.ratio(backlog + 1) or backlog + 1) - 1)

    def hopeless(self, plain_rate: float) -> bool:
        """Whether even perfect drafts would lose to plain decoding, at any γ."""
        rates = (self.rate(g, perfect=True) or 0.0 for g in range(1, self.max_gamma + 1))
        return max(rates) < plain_rate

    def probe_length(self, longest: int) -> int:
        """The draft length that learns α most cheaply: where some length is expected to
        pay, the one that pays best; else the least loss per draft the target judges (a
        rejection ends the judging, so at low α a long probe costs more and tells little
        more: on this CPU's INT4 kernel one draft, on a flat cost curve three)."""
        loss = {g: self.probe_loss(g, self.rounds_since_probe) for g in range(1, longest + 1)}
        paying = [g for g, lost in loss.items() if lost <= 0]
        if paying:
            return max(paying, key=lambda g: self.rate(g) or 0.0)
        judged = self.acceptance.expected_judged
        return min(loss, key=lambda g: loss[g] / judged(g))

    def probe_loss(self, g: int, backlog: int) -> float:
        """The time a round of g drafts is expected to lose against plain decoding, in
        T(1)s, after `backlog` plain rounds the draft model must first catch up on (its
        first pass takes them too, priced on the target's cost curve). Its cost is taken
        at the margin that drafting must clear: a forecast short of it is no free look."""
        c = self.draft_ratio or 0.0
        cost = self.catch_up(backlog) + g * c + (self.costs.ratio(g + 1) or g + 1)
        return MARGIN * cost - self.acceptance.expected_tokens(g)

    def record(
        self,
        g: int,
        n: int,
        verify_s: float,
        draft_s: float | None,
        passes: float | None,
        tops: list[float] | None = None,
        draft_tops: list[float] | None = None,
    ) -> None:
        """A finished round: g drafts, n accepted; draft_s None for a cost-only probe;
        passes: one-token draft passes that draft_s stands for (None: not a clean figure);
        tops, draft_tops: the target's and the draft's top probability at each draft the
        target judged (min(n + 1, g) of them)."""
        self.costs.observe_target(g + 1, verify_s)
        self.drafting = self.drafting + 1 if g > 0 else 0
        if g > 0 and draft_s is not None:
            if tops and not self.free_drafts:
                self.calibrate(tops, n)
            if draft_tops and not self.free_drafts:
                self.calibrate(draft_tops, n, DRAFT)
            self.acceptance.observe(g, n)
            if not self.free_drafts and passes:
                self.costs.observe_draft(draft_s / passes)

    def calibrate(self, tops: list[float], n: int, whose: str = TARGET) -> None:
        """Teach the calibration what the target's confidence said at each judged draft
        and whether it passed (the first n did). Read at the draft itself, from the
        verify pass: a forecast from the plain steps before a round would be stale, and
        learnt only where drafting had started, it read low (rounds start where the
        forecast happened to be high: 0.99 learnt at T = 1, where the band figures run
        0.92-2.1). `whose`: the target's tops, or the draft's (DRAFT)."""
        bands = self.costs.calibration.setdefault(
            self.sampling + whose, [[0.0, 0.0] for _ in range(len(BANDS) + 1)]
        )
        for i, top in enumerate(tops):
            counts = bands[band(top)]
            counts[0] = CALIBRATION_DECAY * counts[0] + (i < n)
            counts[1] = CALIBRATION_DECAY * counts[1] + top
        if whose == TARGET:
            self.acceptance.calibration = self.calibration

    @property
    def calibration(self) -> list[float]:
        """Per band: drafts accepted per unit of the target's top probability, for this
        call's sampling, from CALIBRATION_PRIOR drafts' worth at 1 (greedy, the top is
        calibrated as it is: confidence_agreement.md)."""
        return self.factors(TARGET)

    def factors(self, whose: str) -> list[float]:
        """Per band: drafts accepted per unit of `whose` top probability (see calibration)."""
        edges = (0.0, *BANDS, 1.0)
        bands = self.costs.calibration.get(self.sampling + whose)
        factors = []
        for b, (accepted, tops) in enumerate(bands or [(0.0, 0.0)] * (len(BANDS) + 1)):
            prior = CALIBRATION_PRIOR * (edges[b] + edges[b + 1]) / 2
            factors.append((accepted + prior) / (tops + prior))
        return factors

    def forecast(self, top: float, whose: str = TARGET) -> float:
        """The chance that a draft passes where `whose` top probability is `top`."""
        return min(1.0, top * self.factors(whose)[band(top)])

    def keep_drafting(self, draft_tops: list[float]) -> bool:
        """Whether the draft should make one more token this round, given its top
        probability at each of the round's drafts so far. The next draft adds a draft
        pass and a verified token; it yields a token only if every draft before it passes
        (forecast from the draft's tops: a sure draft is seldom wrong, an unsure one
        often) and it passes too (its position's α). It goes on while that yield beats
        plain decoding's for the same time: a round whose drafts turn unsure stops there,
        where on this CPU's INT4 kernel three drafts that do not pass cost two plain steps."""
        i = len(draft_tops)
        chance = prod(self.forecast(top, DRAFT) for top in draft_tops)
        alpha = self.acceptance.by_position(i + 1)[i]
        verify = (self.costs.ratio(i + 2) or i + 2) - (self.costs.ratio(i + 1) or i + 1)
        # Plain decoding yields one token per T(1), the unit of every cost here.
        return chance * alpha >= (self.draft_ratio or 0.0) + verify

    def observe_confidence(self, top: float) -> None:
        """A plain step's top target probability: a forecast of this text's α."""
        self.acceptance.observe_confidence(top)


def band(top: float) -> int:
    """Which band of BANDS a top probability falls in."""
    return next((i for i, edge in enumerate(BANDS) if top < edge), len(BANDS))


def cost_cache_path() -> Path:
    from .paths import home

    return home() / "costs.json"


def load_costs(key: str) -> Costs:
    """This pair's cached costs; nothing when absent or in an old format."""
    try:
        return Costs.from_json(json.loads(cost_cache_path().read_text())[key])
    except (OSError, KeyError, ValueError, TypeError, AttributeError):
        return Costs()


def save_costs(key: str, costs: Costs) -> None:
    """Merge this pair's costs into the cache file atomically (temp file + rename)."""
    path = cost_cache_path()
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        data = {}
    data[key] = costs.to_json()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".costs-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only means the next run measures again
