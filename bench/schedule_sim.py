"""Replay the γ policy (specmlx.policy.AutoGamma, the engine's own) on synthetic texts.

A bench run on this CPU takes minutes per prompt and varies ±15% between identical runs,
so it cannot tell a 3% policy change from noise. This script can: it runs the scheduler
against a cost curve and an acceptance process, thousands of calls, and reports each
policy's tokens per unit of time against plain decoding. The policy is the engine's own
(policy.AutoGamma and its Scheduler, shown each round what the engine shows it); what is
simulated is what passes cost and whether drafts agree, not measured; the
costs it starts from are the ones measured on this machine (bench/results/README.md).

    python bench/schedule_sim.py                       # every profile and text kind
    python bench/schedule_sim.py --profile int4 --calls 400
    python bench/schedule_sim.py --traces TRACES.json  # recorded replies instead
    python bench/schedule_sim.py --traces bench/results/confidence-traces-s1.json --temperature 1
"""

from __future__ import annotations

import argparse
import json
import math
import random
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

import mlx.core as mx

from specmlx.drafters import CostProbe, Proposal
from specmlx.policy import AutoGamma, Costs, FixedGamma, Round
from specmlx.policy.choice import Scheduler

# Costs as ratios to one plain target step T(1): draft pass c, T(k)/T(1) = 1 + slope·(k-1).
PROFILES = {
    "int4": dict(c=0.5, slope=0.26),  # native INT4 kernel, Qwen2.5-Coder 1.5B / 0.5B
    "fp32": dict(c=0.35, slope=0.05),  # --cpu-weights fp32 on OpenBLAS, same pair
}


@dataclass
class Text:
    """A reply: its length, its acceptance, and its opening: the first token of a chat
    reply, where draft and target almost never agree. Prose runs in stretches the draft
    gets right and stretches it does not (α ± swing, switching with `switch` per token),
    as the recorded agreement does (bench/results/opening_agreement.md).

    The target's top probability at each position (what plain rounds show the policy)
    is the chance of agreement there, off in log-odds by a bias drawn per reply and noise
    per token: measured, per reply the mean top probability fell 0.05 below the
    agreement, ±0.1, and near certainty it reads 0.99 where drafts always pass
    (bench/results/confidence_agreement.md)."""

    tokens: int
    alpha: float
    swing: float = 0.0
    switch: float = 0.2
    opening: int = 1
    opening_alpha: float = 7 / 52  # bench/results/opening_agreement.md
    # The call's max_tokens, as in the bench's -n 48: a call knows this bound, not where
    # its reply will end (an 8-token reply looks like a 48-token one to the policy).
    max_tokens: int = 48
    sampled: bool = False

    def agreement(self, rng: random.Random) -> tuple[list[bool], list[float], list[float]]:
        """Whether a draft at each position would be accepted, and the target's and the
        draft's top probability there (greedy: the text decides, not the policy, so every
        policy is replayed on the same draws). The draft's top is read as the target's,
        with noise of its own."""
        easy, agree, top, draft_top = rng.random() < 0.5, [], [], []
        bias = rng.gauss(-0.2, 0.4)

        def confidence(a: float) -> float:  # a noisy read of the chance of agreement
            return 1 / (1 + math.exp(-(logit(a) + bias + rng.gauss(0, 0.5))))

        for position in range(self.tokens + 16):
            if self.swing and rng.random() < self.switch:
                easy = not easy
            a = self.alpha + (self.swing if easy else -self.swing)
            a = self.opening_alpha if position < self.opening else a
            agree.append(rng.random() < a)
            top.append(confidence(a))
            draft_top.append(confidence(a))
        return agree, top, draft_top


@dataclass
class Trace:
    """A recorded reply (`bench/confidence_agreement.py --traces`): at each position the
    target's top probability and the chance that a draft passes there (agreement, 0 or
    1, for a greedy reply; Σ min(p, q) for one sampled at T = 1). The trace leaves out
    the reply's first token, so an opening is drawn in front of it as for a Text. Both
    texts are the target's own: speculation emits the same distribution, so a policy
    replayed on them meets what it would meet live."""

    category: str
    tokens: int
    max_tokens: int
    top: list[float]
    accept: list[float]
    draft_top: list[float]
    sampled: bool

    def agreement(self, rng: random.Random) -> tuple[list[bool], list[float], list[float]]:
        agree = [rng.random() < Text.opening_alpha] + [rng.random() < a for a in self.accept]
        pad = [0.0] * (self.tokens + 16 - len(agree))
        return [*agree, *map(bool, pad)], [0.0, *self.top, *pad], [0.0, *self.draft_top, *pad]

    @classmethod
    def read(cls, path: Path, temperature: float | None = None) -> list[Trace]:
        traces = []
        for t in json.loads(path.read_text()):
            if temperature is not None and t["temperature"] != temperature:
                continue
            accept = t["agree"] if t["temperature"] == 0 else t["overlap"]
            fields = t["category"], len(accept) + 1, t["max_tokens"], t["top"], accept
            traces.append(cls(*fields, t["draft_top"], t["temperature"] > 0))
        return traces


