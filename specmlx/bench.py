"""Benchmark: target alone vs specmlx speculative vs mlx-lm's speculative, in one run.

Every mode runs on the same loaded models, interleaved per prompt (all modes for one
prompt back to back, the order rotated from prompt to prompt), so drift on a noisy
machine hits every mode alike. Speedups are computed pair by pair: a mode's decode
tokens/s on a prompt divided by the target alone's on the same prompt and temperature,
then summarised as median, min and max over prompts (Spec-Bench's total-tokens ÷
total-time ratio is reported beside it).

Timing is the same for every mode: prefill (prompt into the KV caches of the target,
and of the draft when there is one), then decode from the first round to the last
token. mlx-lm's prefill is done here with the same model calls and handed over as its
`prompt_cache`, so its decode clock starts exactly where specmlx's does.

This module returns data; the CLI renders it.
"""

from __future__ import annotations

import inspect
import json
import os
import platform
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx

from .errors import SpecmlxError
from .loading import Model, backend

SCHEMA = "specmlx-bench/1"
SUITE_DIR = Path(__file__).resolve().parents[1] / "bench" / "prompts"

MT_BENCH = (
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
)
# When a run takes fewer prompts than there are categories, categories are visited in
# this order, so a handful of prompts still spans code, prose, translation and QA.
SPREAD = (
    "humaneval",
    "writing",
    "translation",
    "qa",
    "coding",
    "summarization",
    "math",
    "reasoning",
    "extraction",
    "roleplay",
    "stem",
    "humanities",
    "math_reasoning",
    "rag",
)
HELDOUT = ("math_reasoning", "rag")  # plus humaneval ids 40-79
HUMANEVAL_TUNE_IDS = range(40)
SPLITS = ("tune", "heldout", "all")
WARMUP_TEXT = "Write one short sentence about the sea."
# A block (one prompt's runs in every mode) during which the hypervisor took more than this
# share of the CPUs' time is timed again, up to RETIMES times: on this shared VM a run that
# loses 12% of the CPUs to steal decodes 15-30% slower, while runs without it vary ~4%.
STEAL_LIMIT = 0.02
RETIMES = 2


@dataclass(frozen=True)
class Prompt:
    id: str  # "spec_bench/81", "humaneval/0"
    category: str
    text: str
    split: str  # "tune" | "heldout"


@dataclass(frozen=True)
class Mode:
    engine: str  # "specmlx" | "mlx-lm"
    gamma: int | str  # draft tokens per round; 0 = the target alone; "auto" = specmlx decides
    draft_mode: str = "model"  # specmlx: "model" | "lookup" (prompt n-grams) | "auto"
    # The target alone a second time, timed as a mode of its own: an A/A test whose
    # "speedup" is what this machine's noise alone makes of two identical modes.
    control: bool = False

    @property
    def family(self) -> str:
        """The mode without its γ: 'specmlx', 'specmlx/lookup', 'mlx-lm'."""
        return self.engine if self.draft_mode == "model" else f"{self.engine}/{self.draft_mode}"

    @property
    def name(self) -> str:
        if self.engine == "specmlx" and self.gamma == 0:
            return "target:again" if self.control else "target"
        return f"{self.family}:{self.gamma}"

    @property
    def speculative(self) -> bool:
        return self.gamma != 0


TARGET = Mode("specmlx", 0)
CONTROL = Mode("specmlx", 0, control=True)


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


# ---------------------------------------------------------------- prompts


def prompt_split(category: str, number: int) -> str:
    if category in HELDOUT or (category == "humaneval" and number not in HUMANEVAL_TUNE_IDS):
        return "heldout"
    return "tune"


def read_suite(suite_dir: Path = SUITE_DIR) -> list[Prompt]:
    """Every prompt of Spec-Bench and EAGLE's HumanEval, first turn only."""
    files = {
        "spec_bench": suite_dir / "spec_bench.jsonl",
        "humaneval": suite_dir / "humaneval.jsonl",
    }
    prompts = []
    for source, path in files.items():
        if not path.is_file():
            raise SpecmlxError(
                f"prompt suite {path} not found; run from a specmlx checkout or pass --suite-dir"
            )
        for line in path.read_text().splitlines():
            row = json.loads(line)
            category = "humaneval" if source == "humaneval" else row["category"]
            number = int(row["question_id"])
            prompts.append(
                Prompt(
                    f"{source}/{number}", category, row["turns"][0], prompt_split(category, number)
                )
            )
    return prompts


