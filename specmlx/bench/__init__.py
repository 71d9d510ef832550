"""Benchmark: target alone vs specmlx speculative vs mlx-lm's speculative, in one run.

Every mode runs on the same loaded models, interleaved per prompt (all modes for one
prompt back to back, the order rotated from prompt to prompt), so drift on a noisy
machine hits every mode alike. Speedups are computed pair by pair: a mode's decode
tokens/s on a prompt divided by the target alone's on the same prompt and temperature,
then summarised as median, min and max over prompts (Spec-Bench's total-tokens ÷
total-time ratio is reported beside it).

suite     the prompt suites (packaged), their tune/held-out split, the selection
modes     the modes compared, parsed from flags, and their interleaved order
runners   one timed generation per engine (specmlx, mlx-lm) as a RunRecord
record    RunRecord: one timed generation's raw figures
machine   where it ran: CPU, versions, BLAS, models, memory, stolen CPU time
run       the whole run: warm-up, timed blocks (retimed on steal), the result
summary   greedy check, pairwise ratios, per-category medians
result    the result file's schema tag and reading one back
plot      the matplotlib plot of a result

This package returns data; the CLI (specmlx.cli.bench) renders it.
"""

from .modes import (
    TARGET,
    Mode,
    build_modes,
    parse_draft_modes,
    parse_gammas,
    parse_samplings,
    parse_temperatures,
    schedule,
)
from .plot import plot
from .record import RunRecord
from .result import SCHEMA, read_result
from .run import run_bench
from .runners import encode, mlx_lm_rounds
from .suite import MT_BENCH, Prompt, read_suite, select_prompts
from .summary import compare_to_target, pairwise_ratios, summarize

__all__ = [
    "MT_BENCH",
    "SCHEMA",
    "TARGET",
    "Mode",
    "Prompt",
    "RunRecord",
    "build_modes",
    "compare_to_target",
    "encode",
    "mlx_lm_rounds",
    "pairwise_ratios",
    "parse_draft_modes",
    "parse_samplings",
    "parse_gammas",
    "parse_temperatures",
    "plot",
    "read_result",
    "read_suite",
    "run_bench",
    "schedule",
    "select_prompts",
    "summarize",
]
