"""What `generate` and `chat` print about a run: cold start, models, memory, per-reply stats.

Every number comes from Stats, the load timings or the allocator; nothing is re-derived here.
"""

from __future__ import annotations

import resource
import sys

from ..wording import counted, human_bytes
from .started import STARTED_AT


def process_start() -> float:
    """Wall-clock time at which the interpreter began (not a shell that exec'd it: see
    started.py)."""
    return STARTED_AT


def weight_bytes(model) -> int:
    """Bytes the model's parameters occupy in memory (after the dtype policy)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.module.parameters()))


def memory() -> dict:
    """Peak memory so far: MLX's allocator, and the process's maximum resident set."""
    import mlx.core as mx

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "peak_mlx_bytes": mx.get_peak_memory(),
        # ru_maxrss is in KB on Linux and in bytes on macOS
        "max_rss_bytes": rss if sys.platform == "darwin" else rss * 1024,
    }


def memory_line() -> str:
    """The two peaks, each named for what it counts: they differ by design (weights mapped
    from their files are resident but never allocated by MLX), not by a measuring error."""
    mem = memory()
    return (
        f"peak memory: MLX arrays {human_bytes(mem['peak_mlx_bytes'])} (what MLX allocated; "
        f"mapped weights are not) · process {human_bytes(mem['max_rss_bytes'])} "
        "(max RSS: all resident memory, mapped weights included)"
    )


def startup_lines(target, draft, timings: dict, backend: str) -> list[str]:
    """The start-up report: cold start and its parts, the model pair (or the target and
    its head), backend, memory."""
    from ..heads import is_head

    t = timings
    lines = [
        f"ready in {t['cold_start_s']:.2f} s (interpreter {t['before_main_s']:.2f} · "
        f"imports {t['import_s']:.2f} · weights {t['weights_s']:.2f} · "
        f"tokenizer {t['tokenizer_s']:.2f}) on {backend}",
        f"target {target.describe()} {human_bytes(weight_bytes(target))}",
    ]
    if draft is not None:
        lines.append(f"draft  {draft.describe()} {human_bytes(weight_bytes(draft))}")
    else:
        lines.append("draft  none (plain decoding)")
    if is_head(draft):  # a head reads no weights file of its own kind, nor has a tokenizer
        draft = None
    lines.append(f"read   {reading_line(target, draft)}")
    lines.append(f"tok    {tokenizer_line(target, draft)}")
    if backend == "cpu":
        from ..cpu import describe

        lines.append(f"cpu    {cpu_path(target, draft)}")
        lines.append(f"int4   {describe()}")
    lines.append(memory_line())
    return lines


def reading_line(target, draft) -> str:
    """How each model's weights were read: mapped in place, or copied by mx.load, and why."""
    from ..loading import describe_reading

    models = [("target", target), ("draft", draft)]
    return " · ".join(
        f"{role} {describe_reading(m.info['reading'])}" for role, m in models if m is not None
    )


def tokenizer_line(target, draft) -> str:
    """Which tokenizer each model has: specmlx's over `tokenizers`, or transformers' (and
    why: the checkpoint is one the light tokenizer does not follow exactly)."""
    models = [("target", target), ("draft", draft)]
    return " · ".join(f"{role} {m.info['tokenizer']}" for role, m in models if m is not None)


def cpu_path(target, draft) -> str:
    """Weights mode per model and the BLAS under MLX's dense matmuls (see specmlx.cpu.blas)."""
    from ..cpu.blas import blas_info, describe

    info = blas_info()
    models = [("target", target), ("draft", draft)]
    weights = ", ".join(f"{role} {m.weights}" for role, m in models if m is not None)
    blas = describe(info)
    if info.get("threads_why"):
        blas += f" ({info['threads_why']})"
    elif info.get("why_not_fast"):
        blas += f" ({info['why_not_fast']})"
    return f"weights {weights} · BLAS {blas}"


def cpu_tag(target) -> str:
    """What the target's matmuls run on, in a few words, for the per-reply stats line: INT4
    weights on specmlx's native kernel (or MLX's quantized matmul), the rest on the BLAS."""
    from ..cpu import blas_info, native

    if target.weights == "int4":
        if native.available():
            return f"int4 weights on the native kernel×{native.threads()}"
        return "int4 weights on mx.quantized_matmul"
    info = blas_info()
    blas = info["name"].split(" (")[0].split()[0]  # "OpenBLAS", "reference", "Accelerate"
    return f"{target.weights} weights on {blas}×{info['threads'] or 1}"


def gamma_shown(stats) -> str:
    """γ as asked; for auto, the γ its drafting rounds used most, in how many of the rounds
    (the rest were plain), and how many the draft's own confidence cut short."""
    drafting = {g: n for g, n in stats.rounds_by_gamma.items() if g > 0}
    if stats.gamma == "auto" and drafting:
        rounds = sum(stats.rounds_by_gamma.values())
        cut = f", {stats.cut_short} cut short" if stats.cut_short else ""
        usual = max(drafting, key=drafting.get)
        drafted = sum(drafting.values())
        return f"auto→{usual} ({drafted} of {counted(rounds, 'round')} drafted{cut})"
    return str(stats.gamma)


def plain_note(stats, has_draft: bool, draft_on: bool = True) -> str:
    """Why a reply ran without drafts: none loaded (`has_draft`: a draft model was), turned
    off, or auto's choice and the measured costs it rested on."""
    from ..drafters import kind

    if not draft_on:
        return "plain decoding (draft off)"
    if not stats.drafters:
        return "plain decoding (no draft)"
    if stats.gamma == 0:
        return "plain decoding (γ 0)"
    if stats.gamma != "auto":
        return "draft idle: too few tokens to draft"
    kinds = [kind(name) for name in stats.drafters]
    if all(k is not None and k.free for k in kinds):
        why = "; ".join(k.idle for k in kinds)
        return f"draft idle: {why}" + ("" if has_draft else " (no draft model)")
    if stats.draft_ratio is None:
        return "draft idle: auto kept plain decoding while it measured the passes' costs"
    why = f"a draft pass costs {stats.draft_ratio:.2f} of a target pass here"
    if stats.forecast_alpha is not None:
        why += f", drafts forecast to pass {stats.forecast_alpha:.2f} of the time"
    return f"draft idle: auto kept plain decoding: {why}"


def stats_line(stats, plain: str = "plain decoding", stopped: bool = False) -> str:
    """One line per reply: tokens, speed, TTFT, prefill, and the speculative numbers;
    `plain` says why, when no draft ran (see plain_note); `stopped`: at a stop string."""
    parts = [
        counted(stats.tokens, "token"),
        f"{stats.decode_tps:.1f} tok/s",
        f"TTFT {stats.ttft:.2f} s",
        f"prefill {stats.prefill_tokens} new of {counted(stats.prompt_tokens, 'prompt token')}",
    ]
    if stats.drafted:
        parts += [
            f"α {stats.acceptance:.2f}",
            f"τ {stats.tokens_per_pass:.2f}",
            f"γ {gamma_shown(stats)}",
            f"verify/draft {stats.verify_time:.2f}/{stats.draft_time:.2f} s",
        ]
        if stats.tree_rounds:  # how many rounds drafted trees, and how large
            mean = stats.tree_nodes / stats.tree_rounds
            parts.append(f"trees in {counted(stats.tree_rounds, 'round')} ({mean:.1f} nodes)")
    else:
        parts.append(plain)
    if stopped:
        parts.append("stopped at --stop")
    elif stats.finish_reason == "length":
        parts.append("hit max tokens")
    return " · ".join(parts)
