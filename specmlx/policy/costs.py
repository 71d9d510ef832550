"""Pass costs as ratios to T(1), measured as the engine runs, and kept across runs.

On a shared machine load moves every pass's time together, and one pass can be slow for
reasons of its own (a burst of load, the first call at a new shape), so each multi-token
target pass and each draft pass is recorded as its ratio to the T(1) of the moment, and a
figure is the median of its recent ratios: one outlier cannot lock a draft length out.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from statistics import median

from ..paths import home
from .acceptance import BANDS

WINDOW = 16  # recent ratios kept per figure
# Clean draft passes timed before the draft's cost is priced: with one, a pass timed in a
# burst of load (nearly twice its usual ratio) priced drafting out for a whole bench run,
# whose cost probes never time the draft again.
DRAFT_FIGURES = 3
# Plain steps (after the process's first) that T(1) needs before any ratio is taken to
# it: every cost is relative to T(1), so one noisy step would skew them all for a call.
SETTLE = 3
# The cost cache's format. 2: draft figures no longer include the draft model's first
# one-token pass in a process (one-time work, 4x a pass); a cache written before may hold
# such a figure, which kept auto from ever drafting, so it is measured afresh. 3: the
# calibration is kept per band of top probability. 4: which k's figures are a kin's is
# kept (Costs.borrowed); a format-3 entry's figures count as borrowed, since a kin's
# were not told apart there.
COSTS_FORMAT = 4
# The pair's own figures at a k that retire a kin's there: until then its price there is
# at most the line through its own figures, so that a kin's dear figure is measured again
# (an AVX2 machine's dear T(9) borrowed on an AVX-512 one kept lookup short for good).
OWN_FIGURES = 3
FIRST_BACKOFF = 32  # plain rounds before the first cost-only probe; doubles after each
# Costs are kept per band of context length (tokens in the cache): a pass over k new
# tokens after L cached ones costs more as L grows, and by more for larger k where
# attention's share grows with L, so a curve measured at short context prices drafting
# too cheaply at long context. Bands double from SHORT_CONTEXT tokens on.
SHORT_CONTEXT = 1024
CONTEXT_BANDS = 5  # the last band takes every longer context: 16k tokens and on


def context_band(tokens: int) -> int:
    """0 below SHORT_CONTEXT tokens of context, then one band per doubling."""
    band, edge = 0, SHORT_CONTEXT
    while tokens >= edge and band < CONTEXT_BANDS - 1:
        band, edge = band + 1, edge * 2
    return band


def band_start(band: int) -> int:
    """The fewest tokens of context in `band`."""
    return 0 if band == 0 else SHORT_CONTEXT << (band - 1)


def _push(samples: list[float], value: float) -> None:
    samples.append(value)
    del samples[:-WINDOW]


@dataclass
class Costs:
    """Pass costs as ratios to T(1): a target pass over k new tokens, a draft pass; and
    how far the target's confidence forecasts this pair's acceptance (`calibration`).

    T(1) itself is the median of this process's recent plain steps but its first, which
    pays one-time work (weights read or expanded on first use, compiles), several times a
    later step. A T(1) from the cache (another run) only stands in until then.
    """

    plain: list[float] = field(default_factory=list)  # this process's plain steps, seconds
    target: dict[int, list[float]] = field(default_factory=dict)  # k ≥ 2 -> T(k)/T(1) seen
    draft: list[float] = field(default_factory=list)  # draft pass / T(1) seen
    cached_t1: float | None = None
    # How a top probability maps to acceptance for this pair, per sampling ("greedy" or
    # "sampled") and whose top it is (the target's at a plain step or in the verify; the
    # draft's, " draft" appended), per band of BANDS: [drafts accepted, their top
    # probabilities summed], decayed. Kept with the costs, across calls and runs: a call
    # that starts from no evidence rarely drafts at T = 1 and so never learns it (with a
    # Session per call, auto fell well short of a fixed γ on sampled code).
    calibration: dict[str, list[list[float]]] = field(default_factory=dict)
    rewind: list[float] = field(default_factory=list)  # a rewound rejection / T(1) seen
    # Cost-only probes where drafting is hopeless: plain rounds since the last, and how
    # many to wait for the next (doubling; see choice.Scheduler.choose). Kept with the
    # costs, across calls and runs.
    plain_since_cost_probe: int = 0
    cost_backoff: int = FIRST_BACKOFF
    # k -> the pair's own figures at k since its figures there were a kin's (load_costs).
    borrowed: dict[int, int] = field(default_factory=dict)

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
            seen = self.target.setdefault(k, [])
            _push(seen, seconds / self.t1)
            if k in self.borrowed:
                self.borrowed[k] += 1
                if self.borrowed[k] == OWN_FIGURES:
                    del seen[:-OWN_FIGURES], self.borrowed[k]

    def observe_draft(self, seconds_per_pass: float) -> None:
        self._changed()
        if self.settled:
            _push(self.draft, seconds_per_pass / self.t1)

    def observe_rewind(self, seconds: float) -> None:
        """A round whose rejected drafts had to be rewound by running the kept tokens
        again (a sliding window, a recurrent state: see caches.rewind)."""
        self._changed()
        if self.settled:
            _push(self.rewind, seconds / self.t1)

    @property
    def rewind_ratio(self) -> float:
        """What a rejection costs besides the round, in T(1)s: 0 for caches that trim."""
        return median(self.rewind) if self.rewind else 0.0

    def _changed(self) -> None:
        """Forget the figures read from the samples. Each choice reads them dozens of
        times (medians over the windows, every plain round), and they
        change only here: the samples are to be changed through observe_* alone."""
        for name in ("t1", "slope", "own_slope", "draft_ratio", "_ratios"):
            self.__dict__.pop(name, None)

    def _slope(self, own: bool) -> float | None:
        """The extra cost of each new token beyond the first, as a fraction of T(1): the
        median over the multi-token passes seen (a Theil–Sen line through T(1) = 1), over
        the pair's own figures alone or over a kin's too."""
        slopes = [
            (r - 1) / (k - 1)
            for k, seen in self.target.items()
            if not (own and k in self.borrowed)
            for r in seen
        ]
        return max(median(slopes), 0.0) if slopes else None

    @cached_property
    def own_slope(self) -> float | None:
        return self._slope(own=True)

    @cached_property
    def slope(self) -> float | None:
        """The line's slope: through the pair's own figures where it has any."""
        return self.own_slope if self.own_slope is not None else self._slope(own=False)

    def ratio(self, k: int) -> float | None:
        """T(k)/T(1): the median seen at k once there are a few, else on the line; where
        they are a kin's, at most the line through the pair's own (OWN_FIGURES)."""
        ratios = self._ratios
        if k not in ratios:
            seen = self.target.get(k, [])
            line = None if self.slope is None else 1 + self.slope * (k - 1)
            if k == 1:
                ratios[k] = 1.0
            elif len(seen) < 3:
                ratios[k] = line
            elif k in self.borrowed and self.own_slope is not None:
                ratios[k] = min(median(seen), line)
            else:
                ratios[k] = median(seen)
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
            "rewind": self.rewind,
            "cost_probes": [self.plain_since_cost_probe, self.cost_backoff],
            "borrowed": {str(k): n for k, n in self.borrowed.items()},
            "saved": time.time(),  # which kin entry is the newest (see load_costs)
        }

    @classmethod
    def from_json(cls, data: dict) -> Costs:
        if data.get("format") not in (3, COSTS_FORMAT):
            raise ValueError(f"cost cache format {data.get('format')}, not {COSTS_FORMAT}")
        target = {int(k): [float(r) for r in v] for k, v in data["target"].items()}
        borrowed = {int(k): int(n) for k, n in data.get("borrowed", {}).items()}
        if data["format"] == 3:
            borrowed = dict.fromkeys(target, 0)
        plain = data.get("plain") or {}
        ours = plain.get("pid") == os.getpid()  # another process's steps are not its T(1)
        mine = [float(t) for t in plain.get("seconds", [])] if ours else []
        calibration = {
            kind: [[float(accepted), float(tops)] for accepted, tops in bands]
            for kind, bands in data.get("calibration", {}).items()
            if len(bands) == len(BANDS) + 1
        }
        draft = [float(r) for r in data["draft"]]
        rewind = [float(r) for r in data.get("rewind", [])]
        since, backoff = (int(x) for x in data.get("cost_probes", [0, FIRST_BACKOFF]))
        t1 = float(data["t1"])
        return cls(mine, target, draft, t1, calibration, rewind, since, backoff, borrowed)


def cost_cache_path() -> Path:
    return home() / "costs.json"


def load_costs(key: str, kins: tuple[str, ...] = ()) -> Costs:
    """This pair's cached costs; when it has none, what the last run of its nearest kin
    measured, as a start: `kins` are what kin keys start with, nearest first (the same
    kernels in another build, then the same models on other kernels: AVX2's curve is no
    guess for AVX-512's); else nothing. An entry in an old format counts as none."""
    try:
        data = json.loads(cost_cache_path().read_text())
    except (OSError, ValueError):
        return Costs()
    if not isinstance(data, dict):
        return Costs()
    try:
        return Costs.from_json(data[key])
    except (KeyError, ValueError, TypeError, AttributeError):
        pass
    for kin in kins:
        entries = [v for k, v in data.items() if k.startswith(kin) and isinstance(v, dict)]
        for entry in sorted(entries, key=lambda v: v.get("saved", 0), reverse=True):
            try:
                return borrowed(Costs.from_json(entry))
            except (KeyError, ValueError, TypeError, AttributeError):
                continue
    return Costs()


def borrowed(kin: Costs) -> Costs:
    """A kin pair's costs as a start: its last few figures of each (enough to price a
    choice without the first call's probes: a new kernel or head made every first run
    lose ~8% to them), each k's retired by the pair's own (OWN_FIGURES). Not its T(1) or
    cost-probe back-off: those are this pair's alone."""

    def last(samples: list[float]) -> list[float]:
        return samples[-DRAFT_FIGURES:]

    target = {k: last(v) for k, v in kin.target.items()}
    costs = Costs([], target, last(kin.draft), None, kin.calibration, last(kin.rewind))
    costs.borrowed = dict.fromkeys(target, 0)
    return costs


def from_shorter(shorter: Costs) -> Costs:
    """A longer context's first costs, from a shorter one's: what does not grow with the
    context (the draft's cost per target pass, how confidence forecasts acceptance, a
    rewind's cost), never its T(k) ratios, which do: the longer context measures its own
    curve (choice.Scheduler.choose probes it with free guesses) before anything drafts on
    it."""
    return Costs([], {}, list(shorter.draft), None, shorter.calibration, list(shorter.rewind))


def save_costs(key: str, costs: Costs, replacing: str = "") -> None:
    """Merge this pair's costs into the cache file atomically (temp file + rename); with
    `replacing`, drop the other entries whose keys start with it (an older build of the
    same kernels), so that the file does not grow by an entry a rebuild."""
    path = cost_cache_path()
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        data = {}
    if not isinstance(data, dict):
        data = {}
    if replacing:
        data = {k: v for k, v in data.items() if not k.startswith(replacing)}
    data[key] = costs.to_json()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".costs-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only means the next run measures again
