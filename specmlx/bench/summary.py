"""What a run's records add up to: the greedy check against the target alone, speedups
as pairwise ratios (a mode against the target alone on the same prompt and temperature),
and per mode, temperature and category their medians, α, τ and memory."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable

from .modes import TARGET
from .record import RunRecord


def compare_to_target(records: list[RunRecord]) -> None:
    """Greedy runs: mark whether each mode's tokens equal the target alone's, and where not."""
    reference = {
        (r.prompt_id, r.temperature): r.token_ids
        for r in records
        if r.mode == TARGET.name and r.temperature == 0
    }
    for r in records:
        if r.temperature != 0 or r.mode == TARGET.name:
            continue
        ref = reference.get((r.prompt_id, r.temperature))
        if ref is None:
            continue
        r.matches_target = r.token_ids == ref
        r.diverges_at = None
        if not r.matches_target:
            r.diverges_at = next(
                (i for i, (a, b) in enumerate(zip(r.token_ids, ref, strict=False)) if a != b),
                min(len(r.token_ids), len(ref)),
            )


def pairwise_ratios(records: list[RunRecord], metric: str = "decode_tps") -> dict:
    """{(mode, temperature, prompt_id): mode's metric ÷ target alone's, same prompt & T}.

    With --repeat, each side is the median of its runs: on a shared machine one run of
    a short reply can take twice as long as its twin for no reason of its own."""
    runs: dict[tuple, list[float]] = defaultdict(list)
    for r in records:
        runs[(r.mode, r.temperature, r.prompt_id)].append(getattr(r, metric))
    ratios = {}
    for (mode, temp, pid), values in runs.items():
        base = runs.get((TARGET.name, temp, pid))
        if base and statistics.median(base):
            ratios[(mode, temp, pid)] = statistics.median(values) / statistics.median(base)
    return ratios


def _merge_counts(counts: Iterable[dict | None]) -> dict | None:
    merged: Counter = Counter()
    for c in counts:
        merged.update({str(k): v for k, v in (c or {}).items()})
    return dict(sorted(merged.items(), key=lambda kv: int(kv[0]))) if merged else None


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def summarize(records: list[RunRecord]) -> list[dict]:
    """Per mode, temperature and category (plus category 'all'): medians, ratios, α, τ."""
    ratios = pairwise_ratios(records)
    e2e_ratios = pairwise_ratios(records, "e2e_tps")
    groups: dict[tuple, list[RunRecord]] = defaultdict(list)
    for r in records:
        groups[(r.mode, r.temperature, r.category)].append(r)
        groups[(r.mode, r.temperature, "all")].append(r)
    target_totals = {
        key[1:]: (sum(r.tokens for r in rs), sum(r.decode_s for r in rs))
        for key, rs in groups.items()
        if key[0] == TARGET.name
    }
    rows = []
    for (mode, temp, category), rs in groups.items():
        prompt_ids = list(dict.fromkeys(r.prompt_id for r in rs))  # once each, in order
        speedups = [ratios[k] for k in ((mode, temp, p) for p in prompt_ids) if k in ratios]
        e2e = [e2e_ratios[k] for k in ((mode, temp, p) for p in prompt_ids) if k in e2e_ratios]
        tokens, decode_s = sum(r.tokens for r in rs), sum(r.decode_s for r in rs)
        base_tokens, base_s = target_totals.get((temp, category), (0, 0.0))
        drafted, passes = sum(r.drafted for r in rs), sum(r.target_passes for r in rs)
        timed_draft = [r for r in rs if r.draft_s is not None and r.gamma != 0]
        greedy = [r for r in rs if r.matches_target is not None]
        rows.append(
            {
                "mode": mode,
                "engine": rs[0].engine,
                "family": rs[0].family,
                "gamma": rs[0].gamma,
                "temperature": temp,
                "category": category,
                "prompts": len(prompt_ids),
                "runs": len(rs),
                "tokens": tokens,
                "decode_tps_median": statistics.median(r.decode_tps for r in rs),
                "decode_tps_total": _ratio(tokens, decode_s),
                "speedup_median": statistics.median(speedups) if speedups else None,
                "speedup_min": min(speedups, default=None),
                "speedup_max": max(speedups, default=None),
                # Spec-Bench's figure: total tokens / total time, over the target's
                "speedup_total": _ratio(
                    _ratio(tokens, decode_s) or 0.0, _ratio(base_tokens, base_s) or 0.0
                ),
                "e2e_speedup_median": statistics.median(e2e) if e2e else None,
                "alpha": _ratio(sum(r.accepted for r in rs), drafted),
                "tau": _ratio(tokens, passes),
                "draft_share": _ratio(
                    sum(r.draft_s for r in timed_draft), sum(r.decode_s for r in timed_draft)
                )
                if timed_draft
                else None,
                "prefill_tps_median": statistics.median(r.prefill_tps for r in rs),
                "ttft_s_median": statistics.median(r.ttft_s for r in rs),
                "peak_memory_bytes": max(r.peak_memory_bytes for r in rs),
                "rss_bytes": max(r.rss_bytes for r in rs),
                "greedy_checked": len(greedy),
                "greedy_divergent": sum(not r.matches_target for r in greedy),
                # the γ specmlx actually used, round by round (telling for γ = auto)
                "rounds_by_gamma": _merge_counts(
                    (r.engine_stats or {}).get("rounds_by_gamma") for r in rs
                ),
                # of those, rounds the draft's own confidence ended early (auto)
                "cut_short": sum((r.engine_stats or {}).get("cut_short", 0) for r in rs),
            }
        )
    return rows
