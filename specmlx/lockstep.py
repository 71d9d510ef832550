"""Every rank runs the same rounds: rank 0 decides, the others follow.

Where the target is split over several ranks (specmlx.distributed), each of its passes
is a collective: every rank must run the same pass, over the same tokens, at the same
time. `lockstep(policy, target)` wraps the call's γ policy (FixedGamma or AutoGamma) in
a `Lockstep` with the same interface, so the engine's round loop runs unchanged:

- plan: rank 0's policy plans (which drafter, how many drafts, a tree's shape: from its
  own timings, which differ between hosts); the plan goes to every rank as a few ints,
  with the context's length and the tokens left, which the others check against their
  own (ranks out of step stop in one line rather than hang or mix texts).
- propose: the drafter runs on rank 0 alone; its proposal (drafts, a tree's parents,
  and under rejection sampling the distributions q they were drawn from) goes to every
  rank before the verify pass. The others never run a draft model or a head: their
  drafters are stand-ins that receive it. Why not draft on every rank from the same
  inputs: the auto policy's go_on cuts a proposal short from rank 0's own estimates, so
  at least the count must come from rank 0 anyway, and sending the tokens too (the same
  one collective) asks no bit-identical drafts of hosts that may differ (two Mac GPUs
  of different generations pick different kernels). Only q costs bytes (γ × V floats),
  and only under rejection sampling; greedy and coupled sampling never read it.
- verify and commit: every rank judges the same proposal on the same logits (a
  tensor-parallel all-sum and the pipeline's all-gather hand every rank the same bits)
  with the same keys, so the verdicts agree without being sent.

A call ends where the engine ends it (max tokens, EOS), the same on every rank; a
consumer that closes the Generation early must do so at the same step on every rank:
the CLI runs the same stop strings on each over the same tokens (a Ctrl-C ends every
rank), and the server sends rank 0's word after each token (server.worker.Mirror).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx

from . import distributed
from .drafters import taps
from .errors import SpecmlxError
from .policy.round import Plan, Policy, RoundSummary
from .proposal import Proposal
from .sampling import SamplingParams

# A proposal's q goes out in its own dtype (rank 0 judges its own, bit for bit the same).
Q_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def lockstep(policy: Policy, model: Any, params: SamplingParams) -> Policy:
    """`policy` as it is where `model` is not split over ranks (or the call has nothing to
    draft with: every round is then plain on every rank); else a Lockstep around it.
    `params`: the call's sampling, which says whether the verify reads q."""
    world = getattr(model, "group", None)
    if world is None or not (policy.drafters or policy.helpers):
        return policy
    if getattr(model, "shard", "") == "pipeline" and any(taps(d) for d in policy.drafters):
        raise SpecmlxError(
            "this head reads the outputs of the target's inner layers, which a pipeline split "
            "keeps on other ranks; load the target with --shard tensor"
        )
    return Lockstep(policy, world, not (params.greedy or params.coupled))


class Lockstep:
    def __init__(self, inner: Policy, world: Any, sends_q: bool = False):
        """`sends_q`: the verify reads the drafts' q (rejection sampling), so it goes out too."""
        self.inner, self.world, self.sends_q = inner, world, sends_q
        self.leader = world.rank() == 0
        known = [*inner.drafters, *inner.helpers]
        self.index = {id(d): i for i, d in enumerate(known)}
        wrap = _Leader if self.leader else _Follower
        self.drafters = [wrap(d, self) for d in inner.drafters]
        self.helpers = [wrap(d, self) for d in inner.helpers]
        self.known = [*self.drafters, *self.helpers]
        self.planned: Plan | None = None  # rank 0: the inner policy's own plan

    def plan(self, remaining: int, context: int = 0) -> Plan:
        plan = self.inner.plan(remaining, context) if self.leader else Plan(None, 0)
        which = -1 if plan.drafter is None else self.index[id(plan.drafter)]
        sent = distributed.broadcast_ints([which, plan.gamma, remaining, context], self.world)
        which, gamma, *theirs = sent
        if theirs != [remaining, context]:
            raise SpecmlxError(
                f"rank {self.world.rank()} is out of step with rank 0 (it has {context} tokens "
                f"and {remaining} to go, rank 0 {theirs[1]} and {theirs[0]}): the ranks must "
                "run the same calls with the same settings"
            )
        if self.leader:
            self.planned = plan
            return plan if which < 0 else replace(plan, drafter=self.known[which])
        return Plan(None, 0) if which < 0 else Plan(self.known[which], gamma)

    def observe(self, round: RoundSummary) -> None:
        if self.leader:  # the inner policy sees its own plan, its own drafter in it
            self.inner.observe(replace(round, plan=self.planned))

    def while_running(self) -> None:
        if self.leader:
            self.inner.while_running()

    def finish(self) -> None:
        if self.leader:
            self.inner.finish()

    # -- the proposal's trip --------------------------------------------------------

    def send(self, proposal: Proposal, asked: int) -> Proposal:
        """Rank 0: its proposal, sent to every rank (returned as it is)."""
        mx.eval(proposal.tokens, proposal.q)
        n = proposal.tokens.shape[0]
        q = proposal.q if self.sends_q else None
        width = 0 if q is None else q.shape[-1]
        kind = 0 if q is None else Q_DTYPES.index(q.dtype)
        parents = proposal.parents or list(range(-1, n - 1))
        pad = [0] * (asked - n)
        header = [n, width, kind, *proposal.tokens.tolist(), *pad, *(p + 1 for p in parents), *pad]
        distributed.broadcast_ints(header, self.world)
        if q is not None:
            distributed.broadcast(q, self.world)
        return proposal

    def receive(self, asked: int) -> Proposal:
        """Another rank: rank 0's proposal for this round."""
        header = distributed.broadcast_ints([0] * (3 + 2 * asked), self.world)
        n, width, kind = header[:3]
        tokens = mx.array(header[3 : 3 + n], mx.uint32)
        parents = [p - 1 for p in header[3 + asked : 3 + asked + n]]
        q = None
        if width:
            q = distributed.broadcast(mx.zeros((n, width), Q_DTYPES[kind]), self.world)
        return Proposal(tokens, q, parents if n else None)


class _Leader:
    """Rank 0's drafter as the engine sees it: the drafter itself, but that each proposal
    it makes goes out to the other ranks."""

    def __init__(self, drafter: Any, lockstep: Lockstep):
        self.inner, self.lockstep = drafter, lockstep

    def propose(self, g: int, keys, draw, go_on=None, **kwargs) -> Proposal:
        proposal = self.inner.propose(g, keys, draw, go_on, **kwargs)
        return self.lockstep.send(proposal, g)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class _Follower:
    """Another rank's stand-in for a drafter of rank 0's: it proposes what rank 0's drafter
    proposed (received), and keeps no state of its own."""

    def __init__(self, drafter: Any, lockstep: Lockstep):
        self.name, self.lockstep = drafter.name, lockstep

    def start(self, context: list[int]) -> None:
        pass

    def propose(self, g: int, keys, draw, go_on=None, **kwargs) -> Proposal:
        return self.lockstep.receive(g)

    def commit(self, proposal: Proposal | None, verdict) -> int:
        return 0
