"""A call's statistics: what its rounds drafted, accepted and cost, counted as they end."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from . import tree as trees
from .policy import RoundSummary


@dataclass
class Stats:
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens actually processed (the rest came from the cache)
    tokens: int = 0  # emitted (EOS excluded)
    target_passes: int = 0  # target forward passes after prefill
    drafted: int = 0
    accepted: int = 0
    gamma: int | str = 0  # as asked: an int, or "auto"
    draft_mode: str = "model"  # as asked (drafters.modes()), or the name of a user's drafter
    drafters: list[str] = field(default_factory=list)  # the drafters that ran in the call
    sampling: str = "rejection"  # settings.SAMPLINGS: how drafts were judged at T > 0
    rounds_by_gamma: dict[int, int] = field(default_factory=dict)  # the γ actually used
    rounds_by_source: dict[str, int] = field(default_factory=dict)  # model/lookup/probe/plain
    cut_short: int = 0  # auto rounds the draft's own confidence ended before the γ chosen
    predicted_tps: float = 0.0  # the cost model's forecast for its last choice (auto only)
    # What auto's last choice for the draft model rested on (see policy.Plan): the draft's
    # cost per target pass and this text's forecast α; None where not measured or seen.
    draft_ratio: float | None = None
    forecast_alpha: float | None = None
    prefill_time: float = 0.0  # both models' prompt processing (the draft's too), seconds
    draft_time: float = 0.0
    verify_time: float = 0.0
    rewind_time: float = 0.0  # rejected drafts undone by running kept tokens again
    rewinds: int = 0  # rounds that needed such a re-run (caches that cannot be trimmed)
    trees_as_chains: int = 0  # tree proposals this target verified by their first path
    tree: int | str = "auto"  # as asked: auto, off, or the most nodes of a tree
    tree_rounds: int = 0  # rounds that verified a tree whole
    tree_nodes: int = 0  # the drafts those trees held (their verifies' rows but the root's)
    rounds_by_shape: dict[str, int] = field(default_factory=dict)  # trees by the shape chosen
    rounds_by_accepted: dict[int, int] = field(default_factory=dict)  # by drafts accepted
    decode_time: float = 0.0  # first round to last token, seconds
    ttft: float = 0.0  # call to first emitted token, seconds
    finish_reason: str = ""  # "eos" | "length"
    eos: int = 0  # 1 where the target produced an EOS (never emitted, but a pass made it)
    # Rounds that drafted at each position (a tree: a node at that depth), and that kept it
    accepted_by_position: list[int] = field(default_factory=list)
    drafted_by_position: list[int] = field(default_factory=list)
    # Served in a batch (specmlx.batch.Seat.report): its passes by how many sequences they
    # held, the rounds whose γ the batch lowered, and that batched rounds verify chains
    batch: dict = field(default_factory=dict)

    @property
    def acceptance(self) -> float:
        """alpha: the fraction of drafted tokens the target accepted (a tree's nodes off
        the accepted path count as drafted: compare trees and chains by τ)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """tau: tokens the target produced per forward pass, 1.0 for plain decoding: the
        pass that sampled an EOS counts its token too, though the EOS is never emitted."""
        produced = self.tokens + self.eos
        return produced / self.target_passes if self.target_passes else 0.0

    @property
    def decode_tps(self) -> float:
        return self.tokens / self.decode_time if self.decode_time else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_time if self.prefill_time else 0.0

    def add_round(self, r: RoundSummary) -> None:
        """Count a finished round (the engine's one observer of its own timing)."""
        self.target_passes += 1
        self.rounds_by_gamma[r.drafted] = self.rounds_by_gamma.get(r.drafted, 0) + 1
        self.rounds_by_source[r.source] = self.rounds_by_source.get(r.source, 0) + 1
        self.verify_time += r.verify_s
        self.rewind_time += r.rewind_s
        self.rewinds += r.rewind_s > 0
        if r.plan.predicted_tps:
            self.predicted_tps = r.plan.predicted_tps
        if r.plan.draft_ratio is not None:
            self.draft_ratio = r.plan.draft_ratio
        if r.plan.alpha is not None:
            self.forecast_alpha = r.plan.alpha
        if r.source == "plain":
            return
        self.trees_as_chains += r.tree_as_chain
        self.draft_time += r.draft_s
        self.prefill_time += r.prompt_s
        self.drafted += r.drafted
        self.accepted += r.accepted
        self.rounds_by_accepted[r.accepted] = self.rounds_by_accepted.get(r.accepted, 0) + 1
        deep = r.drafted
        if r.parents is not None:
            self.tree_rounds += 1
            self.tree_nodes += r.drafted
            shape = str(r.plan.tree or trees.Shape(tuple(r.parents)))
            self.rounds_by_shape[shape] = self.rounds_by_shape.get(shape, 0) + 1
            deep = max(trees.depths(r.parents), default=0)
        else:
            self.cut_short += r.drafted < r.asked
        while len(self.drafted_by_position) < deep:
            self.drafted_by_position.append(0)
            self.accepted_by_position.append(0)
        for i in range(deep):
            self.drafted_by_position[i] += 1
            self.accepted_by_position[i] += i < r.accepted

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            acceptance=self.acceptance,
            tokens_per_pass=self.tokens_per_pass,
            decode_tps=self.decode_tps,
            prefill_tps=self.prefill_tps,
        )
        return out
