"""Choosing the draft length γ each round so that speculation never loses.

A round with γ drafts costs γ·t_draft + T(γ+1) (T(k): one target pass over k new
tokens) and yields E[N] = 1 + Σ_{j≤γ} Π_{i≤j} α_i tokens, α_i being the chance that
draft position i is accepted once positions before it were. γ = 0 is plain decoding:
one token per T(1). Each round picks the γ with the most expected tokens per second,
from costs measured on real rounds (cached per model pair and backend, refined online)
and acceptance estimated per position with exponential decay.

When γ = 0 wins, speculation is re-tried now and then (exponential back-off) so a
change — longer context, another backend, an easier passage — is noticed. When even
perfect acceptance could not beat plain decoding (compute-bound verify: T(k) ≈ k·T(1),
as with MLX's INT4 CPU kernels), re-tries are rare, since each costs real time.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

DECAY = 0.9  # weight kept by old observations per new one: adapts within ~10 rounds
PRIOR_ALPHA = 0.6  # acceptance assumed at a position never tried, weighted as PRIOR_WEIGHT
PRIOR_WEIGHT = 2.0
FIRST_PROBE = 4  # draft length of the first measuring round
COST_PROBE = 2  # draft length of a probe that re-measures the verify cost curve only
# Speculate only when the forecast beats plain decoding by this much: timings on a busy
# machine are noisy, and a marginal forecast that is wrong costs more than it can gain.
MARGIN = 1.05


def _ema(old: float | None, new: float) -> float:
    return new if old is None else DECAY * old + (1 - DECAY) * new


@dataclass
class Costs:
    """Measured seconds: a target pass per number of new tokens; a draft-model pass."""

    target: dict[int, float] = field(default_factory=dict)
    draft_per_pass: float | None = None
    # What this process has measured itself; figures loaded from the cache are only a
    # starting point, replaced (not blended) by the first fresh measurement.
    fresh: set = field(default_factory=set, compare=False, repr=False)

    def observe_target(self, k: int, seconds: float) -> None:
        old = self.target.get(k) if k in self.fresh else None
        self.target[k] = _ema(old, seconds)
        self.fresh.add(k)

    def observe_draft(self, seconds_per_pass: float) -> None:
        old = self.draft_per_pass if "draft" in self.fresh else None
        self.draft_per_pass = _ema(old, seconds_per_pass)
        self.fresh.add("draft")

    def target_time(self, k: int) -> float | None:
        """T(k): measured if seen, else the least-squares line through what was seen."""
        if k in self.target:
            return self.target[k]
        if len(self.target) < 2:
            return None
        ks, ts = zip(*sorted(self.target.items()), strict=True)
        mean_k, mean_t = sum(ks) / len(ks), sum(ts) / len(ts)
        var = sum((x - mean_k) ** 2 for x in ks)
        slope = sum((x - mean_k) * (y - mean_t) for x, y in zip(ks, ts, strict=True)) / var
        return max(mean_t + slope * (k - mean_k), min(ts))

    def to_json(self, acceptance: Acceptance | None = None) -> dict:
        out = {"target": {str(k): v for k, v in self.target.items()}, "draft": self.draft_per_pass}
        if acceptance is not None and acceptance.reached:
            out["acceptance"] = {"accepted": acceptance.accepted, "reached": acceptance.reached}
        return out

    @classmethod
    def from_json(cls, data: dict) -> Costs:
        target = {int(k): float(v) for k, v in data.get("target", {}).items()}
        return cls(target, data.get("draft"))


def acceptance_from_json(data: dict) -> Acceptance | None:
    """The draft model's per-position acceptance saved with its costs, if any."""
    saved = data.get("acceptance")
    if not saved:
        return None
    return Acceptance([float(x) for x in saved["accepted"]], [float(x) for x in saved["reached"]])