def select_prompts(
    prompts: list[Prompt],
    split: str = "tune",
    categories: Iterable[str] | None = None,
    limit: int | None = None,
    shortest: bool = False,
    skip: int = 0,
) -> list[Prompt]:
    """Filter by split and category, then take `limit` prompts round-robin over categories.

    Within a category prompts keep the suite's order, or go shortest first with
    `shortest` (cheap prefill: a quick run on a slow machine); `skip` leaves out the first
    prompts of each category (a long run split in parts: humaneval 0-19, then 20-39).
    """
    if split not in SPLITS:
        raise SpecmlxError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    known = sorted({p.category for p in prompts})
    wanted = None
    if categories:  # "mt-bench" stands for its eight categories
        wanted = [c for item in categories for c in (MT_BENCH if item == "mt-bench" else [item])]
    if wanted:
        unknown = [c for c in wanted if c not in known]
        if unknown:
            raise SpecmlxError(
                f"unknown categor{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)}; "
                f"choose from mt-bench, {', '.join(known)}"
            )
    by_category: dict[str, list[Prompt]] = defaultdict(list)
    for p in prompts:
        if (split == "all" or p.split == split) and (not wanted or p.category in wanted):
            by_category[p.category].append(p)
    if not by_category:
        raise SpecmlxError(
            f"no prompts in split {split!r} for categories {', '.join(wanted or known)}; "
            "math_reasoning and rag are held out (--split heldout or all)"
        )
    if shortest:
        for items in by_category.values():
            items.sort(key=lambda p: len(p.text))
    for items in by_category.values():
        del items[:skip]
    order = wanted or [c for c in SPREAD if c in by_category]
    queues = [by_category[c] for c in order if c in by_category]
    total = sum(len(q) for q in queues)
    limit = total if limit is None else min(limit, total)
    if limit < 1:
        raise SpecmlxError(f"--prompts must be >= 1, got {limit}")
    chosen: list[Prompt] = []
    depth = 0
    while len(chosen) < limit:
        for queue in queues:
            if depth < len(queue) and len(chosen) < limit:
                chosen.append(queue[depth])
        depth += 1
    return chosen


