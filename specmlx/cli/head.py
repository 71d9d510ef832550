"""`specmlx head train`: a feature head trained on the target's own features (the work is
specmlx.heads.train's; this draws its progress and says what came of it)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from ..errors import SpecmlxError
from . import app
from .options import seed_in_range

head_app = typer.Typer(
    help="Feature heads: drafters that read the target's own hidden states (EAGLE, MTP).",
    no_args_is_help=True,
)
app.add_typer(head_app, name="head")

# The defaults are heads.train.Settings' (not imported here: it imports mlx, which must
# come after the fast BLAS is loaded); a test checks that the two agree.
STEPS, MINUTES, SEQ_LEN, BATCH, LR, HELD_OUT, MAX_TOKENS = 2000, 25.0, 256, 4, 3e-4, 0.05, 100_000
STAGES = {"answering": "answering prompts", "caching": "caching features", "training": "training"}


@head_app.command()
def train(
    ctx: typer.Context,
    target: str = typer.Argument(..., metavar="TARGET", help="Target model: directory or hub id."),
    more: list[str] = typer.Argument(
        None,
        metavar="PATH",
        help="More data paths (so that a glob the shell expanded after --data works).",
        show_default=False,
    ),
    data: list[str] = typer.Option(
        [],
        "--data",
        metavar="PATH",
        help="Text or code files, folders (walked, hidden ones and binaries skipped), globs, "
        'or a JSONL of prompts ({"prompt": ...} or {"turns": [...]}) the target answers '
        "itself first. Repeatable.",
        show_default=False,
    ),
    out: Path = typer.Option(
        ..., "--out", "-o", help="Head directory to write (its work dir is OUT.partial)."
    ),
    steps: int = typer.Option(STEPS, "--steps", help="Training steps."),
    minutes: float = typer.Option(
        MINUTES, "--minutes", help="Stop training after this long (a rerun resumes)."
    ),
    seq_len: int = typer.Option(SEQ_LEN, "--seq-len", help="Tokens per training sequence."),
    batch: int = typer.Option(BATCH, "--batch", help="Sequences per step."),
    lr: float = typer.Option(LR, "--lr", help="Peak learning rate (warmup, then cosine)."),
    held_out: float = typer.Option(
        HELD_OUT, "--held-out", help="Fraction of the tokens held out (by document) to measure α."
    ),
    max_tokens: int = typer.Option(MAX_TOKENS, "--max-tokens", help="Tokens of data at most."),
    resume: bool | None = typer.Option(
        None,
        "--resume/--no-resume",
        help="Resume from OUT.partial (default: where it holds this target, data and settings).",
        show_default=False,
    ),
    seed: int = typer.Option(
        0, "--seed", "-s", callback=seed_in_range, help="Seed of the head's start and data order."
    ),
) -> None:
    """Train a feature head for TARGET on its own features (self-distillation)."""
    from ..convert.output import check_writable
    from ..cpu import blas
    from ..heads import corpus, what_is
    from ..heads import train as training

    settings = training.Settings(
        steps=steps,
        minutes=minutes,
        seq_len=seq_len,
        batch=batch,
        lr=lr,
        held_out=held_out,
        max_tokens=max_tokens,
        seed=seed,
    )
    training.check_settings(settings)
    out = out.expanduser()
    check_writable(out)
    if (out.exists() or out.is_symlink()) and what_is(out) != "head":
        raise SpecmlxError(f"{out} exists and is not a head; pick another -o or remove it")
    sources = corpus.find_sources([*data, *(more or [])], out)
    # The training's float32 matmuls run on the BLAS that libmlx binds when it loads
    # (specmlx/cpu/blas.py): in-process where it loads there, else by re-executing once
    # with it preloaded (a wheel's OpenBLAS that needs a libgfortran the system lacks):
    # MLX's bundled reference BLAS is tens of times slower. Only once the input is known
    # good: a re-exec starts the command again, in place of whatever ran it.
    blas.setup_cli(bool((ctx.parent.params if ctx.parent else {}).get("no_fast_blas")))
    why_slow = blas.blas_info().get("why_not_fast", "")

    err = Console(stderr=True, soft_wrap=True)
    log = lambda text: err.print(text, markup=False, highlight=False)  # noqa: E731
    from ..loading import backend
    from .options import load_pair

    model, _ = load_pair(target, None, True, "auto", log)
    log(f"data: {sources.describe()}")
    if backend() == "cpu":
        log(f"training on the CPU, matmuls on {blas.describe()}" + slow_hint(why_slow))
    with Bar(err, settings) as shown:
        try:
            result = training.run(model, sources, out, settings, resume, shown.report)
        except KeyboardInterrupt:
            shown.stop()
            log(f"progress is kept in {corpus.work_dir(out)}: run the same command to resume")
            raise
    outcome = result.outcome
    if outcome.stopped == "interrupted":
        log(
            f"stopped at step {outcome.step} of {settings.steps}; the checkpoint is in "
            f"{result.work}: run the same command to resume"
        )
        raise typer.Exit(130)
    say_result(err, result, settings)


def slow_hint(why: str) -> str:
    """Where the BLAS is MLX's bundled one, why and how to get a fast one."""
    from ..cpu import blas

    if blas.fast_blas_active():
        return ""
    return f" (slow: {why})" if why else " (slow)"


