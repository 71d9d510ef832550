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
code, 0.6 on prose, bench/results/confidence_agreement.md). So a call starts drafting
when its text is forecast to pay, with no look at a guess, and draft evidence ages with
the text (a reply moves from prose into code). Drafting then goes on while the forecast
stays near even (hysteresis). Where the forecast says no, plain decoding still looks now
and then, in case the draft does better than the target's confidence says, once the
rounds since can afford the look. A look drafts as many tokens as learn α most cheaply:
one where each extra verified token costs a good share of a pass, more where the cost
curve is flat. A model draft that sat out must first catch up on every token it missed:
cheap where a pass over many tokens costs about one (a fast BLAS, a GPU), several target
passes where it does not, so how often it looks follows the cost curve. Its first
catch-up in a call is the prompt: a draft that never drafts never takes it, so a long
prompt with a short reply is decoded plain (or by prompt lookup, which takes nothing).
Its replay on synthetic texts: bench/results/ARCHIVE.md, 'schedule_sim.py'.

Where the call allows trees and the drafter grows them, each round also prices the best
tree of each size up to the call's limit (trees.py: the greedy tree under Sequoia's
positional acceptance, this text's α per depth and its later siblings' acceptance) on
the same costs: its draft passes (one per level, as wide as the nodes run there) and one
verify over its nodes. A tree is drafted where it beats the best chain: where T(k) is
flat (a GPU, AMX, AVX-512 for small k) the extra candidates cost about nothing; where
it grows steeply (an AVX2 CPU, ~0.45 T(1) a token) a chain's next draft is worth more
than any sibling, and chains are kept.

Within a round the draft's own confidence decides how far it goes: after each draft
pass, the next draft is made only while its expected yield (the chance that every draft
so far passes, forecast from the draft's top probabilities, times the next one's α)
beats plain decoding's for the pass and the verified token it adds. A round that meets
an unsure draft ends there instead of paying for guesses that will not pass. The stop
reads only the draft's side, so the output's distribution is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from ..drafters.treedraft import pass_widths
from ..tree import Shape
from .acceptance import BANDS, PRIOR_ALPHA, PRIOR_WEIGHT, Acceptance, band
from .costs import FIRST_BACKOFF, Costs
from .trees import MAX_WIDTH, grow_shape

# Prompt lookup's guess weighs more: its drafts come in bursts (a copied span passes
# whole, then the match runs out), so one miss says little about the next match, and a
# look costs only the verify's extra tokens. At the model's weight, a summary's first miss
# left lookup plain for several rounds, and again after each later miss.
LOOKUP_PRIOR_WEIGHT = 4.0
# Draft length of the round that first measures the draft's cost and T(k), and the
# longest look at a text's α (probe_length picks the cheapest up to it).
FIRST_PROBE = 3
COST_PROBE = 2  # draft length of a probe that re-measures the verify cost curve only
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