def encode(model: Model, text: str, chat_template: bool) -> list[int]:
    """Token ids of `text`, wrapped in the chat template when asked and available."""
    tokenizer = model.tokenizer
    if chat_template and getattr(tokenizer, "has_chat_template", False):
        messages = [{"role": "user", "content": text}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    from .engine import encode_prompt

    return encode_prompt(model, text)


# ---------------------------------------------------------------- modes and schedule


def supports_auto() -> bool:
    """Whether specmlx.generate accepts num_draft="auto" (the adaptive γ policy)."""
    from .engine import generate

    param = inspect.signature(generate).parameters["num_draft"]
    return param.default == "auto" or "str" in str(param.annotation)


def draft_modes_available() -> list[str]:
    """The draft modes specmlx.generate offers: always "model"; "lookup"/"auto" once added."""
    from . import engine

    if "draft_mode" not in inspect.signature(engine.generate).parameters:
        return ["model"]
    return list(getattr(engine, "DRAFT_MODES", ["model"]))


def parse_draft_modes(text: str, available: list[str]) -> list[str]:
    modes = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    unknown = [m for m in modes if m not in available]
    if unknown or not modes:
        raise SpecmlxError(
            f"--draft-mode takes {', '.join(available)} (comma-separated), got {text!r}"
        )
    return modes


def parse_gammas(text: str, auto_available: bool) -> list[int | str]:
    """'1,2,4,6' or 'auto,4' -> [1, 2, 4, 6] / ['auto', 4]; γ = 0 is the target alone."""
    gammas: list[int | str] = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if item == "auto":
            if not auto_available:
                raise SpecmlxError(
                    "--gamma auto needs an adaptive γ policy this specmlx does not have yet; "
                    "give integers, e.g. --gamma 1,2,4"
                )
            value: int | str = "auto"
        else:
            try:
                value = int(item)
            except ValueError:
                raise SpecmlxError(f"--gamma takes integers >= 1 or auto, got {item!r}") from None
            if value < 1:
                raise SpecmlxError(
                    f"--gamma values must be >= 1 (the target alone always runs), got {value}"
                )
        if value not in gammas:
            gammas.append(value)
    if not gammas:
        raise SpecmlxError("--gamma is empty; give e.g. 1,2,4,6")
    return gammas


def parse_temperatures(text: str) -> list[float]:
    try:
        temps = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SpecmlxError(
            f"--temperature takes numbers >= 0 like 0,0.7,1.0, got {text!r}"
        ) from None
    if not temps or any(t < 0 for t in temps):
        raise SpecmlxError(f"--temperature takes numbers >= 0 like 0,0.7,1.0, got {text!r}")
    return list(dict.fromkeys(temps))


def build_modes(
    gammas: list[int | str],
    mlx_lm: bool = True,
    mlx_lm_target: bool = False,
    draft_modes: Iterable[str] = ("model",),
    mlx_lm_gammas: list[int] | None = None,
    control: bool = False,
) -> list[Mode]:
    """The target alone, specmlx at each draft mode and γ, mlx-lm at each integer γ
    (or at `mlx_lm_gammas`, e.g. to pit specmlx's auto against mlx-lm's best fixed γ);
    `control` adds the target alone again (CONTROL), the run's noise floor.

    mlx-lm has neither an automatic γ nor prompt lookup, so it runs fixed γ, model draft.
    """
    modes = [TARGET] + ([CONTROL] if control else [])
    modes += [Mode("specmlx", g, d) for d in draft_modes for g in gammas]
    if mlx_lm_target:
        modes.append(Mode("mlx-lm", 0))
    if mlx_lm:
        fixed = mlx_lm_gammas or [g for g in gammas if isinstance(g, int)]
        modes += [Mode("mlx-lm", g) for g in fixed]
    return modes


def schedule(
    prompts: list[Prompt], temperatures: list[float], modes: list[Mode], repeat: int = 1
) -> list[tuple[Prompt, float, Mode]]:
    """Interleaved order: per prompt and temperature, every mode once, back to back,
    `repeat` blocks in a row.

    The mode order rotates by one from block to block, so no mode always runs first
    (after a cold cache, or right after the heaviest mode).
    """
    order = []
    blocks = ((p, t) for p in prompts for t in temperatures for _ in range(repeat))
    for block, (prompt, temp) in enumerate(blocks):
        shift = block % len(modes)
        order += [(prompt, temp, mode) for mode in modes[shift:] + modes[:shift]]
    return order


# ---------------------------------------------------------------- running


def cpu_times() -> tuple[int, int] | None:
    """(stolen, all) CPU time since boot in clock ticks, summed over CPUs, from
    /proc/stat; None where there is none (not Linux)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return (ticks[7] if len(ticks) > 7 else 0), sum(ticks)


def steal_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def process_memory() -> tuple[int, int]:
    """(current, peak) resident set size of this process, in bytes."""
    status = Path("/proc/self/status")
    if status.exists():
        fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)

        def kib(name: str) -> int:
            return int(fields.get(name, "0 kB").split()[0]) * 1024

        return kib("VmRSS"), kib("VmHWM")
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS
    return peak, peak


def run_specmlx(
    target: Model,
    draft: Model | None,
    ids: list[int],
    mode: Mode,
    temperature: float,
    max_tokens: int,
    seed: int,
) -> RunRecord:
    from .engine import generate

    mx.reset_peak_memory()
    start = time.perf_counter()
    kwargs: dict = {"num_draft": mode.gamma}
    if mode.draft_mode != "model":
        kwargs["draft_mode"] = mode.draft_mode
    if mode.speculative and mode.draft_mode != "lookup":  # lookup needs no draft model
        kwargs["draft"] = draft
    gen = generate(
        target, ids, max_tokens=max_tokens, temperature=temperature, seed=seed, **kwargs
    ).run()
    wall = time.perf_counter() - start
    s = gen.stats
    return RunRecord(
        prompt_id="",
        category="",
        temperature=temperature,
        mode=mode.name,
        engine=mode.engine,
        gamma=mode.gamma,
        family=mode.family,
        order=-1,
        prompt_tokens=s.prompt_tokens,
        tokens=s.tokens,
        token_ids=list(gen.tokens),
        text=gen.text,
        finish_reason=s.finish_reason,
        prefill_s=s.prefill_time,
        ttft_s=s.ttft,
        decode_s=s.decode_time,
        wall_s=wall,
        target_passes=s.target_passes,
        drafted=s.drafted,
        accepted=s.accepted,
        draft_s=s.draft_time,
        peak_memory_bytes=mx.get_peak_memory(),
        rss_bytes=process_memory()[0],
        accepted_by_position=list(s.accepted_by_position),
        drafted_by_position=list(s.drafted_by_position),
        engine_stats=s.to_dict(),
    )


def mlx_lm_rounds(flags: list[bool], gamma: int, max_tokens: int) -> dict:
    """Rebuild mlx-lm's rounds from its per-token `from_draft` flags.

    mlx-lm drafts min(γ, tokens left) each round, accepts the longest prefix equal to
    the target's own tokens (flagged True) and then emits one target token (False).
    `flags` must include the EOS token's flag when generation stopped on EOS.
    """
    rounds = drafted = accepted = emitted = 0
    drafted_at: list[int] = []
    accepted_at: list[int] = []
    i = 0
    while i < len(flags):
        g = min(gamma, max_tokens - emitted)
        rounds += 1
        drafted += g
        n = 0
        while i < len(flags) and flags[i] and n < g:
            n += 1
            i += 1
        drafted_at += [0] * (g - len(drafted_at))
        accepted_at += [0] * (g - len(accepted_at))
        for k in range(g):
            drafted_at[k] += 1
            accepted_at[k] += k < n
        accepted += n
        emitted += n
        if i < len(flags):  # the target's own token closes the round
            i += 1
            emitted += 1
    return {
        "target_passes": rounds,
        "drafted": drafted,
        "accepted": accepted,
        "drafted_by_position": drafted_at,
        "accepted_by_position": accepted_at,
    }


def run_mlx_lm(
    target: Model,
    draft: Model | None,
    ids: list[int],
    mode: Mode,
    temperature: float,
    max_tokens: int,
    seed: int,
) -> RunRecord:
    """mlx-lm's own stream_generate (speculative when mode.gamma > 0) on the same models."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    from .caches import prefill

    mx.reset_peak_memory()
    start = time.perf_counter()
    cache = make_prompt_cache(target.module)
    prefill(target, cache, ids[:-1])
    kwargs: dict = {"sampler": make_sampler(temp=temperature)}
    if mode.speculative:
        draft_cache = make_prompt_cache(draft.module)
        prefill(draft, draft_cache, ids[:-1])
        cache = cache + draft_cache  # mlx-lm's layout: target layers, then draft layers
        kwargs.update(draft_model=draft.module, num_draft_tokens=mode.gamma)
    decode_start = time.perf_counter()
    mx.random.seed(seed)
    eos = target.tokenizer.eos_token_ids
    tokens: list[int] = []
    flags: list[bool] = []
    text = ""
    finish = "length"
    ttft = 0.0
    for response in stream_generate(
        target.module,
        target.tokenizer,
        mx.array(ids[-1:], mx.uint32),
        max_tokens=max_tokens,
        prompt_cache=cache,
        **kwargs,
    ):
        if not ttft:
            ttft = time.perf_counter() - start
        text += response.text
        flags.append(response.from_draft)
        if response.finish_reason == "stop" and response.token in eos:
            finish = "eos"
        else:
            tokens.append(response.token)
    end = time.perf_counter()
    rounds = mlx_lm_rounds(flags, mode.gamma if mode.speculative else 0, max_tokens)
    return RunRecord(
        prompt_id="",
        category="",
        temperature=temperature,
        mode=mode.name,
        engine=mode.engine,
        gamma=mode.gamma,
        family=mode.family,
        order=-1,
        prompt_tokens=len(ids),
        tokens=len(tokens),
        token_ids=tokens,
        text=text,
        finish_reason=finish,
        prefill_s=decode_start - start,
        ttft_s=ttft,
        decode_s=end - decode_start,
        wall_s=end - start,
        draft_s=None,
        peak_memory_bytes=mx.get_peak_memory(),
        rss_bytes=process_memory()[0],
        **rounds,
    )


RUNNERS: dict[str, Callable[..., RunRecord]] = {"specmlx": run_specmlx, "mlx-lm": run_mlx_lm}


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


# ---------------------------------------------------------------- summary


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


# ---------------------------------------------------------------- machine


def blas_info() -> dict:
    """Which BLAS this process uses: the library `cblas_sgemm` resolves to, and all mapped.

    A BLAS interposed with LD_PRELOAD wins the global lookup; otherwise MLX calls the
    one it was linked against (the mlx-cpu wheel bundles netlib's reference BLAS).
    Other packages (scipy, numpy) may map their own BLAS, which MLX does not use.
    """
    import ctypes
    import ctypes.util

    maps = Path("/proc/self/maps")
    mapped = sorted(
        {
            line.split()[-1]
            for line in (maps.read_text().splitlines() if maps.exists() else [])
            if any(k in line.rsplit("/", 1)[-1].lower() for k in ("blas", "lapack", "mkl"))
        }
    )
    active = None
    try:
        sgemm = ctypes.cast(ctypes.CDLL(None).cblas_sgemm, ctypes.c_void_p)
    except (AttributeError, OSError):  # not in the global scope: MLX's own linked BLAS
        mlx_dir = Path(mx.__file__).resolve().parents[1]
        active = next((m for m in mapped if Path(m).resolve().is_relative_to(mlx_dir)), None)
    else:

        class DlInfo(ctypes.Structure):
            _fields_ = [
                ("dli_fname", ctypes.c_char_p),
                ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p),
                ("dli_saddr", ctypes.c_void_p),
            ]

        info = DlInfo()
        libdl = ctypes.CDLL(ctypes.util.find_library("dl") or None)
        if libdl.dladdr(sgemm, ctypes.byref(info)):
            active = info.dli_fname.decode()
    return {
        "active": Path(active).name if active else None,
        "mapped": [Path(m).name for m in mapped],
    }


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    from .native import describe as native_describe

    def pkg(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    from . import __version__

    env_keys = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "LD_PRELOAD")
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "mlx": mx.__version__,
        "mlx_lm": pkg("mlx-lm"),
        "specmlx": __version__,
        "backend": backend(),
        "device": str(mx.default_device()),
        "blas": blas_info(),
        "int4_kernel": native_describe(),
        "env": {k: os.environ[k] for k in env_keys if k in os.environ},
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "code": code_version(),
    }


