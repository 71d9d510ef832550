"""Which parts of auto γ pay: the policy replayed with each part turned off in turn.

Each part of specmlx.policy was added for a case one bench run showed. This script asks
of every part at once whether it still earns its place: the engine's own AutoGamma is
replayed by bench/schedule_sim.py (recorded replies of the offline pair, greedy and at
T = 1, and synthetic texts) on two cost curves, with every pass's time noisy and, in the
"bursts" columns, other work starting and stopping on the machine. A part whose removal
costs nothing anywhere is a candidate for deletion; one whose removal loses somewhere is
kept for that case.

    python bench/policy_ablation.py                    # every part, every scenario
    python bench/policy_ablation.py --calls 120 --only no-stop --json out.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from specmlx.policy import acceptance, choice
from specmlx.policy.choice import Scheduler

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("schedule_sim", HERE / "schedule_sim.py")
sim = importlib.util.module_from_spec(_spec)
sys.modules["schedule_sim"] = sim
_spec.loader.exec_module(sim)

TRACES = HERE / "results" / "confidence-traces-s1.json"
# A draft as costly as the target that is always right (an exact copy of the model): the
# never-lose case, where every round with drafts loses and only probing costs anything.
SELF = dict(c=1.0, slope=sim.PROFILES["int4"]["slope"])
COPY = sim.Text(48, 1.0, opening_alpha=1.0)
LONG_CODE = sim.Text(256, 0.96, max_tokens=256)


def misread(s: Scheduler) -> None:
    """The draft's first three passes timed in a burst of load, as one bench run met
    (0.93 of T(1) where it is 0.48, bench/results/README.md): twice its cost, enough to
    price drafting out as hopeless, kept with the costs."""
    s.costs.draft = [2 * sim.PROFILES["int4"]["c"]] * 3


def _off_opening(s: Scheduler) -> None:
    start = s.start_call

    def start_call(sampled: bool = False) -> None:
        start(sampled)
        s.opening = False

    s.start_call = start_call


def _off_catch_up(s: Scheduler) -> None:
    pays = s.pays
    s.pays = lambda plain, best, need, remaining, behind: pays(plain, best, need, None, behind)


def _off_cost_probes(s: Scheduler) -> None:
    s.costs.cost_backoff = 10**9


# Each part: what turns it off (a Scheduler edit, and module constants for the run).
PARTS: dict[str, tuple[Callable[[Scheduler], None] | None, dict]] = {
    "full": (None, {}),
    "no-stop": (None, {}),  # the run's stop=False: rounds run their whole γ
    "no-forecast": (lambda s: setattr(s, "observe_confidence", lambda top: None), {}),
    "no-calibration": (lambda s: setattr(s, "calibrate", lambda *a, **k: None), {}),
    "no-opening": (_off_opening, {}),
    "no-margin": (None, {(choice, "MARGIN"): 1.0}),
    "no-explore": (None, {(choice, "EXPLORE"): 0.0}),
    "no-cost-probes": (_off_cost_probes, {(choice, "FIRST_BACKOFF"): 10**9}),
    "no-catch-up": (_off_catch_up, {}),
    "no-positions": (None, {(acceptance, "POSITION_PRIOR"): 1e9}),
}


@contextmanager
def constants(values: dict) -> Iterator[None]:
    saved = {(m, name): getattr(m, name) for m, name in values}
    for (m, name), v in values.items():
        setattr(m, name, v)
    try:
        yield
    finally:
        for (m, name), v in saved.items():
            setattr(m, name, v)


def scenarios() -> dict[str, tuple[dict, list, float]]:
    """name -> (cost profile, texts as (kind, text), load-burst chance per pass)."""
    greedy = [(t.category, t) for t in sim.Trace.read(TRACES, 0.0)]
    sampled = [(t.category, t) for t in sim.Trace.read(TRACES, 1.0)]
    synthetic = [(kind, sim.TEXTS[kind]) for kind in sim.TEXTS]
    out = {}
    for profile in ("int4", "fp32"):
        p = sim.PROFILES[profile]
        out[f"{profile} greedy"] = (p, greedy, 0.0)
        out[f"{profile} T=1"] = (p, sampled, 0.0)
        out[f"{profile} synthetic"] = (p, synthetic, 0.0)
        out[f"{profile} greedy bursts"] = (p, greedy, 0.01)
    out["int4 T=1 bursts"] = (sim.PROFILES["int4"], sampled, 0.01)
    # A weaker draft than the target's confidence promises: it agrees half as often as
    # the recorded 0.5B did, its own confidence unchanged (overconfident).
    weak = [(kind, replace(t, accept=[a / 2 for a in t.accept])) for kind, t in greedy]
    out["int4 weak draft"] = (sim.PROFILES["int4"], weak, 0.0)
    out["fp32 weak draft"] = (sim.PROFILES["fp32"], weak, 0.0)
    # Replies long enough for drafting streaks of dozens of rounds.
    out["int4 long code bursts"] = (sim.PROFILES["int4"], [("code", LONG_CODE)], 0.01)
    out["int4 misread draft"] = (sim.PROFILES["int4"], greedy, 0.0)  # see misread
    out["self-draft"] = (SELF, [("copy", COPY)], 0.0)
    out["self-draft bursts"] = (SELF, [("copy", COPY)], 0.01)
    return out


def speedup(
    profile: dict, texts: list, bursts: float, part: str, calls: int, seed: int, misread_draft: bool
) -> dict:
    """auto's decode time against plain decoding's on the same texts: the ratio of
    their summed times, overall and per kind of text."""
    tweak, values = PARTS[part]
    if misread_draft:
        tweak = (lambda s, t=tweak: (misread(s), t and t(s))) if tweak else misread
    times: dict[str, dict] = {}
    with constants(values):
        for gamma in (0, "auto"):
            rng, state = sim.random.Random(seed), {}
            for i in range(calls):
                kind, text = texts[i % len(texts)]
                t = sim.run_call(
                    profile, text, gamma, state, rng, 0.1, part != "no-stop", tweak, bursts
                )
                times.setdefault(kind, {}).setdefault(gamma, []).append(t)
    per_kind = {k: sum(by[0]) / sum(by["auto"]) for k, by in times.items()}
    plain = sum(sum(by[0]) for by in times.values())
    auto = sum(sum(by["auto"]) for by in times.values())
    return {"all": plain / auto, "worst kind": min(per_kind.values()), "kinds": per_kind}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=240)
    ap.add_argument("--seeds", type=int, default=2, help="each scenario replayed with seeds 0..N-1")
    ap.add_argument("--only", action="append", choices=sorted(PARTS), help="default: every part")
    ap.add_argument("--json", type=Path, help="write every figure here")
    args = ap.parse_args()
    parts = ["full", *[p for p in (args.only or PARTS) if p != "full"]]
    results: dict = {}
    for name, (profile, texts, bursts) in scenarios().items():
        for part in parts:
            runs = [
                speedup(profile, texts, bursts, part, args.calls, seed, "misread" in name)
                for seed in range(args.seeds)
            ]
            results.setdefault(part, {})[name] = {
                "all": sum(r["all"] for r in runs) / len(runs),
                "worst kind": min(r["worst kind"] for r in runs),
                "kinds": [r["kinds"] for r in runs],
            }
            print(f"{name:22} {part:15} {results[part][name]['all']:.3f}", file=sys.stderr)
    names = list(scenarios())
    print("auto's speedup over plain decoding (all calls; worst kind of text in brackets)\n")
    print("| part off | " + " | ".join(names) + " |")
    print("| --- |" + " --- |" * len(names))
    for part in parts:
        cells = [
            f"{results[part][n]['all']:.3f} ({results[part][n]['worst kind']:.2f})" for n in names
        ]
        print(f"| {part} | " + " | ".join(cells) + " |")
    if args.json:
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps({"calls": args.calls, "seeds": args.seeds, **results}, indent=1))
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
