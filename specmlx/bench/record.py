"""One timed generation as a result keeps it: every raw figure, and the rates derived."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RunRecord:
    """One timed generation: one prompt, one temperature, one mode."""

    prompt_id: str
    category: str
    temperature: float
    mode: str
    engine: str
    gamma: int | str
    family: str
    order: int  # position in the run's timeline
    prompt_tokens: int
    tokens: int  # emitted, EOS excluded
    token_ids: list[int]
    text: str
    finish_reason: str
    prefill_s: float
    ttft_s: float
    decode_s: float
    wall_s: float  # measured around the whole call, prefill included
    target_passes: int
    drafted: int
    accepted: int
    draft_s: float | None  # None where the engine does not expose it (mlx-lm)
    peak_memory_bytes: int  # mx.get_peak_memory(), reset before the run
    rss_bytes: int  # process resident set after the run
    accepted_by_position: list[int] = field(default_factory=list)
    drafted_by_position: list[int] = field(default_factory=list)
    engine_stats: dict | None = None  # specmlx's own Stats.to_dict(), whatever it exposes
    matches_target: bool | None = None  # greedy only: token ids equal the target alone's
    diverges_at: int | None = None  # greedy only: first differing token index
    repeat: int = 0  # which of the prompt's --repeat runs in this mode
    steal: float | None = None  # share of the CPUs' time the hypervisor took during the run

    @property
    def decode_tps(self) -> float:
        return self.tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def e2e_tps(self) -> float:
        """Tokens per second of the whole call, prefill included."""
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            decode_tps=self.decode_tps,
            prefill_tps=self.prefill_tps,
            e2e_tps=self.e2e_tps,
            alpha=self.accepted / self.drafted if self.drafted else None,
            tau=self.tokens / self.target_passes if self.target_passes else None,
            draft_share=self.draft_s / self.decode_s
            if self.draft_s is not None and self.decode_s > 0
            else None,
        )
        return out
