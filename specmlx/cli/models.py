"""`specmlx models`: what is on disk, which models can draft for which; `models rm NAME`."""

from __future__ import annotations

import json
import shutil

import typer
from rich.console import Console
from rich.table import Table

from .. import inventory
from . import app

models_app = typer.Typer(
    help="List local models (specmlx's and the hub cache's); same tokenizer group = a pair.",
    invoke_without_command=True,
    no_args_is_help=False,
    rich_markup_mode=None,
)
app.add_typer(models_app, name="models")


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
    if not entries:
        out.print(f"no models in {inventory.models_dir()} or the hub cache", markup=False)
        return
    table = Table(box=None, pad_edge=False)  # no rules: the width is left to the names
    table.add_column("name", overflow="fold")  # folded, never cut short: rm and --draft take it
    for column in ("where", "type", "size", "quantization", "tokenizer"):
        table.add_column(column, no_wrap=True)
    for e in entries:
        table.add_row(
            e.name,
            e.where,
            e.model_type or "-",
            inventory.human_size(e.size_bytes),
            e.quantization,
            e.tokenizer or "-",
        )
    out.print(table)


@models_app.command("rm")
def rm(
    name: str = typer.Argument(..., help="A directory name as `specmlx models` lists it."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask first."),
) -> None:
    """Delete one model directory from $SPECMLX_HOME/models."""
    path = inventory.removable(name)
    size = inventory.human_size(inventory.directory_size(path))
    if not yes and not confirmed(f"remove {path} ({size})?"):
        print("nothing removed")
        raise typer.Exit(1)
    shutil.rmtree(path)
    print(f"removed {path} ({size})")


def confirmed(question: str) -> bool:
    """The user's yes; no answer (stdin closed, Ctrl-C at the prompt) is a no, since
    nothing has been removed yet."""
    try:
        return typer.confirm(question, default=False, err=True)
    except typer.Abort:
        return False
