"""What quantize reads from: a checkpoint opened for streaming, whatever its format.

Its own module so that each format's reader (gguf.py, the safetensors one in quantize.py)
and the quantizer can share the types without importing one another.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx


@dataclass
class SourceTensor:
    """One tensor of the source under its mlx-lm name, readable a range of rows at a time."""

    shape: tuple[int, ...]
    nbytes: int  # bytes it occupies in the source (drives the progress bar)
    read_rows: Callable[[int, int], mx.array]  # rows [start, stop) as a floating array
    row_align: int = 1  # reads must start and stop on multiples of this (GGUF head blocks)
    # The whole tensor as a lazy MLX array (safetensors sources), for a sanitize that
    # computes from it (quantize.through); nothing is read until it is evaluated.
    array: Callable[[], mx.array] | None = None


@dataclass
class Source:
    """A checkpoint opened for streaming: config, tensors by mlx-lm name, tokenizer."""

    location: str  # as the user gave it
    path: Path  # the file or directory it resolved to
    format: str  # "safetensors" or "gguf"
    config: dict
    tensors: dict[str, SourceTensor]
    fingerprint: str  # sha256 of what identifies the source (see `fingerprint_of`)
    fingerprint_of: str
    write_tokenizer: Callable[[Path], None]
