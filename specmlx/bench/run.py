"""A whole run: warm-up, then every (prompt, temperature, mode) in the interleaved order,
blocks that lost CPUs to steal timed again, and the result with its summary.

Every mode runs on the same loaded models, interleaved per prompt, so drift on a noisy
machine hits every mode alike.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from ..errors import SpecmlxError
from ..loading import Model
from ..settings import check_max_tokens
from .machine import (
    cpu_times,
    describe_model,
    load_average,
    machine_info,
    process_memory,
    steal_share,
)
from .modes import Mode, schedule
from .record import RunRecord
from .result import SCHEMA
from .runners import RUNNERS, encode
from .suite import Prompt
from .summary import compare_to_target, summarize

WARMUP_TEXT = "Write one short sentence about the sea."
# A block (one prompt's runs in every mode) during which the hypervisor took more than this
# share of the CPUs' time is timed again, up to RETIMES times: on a shared VM a run that
# loses CPUs to steal slows by more than runs without it vary, so one such block would move a
# prompt's ratio more than the modes being compared do (bench/results/ARCHIVE.md,
# `auto-prose-int4-30`).
STEAL_LIMIT = 0.02
RETIMES = 2


def warm_up(
    target: Model,
    draft: Model | None,
    modes: list[Mode],
    temperatures: list[float],
    seed: int,
    progress: Callable[[dict], None],
    runners: dict[str, Callable[..., RunRecord]],
) -> list[dict]:
    """Every mode once, untimed, greedy and sampled, on a short prompt: first calls read
    lazy weights from disk and build kernels, and none of that is charged to a timed run."""
    warm_ids = encode(target, WARMUP_TEXT, chat_template=False)
    kinds = sorted({0.0 if t == 0 else 1.0 for t in temperatures})
    plan = [(t, m) for t in kinds for m in modes]
    warmups = []
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
        g = mode.gamma if isinstance(mode.gamma, int) else 4  # auto: a few rounds' worth
        r = runners[mode.engine](target, draft, warm_ids, mode, temp, g + 2, seed)
        warmups.append(
            {"mode": mode.name, "temperature": temp, "wall_s": r.wall_s, "ttft_s": r.ttft_s}
        )
    return warmups


def run_bench(
    target: Model,
    draft: Model | None,
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
    `progress` is called before each run with {phase: "run", index, total, prompt,
    prompts, mode, temperature, elapsed_s, eta_s, records, retime} (retime: 0, or which
    timing again of its block this is), and before a block is timed again with {phase:
    "retime", first, last, total, steal, limit, retime, retimes} (the block's run indices,
    the worst share of the CPUs the hypervisor took during it). The result holds every
    raw record, the summary rows, the settings and the machine.
    """
    check_max_tokens(max_tokens)
    if repeat < 1:
        raise SpecmlxError(f"--repeat must be >= 1, got {repeat}")
    if any(m.speculative for m in modes) and draft is None:
        raise SpecmlxError("speculative modes need a draft model; pass --draft")
    started = time.time()
    machine = machine_info()
    ids_of = {p.id: encode(target, p.text, chat_template) for p in prompts}
    position = {p.id: i for i, p in enumerate(prompts)}

    warmups = warm_up(target, draft, modes, temperatures, seed, progress, runners) if warmup else []

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
            # Said before the block's runs start again, so that their progress does not
            # read as the same runs reported twice.
            progress(
                {
                    "phase": "retime",
                    "first": start,
                    "last": start + len(block) - 1,
                    "total": len(order),
                    "steal": max(r.steal or 0.0 for r in timed),
                    "limit": STEAL_LIMIT,
                    "retime": attempt + 1,
                    "retimes": RETIMES,
                }
            )
        records += timed
        for prompt, temp, mode in block:
            done[(prompt.id, temp, mode.name)] += 1
    compare_to_target(records)
    rss, rss_peak = process_memory()
    return {
        "schema": SCHEMA,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": time.time() - started,
        "machine": {**machine, "load_average_end": load_average()},
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