TEXTS = {
    "code": Text(48, 0.96),
    "prose": Text(48, 0.6, swing=0.3),
    "short": Text(8, 0.5, swing=0.3),  # translation: replies of 7-10 tokens
}


def logit(p: float) -> float:
    p = min(max(p, 1e-3), 1 - 1e-3)
    return math.log(p / (1 - p))


def ratio(profile: dict, k: int) -> float:
    return 1 + profile["slope"] * (k - 1)


def sure(*tops: float) -> mx.array:
    """Logits over two tokens whose softmax puts `top` on the first, one row per top: how
    the policy's readers (verify.top_probabilities) see a distribution this sure."""
    rows = [[math.log(max(t, 1e-9)), math.log(max(1 - t, 1e-9))] for t in tops]
    return mx.array(rows, mx.float32)


class SimDraft:
    """The draft model as the engine's policy meets it (the Drafter protocol): each pass
    costs `c` T(1)s, its first pass of a proposal also takes what it missed (priced on the
    target's curve), and its confidence at each draft is the text's `draft_top`."""

    name = "model"

    def __init__(self, profile: dict, text_tops: list[float], jitter):
        self.profile, self.draft_top, self.jitter = profile, text_tops, jitter
        self.position = 0  # where the text is
        self.missed = 0  # tokens the text gained while the draft sat out
        self.proposals = 0
        self.seconds = 0.0  # what the last proposal cost

    def start(self, context: list[int]) -> None:
        pass  # the prompt is fed as prefill: not decode time

    @property
    def behind(self) -> int:
        return self.missed

    def propose(self, g: int, key, draw, go_on=None) -> Proposal:
        made = 0
        while made < g:
            made += 1
            top = self.draft_top[self.position + made - 1]
            if go_on is not None and not go_on(sure(top), None):
                break
        fed, first = self.missed, self.proposals == 0
        self.proposals += 1
        c = self.profile["c"]
        self.seconds = self.jitter(c * (made - 1 + ratio(self.profile, fed + 1)))
        return Proposal(mx.zeros((made,), mx.uint32), None, fed, first)

    def commit(self, proposal: Proposal | None, accepted: int, emitted: list[int]) -> int:
        self.position += len(emitted)
        if proposal is None:
            self.missed += len(emitted)
        else:  # after a fully accepted round its last draft rides with the next pass
            self.missed = 1 if accepted == proposal.tokens.shape[0] else 0
        return 0

    def time_pass(self) -> float:
        """As ModelDrafter.time_pass: the best of two one-token passes."""
        passes = [self.jitter(self.profile["c"]) for _ in range(2)]
        self.seconds += sum(passes)
        return min(passes)