@dataclass
class Acceptance:
    """Per-position acceptance α_i with exponentially decayed counts."""

    accepted: list[float] = field(default_factory=list)
    reached: list[float] = field(default_factory=list)

    def observe(self, g: int, n: int) -> None:
        while len(self.reached) < g:
            self.accepted.append(0.0)
            self.reached.append(0.0)
        for i in range(min(n + 1, g)):  # positions 1..n were accepted, n+1 was rejected
            self.reached[i] = DECAY * self.reached[i] + 1
            self.accepted[i] = DECAY * self.accepted[i] + (i < n)

    def alpha(self, i: int) -> float:
        """α at 0-based draft position i; unseen positions borrow the last seen one."""
        if i >= len(self.reached):
            prior = self.alpha(len(self.reached) - 1) if self.reached else PRIOR_ALPHA
            return prior
        return (self.accepted[i] + PRIOR_ALPHA * PRIOR_WEIGHT) / (self.reached[i] + PRIOR_WEIGHT)

    def expected_tokens(self, g: int) -> float:
        total, run = 1.0, 1.0
        for i in range(g):
            run *= self.alpha(i)
            total += run
        return total


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

    `draft_cost` is None for a draft model until measured, 0.0 for free drafts
    (prompt lookup), whose cost is negligible next to any forward pass.
    """

    costs: Costs
    max_gamma: int = 8
    free_drafts: bool = False
    acceptance: Acceptance = field(default_factory=Acceptance)
    rounds_since_probe: int = 0
    backoff: int = 16
    # With nothing cached about this draft's acceptance, draft with the model once
    # before trusting cached costs (another load on the machine makes them stale).
    draft_measured: bool = False

    @property
    def draft_cost(self) -> float | None:
        return 0.0 if self.free_drafts else self.costs.draft_per_pass

    def rate(self, g: int, perfect: bool = False) -> float | None:
        """Expected tokens per second with γ = g (perfect: as if every draft were accepted)."""
        verify = self.costs.target_time(g + 1)
        if verify is None or (g > 0 and self.draft_cost is None):
            return None
        tokens = g + 1 if perfect else self.acceptance.expected_tokens(g)
        return tokens / (g * (self.draft_cost or 0.0) + verify)

    def choose(self) -> Choice:
        if 1 not in self.costs.target:
            return Choice(0)  # a plain step measures T(1) and still emits a token
        if self.draft_cost is None or len(self.costs.target) < 2:
            return Choice(min(FIRST_PROBE, self.max_gamma))
        if not self.free_drafts and not self.draft_measured:
            return Choice(min(FIRST_PROBE, self.max_gamma))
        rates = {g: self.rate(g) or 0.0 for g in range(self.max_gamma + 1)}
        best = max(rates, key=rates.get)
        if best > 0 and rates[best] >= MARGIN * rates[0]:
            self.rounds_since_probe = 0
            self.backoff = 16
            return Choice(best, predicted_tps=rates[best])
        self.rounds_since_probe += 1
        if self.rounds_since_probe < self.backoff:
            return Choice(0, predicted_tps=rates[0])
        # Re-try speculation at the length that would pay most if every draft were good.
        self.rounds_since_probe = 0
        optimistic = {g: self.rate(g, perfect=True) or 0.0 for g in range(1, self.max_gamma + 1)}
        probe = max(optimistic, key=optimistic.get)
        hopeless = optimistic[probe] < rates[0]  # verify cost alone rules speculation out
        self.backoff = min(self.backoff * 2, 1024)
        if hopeless and not self.free_drafts:
            # Only the slope of T(k) is in question: a short probe measures it for less.
            return Choice(min(COST_PROBE, self.max_gamma), cost_probe=True, predicted_tps=rates[0])
        return Choice(probe, predicted_tps=rates[0])

    def record(
        self, g: int, n: int, verify_s: float, draft_s: float | None, passes: int | None
    ) -> None:
        """A finished round: g drafts, n accepted; draft_s None for a cost-only probe;
        passes: the draft's forward passes that draft_s paid for (None: not a clean figure)."""
        self.costs.observe_target(g + 1, verify_s)
        if g > 0 and draft_s is not None:
            self.acceptance.observe(g, n)
            self.draft_measured = True
            if not self.free_drafts and passes:
                self.costs.observe_draft(draft_s / passes)


def cost_cache_path() -> Path:
    from .models import home

    return home() / "costs.json"


def load_costs(key: str) -> tuple[Costs, Acceptance | None]:
    try:
        data = json.loads(cost_cache_path().read_text())[key]
        return Costs.from_json(data), acceptance_from_json(data)
    except (OSError, KeyError, ValueError, TypeError):
        return Costs(), None


def save_costs(key: str, costs: Costs, acceptance: Acceptance | None = None) -> None:
    """Merge this pair's costs into the cache file atomically (temp file + rename)."""
    path = cost_cache_path()
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        data = {}
    data[key] = costs.to_json(acceptance)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".costs-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only means the next run measures again
