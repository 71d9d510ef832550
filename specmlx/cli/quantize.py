"""`specmlx quantize`: a HF directory, hub id or .gguf file → an MLX quantized directory."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.text import Text

from ..errors import SpecmlxError
from ..wording import counted, human_bytes
from . import app, progress


def format_line(bits: int, group_size: int, embed_bits: int) -> str:
    """The format written, as asked (the converter refuses what it cannot write)."""
    embeddings = "unquantized" if embed_bits == 16 else f"INT{embed_bits}"
    line = f"INT{bits} g{group_size}, embedding and head {embeddings}"
    if bits == 4:  # the only width whose linear layers specmlx's CPU kernel takes on
        line += "; on CPU, specmlx's native INT4 kernel runs it"
    return line


def summary_line(summary) -> str:
    parts = [
        f"{summary.parameters / 1e6:.1f} M parameters",
        f"{human_bytes(summary.size_bytes)} on disk",
        f"{summary.bits_per_weight:.3f} bits/weight",
        counted(summary.shards, "shard"),
        f"{summary.seconds:.1f} s",
    ]
    return " · ".join(parts)


@app.command()
def quantize(
    src: str = typer.Argument(..., help="HF safetensors directory, hub id, or .gguf file."),
    out: Path = typer.Option(
        ..., "--out", "-o", help="Output directory (refused if it exists, unless --force)."
    ),
    bits: int = typer.Option(4, "--bits", "-b", help="Bits per weight: 2, 3, 4, 6 or 8."),
    group_size: int = typer.Option(64, "--group-size", "-g", help="Weights per scale: 32/64/128."),
    embed_bits: int = typer.Option(
        6, "--embed-bits", help="Bits for the embedding and output head (16 = unquantized)."
    ),
    dtype: str = typer.Option(
        None,
        "--dtype",
        help="Scales and unquantized tensors: float16, bfloat16 or float32 "
        "(default: the source's 16-bit type, else float16).",
    ),
    force: bool = typer.Option(False, "--force", help="Replace OUT if it exists."),
) -> None:
    """Quantize a checkpoint into an MLX directory that specmlx and mlx-lm both load."""
    from ..convert import quantize as run

    # At once, not after reading the source (a download, a GGUF header): convert checks
    # this too, but only once it has opened the source.
    if (out.expanduser().exists() or out.expanduser().is_symlink()) and not force:
        raise SpecmlxError(f"{out} already exists; pass --force to replace it")
    console = Console(stderr=True, soft_wrap=True)
    from ..heads import what_is

    source = Path(src).expanduser()
    if source.is_dir() and what_is(source) == "eagle3":  # a head: its own small layout
        from ..heads.eagle3 import quantize_eagle3

        quantize_eagle3(source, out.expanduser(), group_size, bits)
        console.print(
            Text.assemble((f"wrote {out}", "green"), f" (EAGLE-3 head, INT{bits} g{group_size})")
        )
        return
    with progress.conversion(console) as on_progress:
        summary = run(src, out, bits, group_size, embed_bits, dtype, force, on_progress=on_progress)
    # Text, not markup: a path or tensor name may hold [brackets] that markup would eat.
    written = f" ({format_line(bits, group_size, embed_bits)}): {summary_line(summary)}"
    console.print(Text.assemble((f"wrote {summary.out}", "green"), written))
    if summary.unquantized:
        console.print(f"left unquantized: {', '.join(summary.unquantized)}", markup=False)
    from ..heads.mtp import MTP_FILE

    if (summary.out / MTP_FILE).is_file():
        console.print(f"kept its MTP layer ({MTP_FILE}): generate drafts with it unless --draft")