class Bar:
    """A rich bar per stage on an interactive stderr, drawn from a heads.train.Report
    (`report`); elsewhere a line at each held-out estimate, so a log shows how it goes."""

    def __init__(self, console: Console, settings):
        from ..heads.corpus import Report

        self.console, self.settings = console, settings
        self.progress = None
        self.tasks: dict[str, int] = {}
        self.report = Report(note=self.note, progress=self.update)

    def __enter__(self) -> Bar:
        if self.console.is_interactive:
            self.progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
                transient=True,
            )
            self.progress.start()
        return self

    def note(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False)

    def update(self, stage: str, done: int, total: int, **fields) -> None:
        info = ""
        if "loss" in fields:
            alpha = "/".join(f"{a:.2f}" for a in fields["alpha"])
            at = fields["alpha_step"]
            info = f"loss {fields['loss']:.3f} · held-out α {alpha} at step {at}"
            if self.progress is None and at == done:  # a log gets a line per estimate
                self.note(f"step {done}/{total}: {info}")
        if self.progress is None:
            return
        if stage not in self.tasks:  # a stage begins: the one before is done
            for task in self.tasks.values():
                self.progress.remove_task(task)
            self.tasks = {stage: self.progress.add_task(STAGES[stage], total=total, info=info)}
        self.progress.update(self.tasks[stage], completed=done, total=total, info=info)

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()

    def __exit__(self, *_exc) -> None:
        self.stop()


def say_result(err: Console, result, settings) -> None:
    """What was written (stderr), and the table of held-out acceptance (stdout)."""
    trained, outcome = result.trained, result.outcome
    tokens = trained["tokens"]
    err.print(
        f"wrote {result.out}: {outcome.step} steps on {tokens['train']:,} tokens "
        f"in {trained['seconds']:.0f} s; curve in {result.out / 'training_curve.csv'}",
        markup=False,
        highlight=False,
    )
    if outcome.stopped == "minutes":
        err.print(
            f"stopped by --minutes {settings.minutes:g} at step {outcome.step} of "
            f"{settings.steps}: run the same command to train on from {result.work} "
            "(or remove it)",
            markup=False,
            highlight=False,
        )
    table = Table()
    table.add_column("draft position", justify="right")
    table.add_column(f"greedy α, held out ({tokens['held_out']:,} tokens)", justify="right")
    for position, alpha in trained["held_out_alpha"].items():
        table.add_row(position, f"{alpha:.3f}")
    Console(file=sys.stdout).print(table)