@dataclass
class Choice:
    gamma: int
    # A cost-only probe: measure T(γ+1) with free point-mass guesses instead of the draft
    # model, whose catch-up after many plain steps would cost more than the probe learns.
    cost_probe: bool = False
    predicted_tps: float = 0.0
    tree: Shape | None = None  # a tree of `gamma` nodes in this shape, rather than a chain


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
    opening: bool = False  # the next round is a call's first: its token is the target's
    # Which of the costs' calibrations this call reads and teaches: greedy, drafts pass
    # about as often as the target is sure; at T = 1 more often where it is unsure (a
    # close draft is unsure the same way); a weak draft would pass less often.
    sampling: str = "greedy"
    trees: int = 0  # the most nodes of a tree this call may draft (0: chains only)
    # The draft is behind for the rest of this call (behind_for_good): its rounds are plain
    # but for cost probes, and nothing is priced or forecast for it until the next call.
    out_for_call: bool = False

    def start_call(self, sampled: bool = False, trees: int = 0) -> None:
        """A new generate() call: a new text, whose acceptance is learnt afresh (a question
        after code must not start from the code's α, or it drafts long rounds on prose);
        `trees`: the most nodes of a tree it may draft (0: chains only)."""
        self.sampling = "sampled" if sampled else "greedy"
        self.trees = trees
        weight = LOOKUP_PRIOR_WEIGHT if self.free_drafts else PRIOR_WEIGHT
        self.acceptance = Acceptance(PRIOR_ALPHA * weight, weight, calibration=self.calibration)
        self.opening = not self.free_drafts
        self.rounds_since_probe = 0
        self.out_for_call = False

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
        # A cache that cannot be trimmed pays for each rejection by running the kept
        # tokens again (caches.rewind).
        rewind = (1 - passing[-1]) * self.costs.rewind_ratio if g > 0 else 0.0
        return tokens / (g * c + carry + verify + rewind)

    def tps(self, rate: float) -> float:
        return rate / self.costs.t1 if self.costs.t1 else 0.0

    def choose(self, remaining: int | None = None, behind: int | None = None) -> Choice:
        """γ for the next round; `remaining`: the most tokens the call may still emit;
        `behind`: the tokens the draft model must take before it drafts (the prompt, the
        first time in a call, and what it missed), where the engine knows them; else the
        plain rounds since it last drafted."""
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
            # Measure the draft's cost and T(k); where the draft's is known (a longer
            # context's first rounds), T(k) alone, with free guesses: the draft's catch-up
            # on a long prompt would cost more than the measurement learns.
            known = not self.free_drafts and self.draft_ratio is not None
            return Choice(first, cost_probe=known)
        missed = self.rounds_since_probe if behind is None else behind
        if self.out_for_call or self.behind_for_good(missed, remaining):
            # Its backlog only grows and the tokens left only shrink: it stays behind. Only
            # a cost probe (free guesses, no catch-up) can still run; the costs outlive the
            # call. Pricing it every round, between two passes, cost ~2% of a step.
            self.out_for_call = True
            self.rounds_since_probe += 1
            plain = Choice(0, predicted_tps=self.tps(1.0))
            return (self.cost_probe() if self.hopeless(1.0) else None) or plain
        rates = {g: self.rate(g) or 0.0 for g in range(self.max_gamma + 1)}
        plain = Choice(0, predicted_tps=self.tps(rates[0]))
        best = max(range(1, self.max_gamma + 1), key=rates.get)
        shape, tree_rate = self.best_tree()
        tree = shape if tree_rate > rates[best] else None
        best, best_rate = (tree.nodes, tree_rate) if tree else (best, rates[best])
        # Hysteresis: starting to draft needs the forecast to win by the margin, stopping
        # needs it to lose by as much. A draft model that stops falls behind, and bringing
        # it back costs a pass over every token it missed; going on while the forecast is
        # near even keeps learning this text's α at a small cost. Prompt lookup has nothing
        # to catch up on and learns its α only where it has a match: it drafts only where
        # its forecast wins by the margin (going on below even, a summary of a long prompt
        # kept 1-draft lookup rounds at α 0.2 that cost 1.16 T(1) each).
        hysteresis = self.drafting > 0 and not self.free_drafts
        need = 1 / MARGIN if hysteresis else MARGIN
        # This text's α, not only a guess: drafts seen, or the target's confidence in it.
        known = self.free_drafts or self.acceptance.seen
        if known and self.pays(rates[0], best_rate, need, remaining, missed):
            self.rounds_since_probe = 0
            if not self.free_drafts:
                # The draft model pays: its cost probes start afresh when it next does not.
                # Not for lookup, which shares the costs: its rounds reset the back-off of
                # a draft model as costly as the target to 32 plain rounds in every reply.
                self.costs.cost_backoff = FIRST_BACKOFF
            return Choice(best, predicted_tps=self.tps(best_rate), tree=tree)
        self.rounds_since_probe += 1
        if self.hopeless(rates[0]):
            return self.cost_probe() or plain
        # This text's α may be higher than estimated: look once the plain rounds since the
        # last look (or since the call began) can afford the look's forecast loss.
        waited = self.rounds_since_probe
        missed = waited if behind is None else behind
        g = self.probe_length(first, missed)
        if self.probe_loss(g, missed) > EXPLORE * waited:
            return plain
        self.rounds_since_probe = 0
        return Choice(g, predicted_tps=self.tps(rates[0]))

    def cost_probe(self) -> Choice | None:
        """A cost-only probe where one is due, for a round where even perfect drafts would
        lose: only the costs are in question. T(k) is measured now and then with free
        guesses, and the draft by one pass (the engine): its catch-up on the rounds it
        missed would cost more than the probe learns. The costs belong to the pair, not the
        text, so the back-off outlives the call: reset per call, a draft as costly as the
        target paid a probe and its re-timing (~3 target steps) in every reply over 32
        tokens."""
        costs = self.costs
        costs.plain_since_cost_probe += 1
        if costs.plain_since_cost_probe < costs.cost_backoff:
            return None
        costs.plain_since_cost_probe = 0
        costs.cost_backoff = min(costs.cost_backoff * 2, 1024)
        return Choice(min(COST_PROBE, self.max_gamma), cost_probe=True)

    def best_tree(self) -> tuple[Shape | None, float]:
        """(the tree with the most expected tokens per T(1), its rate) among the greedy
        trees (trees.grow_shape) of 2 to `trees` nodes, for every depth up to max_gamma:
        a deeper level costs a draft pass, a wider one only a wider verify, so the best
        shape under a budget depends on the depth allowed as well as the scores; (None, 0)
        where the call drafts chains, or no tree beats a chain of its own nodes."""
        c = self.draft_ratio
        if self.trees < 2 or c is None:
            return None, 0.0
        alphas = self.acceptance.by_position(self.max_gamma)
        later = self.acceptance.sibling_alphas(MAX_WIDTH - 1)
        # T(k)/T(1) for every k a tree here can verify or run (read once: this is priced
        # every round, on the path from one pass to the next)
        ratio = [0.0, *(self.costs.ratio(k) for k in range(1, self.trees + 2))]
        carry = c * ((ratio[2] or 2.0) - 1)
        best, best_rate, best_deep = None, 0.0, 0
        for deep in range(1, self.max_gamma + 1):
            # The best rate rises with the depth allowed, then falls (each level costs a
            # pass and adds ever smaller scores): stop after the first depth that adds
            # nothing.
            if best_deep and best_deep < deep - 1:
                break
            parents, scores = grow_shape(alphas[:deep], later, self.trees)
            depth: list[int] = []
            at = [0] * deep  # nodes at each depth
            tokens, inner = 1.0, 0.0  # 1 + every score; the scores of nodes with children
            chain, parted = True, set()
            for n, (parent, score) in enumerate(zip(parents, scores, strict=True), 1):
                depth.append(1 if parent < 0 else depth[parent] + 1)
                at[depth[-1] - 1] += 1
                tokens += score
                if parent >= 0 and parent not in parted:  # no longer a leaf
                    parted.add(parent)
                    inner += scores[parent]
                chain = chain and parent == n - 2
                verify = ratio[n + 1]
                if chain or verify is None:
                    continue
                draft = c * sum(ratio[w] or w for w in pass_widths([a for a in at if a]))
                rate = tokens / (draft + carry * (tokens - 1 - inner) + verify)
                if rate > best_rate:
                    best, best_rate, best_deep = parents[:n], rate, deep
        return (None if best is None else Shape(tuple(best))), best_rate

    def pays(
        self, plain: float, best: float, need: float, remaining: int | None, behind: int
    ) -> bool:
        """Whether drafting beats plain decoding by `need` over the rest of the call. A
        draft model first takes what it has not seen: the prompt, in a call's first
        drafting round, and what it missed while it sat out. Where a pass over many tokens
        costs several one-token passes, that can cost more than drafting the rest of a
        short reply wins back."""
        if best < need * plain:  # the margin is for the forecast's noise
            return False
        catch_up = self.catch_up(behind)  # a known cost: no margin
        return remaining is None or remaining / best + catch_up <= remaining / plain

    def behind_for_good(self, backlog: int, remaining: int | None) -> bool:
        """Whether taking `backlog` missed tokens alone would cost the draft more than
        decoding the rest of the call plain (a token a T(1)): then no proposal of any shape
        can pay (pays() says no to all), here and in every later round of the call (a draft
        that has not taken a long prompt is there for the whole reply)."""
        return remaining is not None and self.catch_up(backlog) >= remaining

    def catch_up(self, backlog: int) -> float:
        """The draft's extra cost, in T(1)s, of taking `backlog` missed tokens with its
        first pass (priced on the target's cost curve: the same shape of pass)."""
        c = self.draft_ratio or 0.0
        return c * ((self.costs.ratio(backlog + 1) or backlog + 1) - 1)

    def hopeless(self, plain_rate: float) -> bool:
        """Whether even perfect drafts would lose to plain decoding, at any γ."""
        rates = (self.rate(g, perfect=True) or 0.0 for g in range(1, self.max_gamma + 1))
        return max(rates) < plain_rate

    def probe_length(self, longest: int, behind: int | None = None) -> int:
        """The draft length that learns α most cheaply: where some length is expected to
        pay, the one that pays best; else the least loss per draft the target judges (a
        rejection ends the judging, so at low α a long probe costs more and tells little
        more: one draft where each verified token costs a good share of a pass, three on a
        flat cost curve)."""
        behind = self.rounds_since_probe if behind is None else behind
        loss = {g: self.probe_loss(g, behind) for g in range(1, longest + 1)}
        paying = [g for g, lost in loss.items() if lost <= 0]
        if paying:
            return max(paying, key=lambda g: self.rate(g) or 0.0)
        judged = self.acceptance.expected_judged
        return min(loss, key=lambda g: loss[g] / judged(g))

    def probe_loss(self, g: int, backlog: int) -> float:
        """The time a round of g drafts is expected to lose against plain decoding, in
        T(1)s, after `backlog` missed tokens the draft model must first catch up on (its
        first pass takes them too, priced on the target's cost curve). Its cost is taken
        at the margin that drafting must clear: a forecast short of it is no free look."""
        c = self.draft_ratio or 0.0
        cost = self.catch_up(backlog) + g * c + (self.costs.ratio(g + 1) or g + 1)
        return MARGIN * cost - self.acceptance.expected_tokens(g)

    def record(
        self,
        g: int,
        n: int,
        verify_s: float | None,
        draft_s: float | None,
        passes: float | None,
        tops: list[float] | None = None,
        draft_tops: list[float] | None = None,
        rewind_s: float = 0.0,
    ) -> None:
        """A finished round: g drafts, n accepted; draft_s None for a cost-only probe;
        passes: one-token draft passes that draft_s stands for (None: not a clean figure);
        tops, draft_tops: the target's and the draft's top probability at each draft the
        target judged (min(n + 1, g) of them); verify_s None: a pass shared with other
        sequences (specmlx.batch), no figure of this one's T(g + 1)."""
        if verify_s is not None:
            self.costs.observe_target(g + 1, verify_s)
        if rewind_s:
            self.costs.observe_rewind(rewind_s)
        self.drafting = self.drafting + 1 if g > 0 else 0
        if g > 0 and draft_s is not None:
            if tops and not self.free_drafts:
                self.calibrate(tops, n)
            if draft_tops and not self.free_drafts:
                self.calibrate(draft_tops, n, DRAFT)
            self.acceptance.observe(g, n)
            if not self.free_drafts and passes:
                self.costs.observe_draft(draft_s / passes)

    def record_tree(self, g: int, verify_s: float | None, walk: list[tuple[int, int]]) -> None:
        """A finished tree round of g nodes: its verify is a pass over g + 1 tokens like a
        chain's; what it teaches of acceptance is its walk (tree.walk). Its draft time is
        no figure of a one-token pass (its levels run several nodes each)."""
        if verify_s is not None:
            self.costs.observe_target(g + 1, verify_s)
        self.drafting += 1
        self.acceptance.observe_tree(walk)

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
        where drafts that do not pass would cost more than the plain steps they replace."""
        i = len(draft_tops)
        chance = prod(self.forecast(top, DRAFT) for top in draft_tops)
        alpha = self.acceptance.by_position(i + 1)[i]
        verify = (self.costs.ratio(i + 2) or i + 2) - (self.costs.ratio(i + 1) or i + 1)
        # Plain decoding yields one token per T(1), the unit of every cost here.
        return chance * alpha >= (self.draft_ratio or 0.0) + verify

    def observe_confidence(self, top: float) -> None:
        """A plain step's top target probability: a forecast of this text's α."""
        self.acceptance.observe_confidence(top)