def code_version() -> dict | None:
    """The checkout's commit and whether it had uncommitted changes (None outside git)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return {"commit": commit, "dirty": bool(dirty)}


def describe_model(model: Model) -> dict:
    return {
        "path": str(model.path),
        "name": model.name,
        "model_type": model.config.get("model_type"),
        "dtype": model.dtype,
        "quantization": model.quantization,
        "description": model.describe(),
        "cpu_weights": model.weights,  # "int4" | "fp32" (expanded for a fast BLAS) | ""
        "cpu_weights_why": model.weights_why,
        # Which layer classes actually run (e.g. mlx's QuantizedLinear or a native kernel).
        "layer_types": dict(
            Counter(
                type(m).__name__
                for m in model.module.modules()
                if "Linear" in type(m).__name__ or "Embedding" in type(m).__name__
            )
        ),
        "load_info": model.info,
    }


# ---------------------------------------------------------------- the whole run


def run_bench(
    target: Model,
    draft: Model,
    prompts: list[Prompt],
    modes: list[Mode],
    temperatures: list[float],
    *,
    max_tokens: int = 128,
    repeat: int = 1,
    seed: int = 0,
    chat_template: bool = True,
    warmup: bool = True,
    cold_start: dict | None = None,
    progress: Callable[[dict], None] = lambda event: None,
    runners: dict[str, Callable[..., RunRecord]] = RUNNERS,
) -> dict:
    """Run every (prompt, temperature, mode) in the interleaved order; return the result.

    `cold_start` holds the caller's load timings (process start to models ready).
    `progress` is called before each run with {phase, index, total, prompt, prompts,
    mode, temperature, elapsed_s, eta_s, records}. The result holds every raw record,
    the summary rows, the settings and the machine.
    """
    if max_tokens < 1:
        raise SpecmlxError(f"--max-tokens must be >= 1, got {max_tokens}")
    if repeat < 1:
        raise SpecmlxError(f"--repeat must be >= 1, got {repeat}")
    if any(m.speculative for m in modes) and draft is None:
        raise SpecmlxError("speculative modes need a draft model; pass --draft")
    started = time.time()
    machine = machine_info()
    ids_of = {p.id: encode(target, p.text, chat_template) for p in prompts}
    position = {p.id: i for i, p in enumerate(prompts)}

    warmups = []
    if warmup:
        # First calls read lazy weights from disk and build kernels: run every mode once,
        # greedy and sampled, on a short prompt so none of it is charged to a timed run.
        warm_ids = encode(target, WARMUP_TEXT, chat_template=False)
        kinds = sorted({0.0 if t == 0 else 1.0 for t in temperatures})
        plan = [(t, m) for t in kinds for m in modes]
        for i, (temp, mode) in enumerate(plan):
            progress(
                {
                    "phase": "warmup",
                    "index": i,
                    "total": len(plan),
                    "mode": mode.name,
                    "temperature": temp,
                }
            )
            g = mode.gamma if isinstance(mode.gamma, int) else 4
            r = runners[mode.engine](target, draft, warm_ids, mode, temp, g + 2, seed)
            warmups.append(
                {"mode": mode.name, "temperature": temp, "wall_s": r.wall_s, "ttft_s": r.ttft_s}
            )

    order = schedule(prompts, temperatures, modes, repeat)
    records: list[RunRecord] = []
    retimed: list[RunRecord] = []  # blocks timed again because of steal, kept for the record
    done: Counter = Counter()
    t0 = time.perf_counter()
    runs = 0
    for start in range(0, len(order), len(modes)):
        block = order[start : start + len(modes)]
        for attempt in range(RETIMES + 1):
            timed = []
            for prompt, temp, mode in block:
                elapsed = time.perf_counter() - t0
                i = start + len(timed)
                progress(
                    {
                        "phase": "run",
                        "index": i,
                        "total": len(order),
                        "prompt": position[prompt.id],
                        "prompts": len(prompts),
                        "prompt_id": prompt.id,
                        "mode": mode.name,
                        "temperature": temp,
                        "elapsed_s": elapsed,
                        "eta_s": elapsed / runs * (len(order) - i) if runs else None,
                        "records": records,
                        "retime": attempt,
                    }
                )
                # Each repeat samples with its own seed: at T > 0 one seed is one text per
                # mode, and modes compared on one text each say more about those texts
                # than the modes.
                repeat_index = done[(prompt.id, temp, mode.name)]
                ids = ids_of[prompt.id]
                before = cpu_times()
                r = runners[mode.engine](
                    target, draft, ids, mode, temp, max_tokens, seed + repeat_index
                )
                r.steal = steal_share(before, cpu_times())
                r.prompt_id, r.category, r.order, r.repeat = (
                    prompt.id,
                    prompt.category,
                    i,
                    repeat_index,
                )
                timed.append(r)
                runs += 1
            # A block is kept or timed again whole: its modes stay interleaved.
            if attempt == RETIMES or all((r.steal or 0.0) <= STEAL_LIMIT for r in timed):
                break
            retimed += timed
        records += timed
        for prompt, temp, mode in block:
            done[(prompt.id, temp, mode.name)] += 1
    compare_to_target(records)
    rss, rss_peak = process_memory()
    return {
        "schema": SCHEMA,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": time.time() - started,
        "machine": {
            **machine,
            "load_average_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
        },
        "models": {
            "target": describe_model(target),
            "draft": describe_model(draft) if draft else None,
        },
        "settings": {
            "modes": [m.name for m in modes],
            "temperatures": temperatures,
            "max_tokens": max_tokens,
            "repeat": repeat,
            "seed": seed,
            "seeds": "seed + repeat: each repeat samples its own text at T > 0",
            "chat_template": chat_template,
            "warmup": warmup,
            "interleaving": "per prompt and temperature, mode order rotated by one each block",
            "steal_limit": STEAL_LIMIT,
            "retimes": RETIMES,
            "timing": "prefill = prompt into target (+ draft) caches; decode = first round "
            "to last token; mlx-lm gets caches prefilled by the same model calls",
        },
        "warmup": warmups,
        # Weights load lazily: the first forward pass pays for reading them.
        "cold_start": {
            **(cold_start or {}),
            "first_call_ttft_s": warmups[0]["ttft_s"] if warmups else None,
            "first_call_wall_s": warmups[0]["wall_s"] if warmups else None,
        },
        "memory": {"rss_bytes_end": rss, "rss_peak_bytes": rss_peak},
        "prompts": [
            {
                "id": p.id,
                "category": p.category,
                "split": p.split,
                "chars": len(p.text),
                "prompt_tokens": len(ids_of[p.id]),
            }
            for p in prompts
        ],
        "runs": [r.to_dict() for r in records],
        "retimed": [r.to_dict() for r in retimed],
        "summary": summarize(records),
    }


def read_result(path: Path) -> dict:
    """A finished result written by `specmlx bench --json`, to render or plot again."""
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SpecmlxError(f"cannot read bench result {path}: {e}") from None
    if result.get("schema") != SCHEMA:
        raise SpecmlxError(f"{path} is not a {SCHEMA} result (schema {result.get('schema')!r})")
    if result.get("partial"):
        raise SpecmlxError(f"{path} holds a run that did not finish; only its raw runs are kept")
    return result


# ---------------------------------------------------------------- plot


STYLES = [("-", "o"), ("--", "x"), (":", "s"), ("-.", "^")]


def plot(result: dict, path: Path) -> None:
    """Speedup vs γ per category and τ vs γ, specmlx solid, mlx-lm dashed; a row per T."""
    try:
        import matplotlib
    except ImportError:
        raise SpecmlxError(
            "--plot needs matplotlib; install it with `pip install 'specmlx[bench]'`"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["summary"] if r["mode"] != TARGET.name and r["gamma"] != 0]
    temps = sorted({r["temperature"] for r in rows})
    if not temps:
        raise SpecmlxError("nothing to plot: the run has no speculative modes")
    ints = sorted({r["gamma"] for r in rows if isinstance(r["gamma"], int)})
    xpos: dict = {g: g for g in ints}
    if any(r["gamma"] == "auto" for r in rows):
        xpos["auto"] = (max(ints) if ints else 0) + 1  # drawn right of the fixed γs
    categories = sorted({r["category"] for r in rows} - {"all"}) + ["all"]
    # specmlx first, mlx-lm second, then other draft modes, each in its own line style
    families = sorted({r["family"] for r in rows}, key=lambda f: (f != "specmlx", f != "mlx-lm", f))
    tab20 = plt.get_cmap("tab20")
    # tab20 pairs a dark and a light shade; all dark shades first keeps neighbours distinct
    palette = [tab20(i) for i in [*range(0, 20, 2), *range(1, 20, 2)]]
    fig, axes = plt.subplots(len(temps), 2, figsize=(12, 4 * len(temps)), squeeze=False)
    for row, temp in zip(axes, temps, strict=True):
        for ci, category in enumerate(categories):
            for fi, family in enumerate(families):
                style, marker = STYLES[fi % len(STYLES)]
                mine = [
                    r
                    for r in rows
                    if r["family"] == family
                    and r["category"] == category
                    and r["temperature"] == temp
                ]
                if not mine:
                    continue
                is_all = category == "all"
                kw = {
                    "linestyle": style,
                    "marker": marker,
                    "color": "black" if is_all else palette[ci % 20],
                    "linewidth": 2.5 if is_all else 1,
                    "label": f"{family} {category}",
                }
                # fixed γs joined by a line; auto is a policy, not a point on that line
                fixed = sorted((r for r in mine if r["gamma"] != "auto"), key=lambda r: r["gamma"])
                for col, key in ((0, "speedup_median"), (1, "tau")):
                    if fixed:
                        row[col].plot([r["gamma"] for r in fixed], [r[key] for r in fixed], **kw)
                    for r in mine:
                        if r["gamma"] == "auto":
                            auto_kw = {**kw, "marker": "*", "markersize": 11, "linestyle": "none"}
                            if fixed:
                                auto_kw.pop("label")
                            row[col].plot([xpos["auto"]], [r[key]], **auto_kw)
        row[0].axhline(1.0, color="grey", linewidth=0.8)
        row[0].set_title(f"decode speedup vs target alone (median of pairs), T={temp:g}")
        row[1].set_title(f"τ: tokens per target forward, T={temp:g}")
        for ax in row:
            ax.set_xticks(list(xpos.values()), [str(g) for g in xpos])
            ax.set_xlabel("γ (draft tokens per round)")
            ax.grid(alpha=0.3)
    axes[0][1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    m = result["models"]
    fig.suptitle(
        f"{m['target']['name']} / {m['draft']['name'] if m['draft'] else '-'} · "
        f"{result['machine']['cpu']} · {result['machine']['backend']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