def run_call(
    profile: dict,
    text: Text | Trace,
    gamma,
    state: dict,
    rng: random.Random,
    noise: float,
    stop: bool = True,
    tweak=None,
    bursts: float = 0.0,
) -> float:
    """One generate() call; returns its decode time in T(1)s. `state` carries what a
    Session leaves behind between calls (the cached costs). The γ policy is the engine's
    own (policy.AutoGamma or FixedGamma, the real classes) shown each round as the engine
    shows it; only the passes' costs and the draft's agreement are simulated. `stop`:
    auto's rounds end early where the draft turns unsure (Scheduler.keep_drafting).
    `tweak(scheduler)` edits auto's Scheduler once, when the process's first call makes it
    (bench/policy_ablation.py turns parts of the policy off so). `bursts`: how often, per
    T(1) of time, other work on the machine starts or stops; while it runs every pass
    takes 1.6 times as long (a shared machine: load moves all costs together). The
    bursts fall at the same times whatever the policy, so policies meet the same load."""
    agree, top, draft_top = text.agreement(rng)
    timing = random.Random(rng.random())  # the policy's own draws leave the texts alone
    clock = state.setdefault("clock", [0.0])  # time since the process's first call

    def load() -> float:
        if not bursts:
            return 1.0
        toggles = state.setdefault("toggles", [])
        schedule = state.setdefault("schedule", random.Random(1234))
        while not toggles or toggles[-1] < clock[0]:
            toggles.append((toggles[-1] if toggles else 0.0) + schedule.expovariate(bursts))
        return 1.6 if bisect_left(toggles, clock[0]) % 2 else 1.0

    def jitter(x: float) -> float:
        return x * load() * timing.lognormvariate(0, noise)

    draft = SimDraft(profile, draft_top, jitter)
    probe = CostProbe(2, sampled=False)
    if gamma == "auto":
        # One process: each call's Session goes on from the last one's costs.
        if "scheduler" not in state:
            state["scheduler"] = Scheduler(Costs(cached_t1=1.0))
            if tweak is not None:
                tweak(state["scheduler"])
        s = state["scheduler"]
        if not stop:
            s.keep_drafting = lambda tops: True
        policy = AutoGamma({"model": s}, draft, None, probe, 2, text.sampled)
    else:
        policy = FixedGamma(gamma, draft, None)
    tokens, time = 0, 0.0
    while tokens < text.tokens:
        position = draft.position
        draft.seconds = 0.0
        plan = policy.plan(text.max_tokens - tokens)
        policy.while_running()  # as the engine: the last round's reads, once this one runs
        asked = min(plan.gamma, text.tokens - tokens - 1)
        proposal = plan.drafter.propose(asked, None, None, plan.go_on) if asked > 0 else None
        g = 0 if proposal is None else proposal.tokens.shape[0]
        n = 0
        while n < g and plan.drafter is draft and agree[position + n]:
            n += 1  # free guesses (the cost probe) never pass here
        verify_s = jitter(ratio(profile, g + 1))
        emitted = [0] * (n + 1)
        for drafter in (draft, probe):
            drafter.commit(proposal if drafter is plan.drafter else None, n, emitted)
        source = "plain" if proposal is None else plan.drafter.name
        draft_s = draft.seconds
        logits = sure(*top[position : position + g + 1])
        policy.observe(
            Round(plan, source, asked, g, n, draft_s, verify_s, 0.0, proposal, logits, None)
        )
        time += verify_s + draft_s
        clock[0] += verify_s + draft_s
        tokens += n + 1
    return time


def simulate(
    profile: str, texts: list, gammas, calls: int, seed: int, noise: float, stop: bool = True
):
    """Speedup over plain decoding (ratio of mean decode times) of each γ, per kind of
    text (a Text's name, a Trace's category), the calls taking the texts in turn (as the
    bench takes categories round-robin)."""
    times: dict = {}
    for gamma in gammas:
        rng = random.Random(seed)
        state: dict = {}
        for i in range(calls):
            kind, text = texts[i % len(texts)]
            t = run_call(PROFILES[profile], text, gamma, state, rng, noise, stop)
            times.setdefault(kind, {}).setdefault(gamma, []).append(t)
    return {kind: {g: mean(by[0]) / mean(ts) for g, ts in by.items()} for kind, by in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", choices=sorted(PROFILES), action="append")
    ap.add_argument("--text", choices=sorted(TEXTS), action="append", help="default: all, in turn")
    ap.add_argument(
        "--traces", type=Path, help="replay recorded replies (confidence_agreement.py --traces)"
    )
    ap.add_argument("--temperature", type=float, help="replay only the traces sampled at it")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--noise", type=float, default=0.1, help="lognormal σ of each pass's time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-stop", action="store_true", help="auto's rounds run their whole γ, however unsure"
    )
    args = ap.parse_args()
    gammas = [0, "auto", 1, 2, 3, 4, 6, 8]
    print("profile  text   " + "  ".join(f"{str(g):>5}" for g in gammas))
    for profile in args.profile or sorted(PROFILES):
        if args.traces:
            texts = [(t.category, t) for t in Trace.read(args.traces, args.temperature)]
        else:
            texts = [(kind, TEXTS[kind]) for kind in args.text or TEXTS]
        result = simulate(
            profile, texts, gammas, args.calls, args.seed, args.noise, not args.no_stop
        )
        for kind, r in result.items():
            print(f"{profile:8} {kind:6} " + "  ".join(f"{r[g]:5.2f}" for g in gammas))


if __name__ == "__main__":
    main()
