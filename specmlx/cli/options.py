"""Options shared by `generate` and `chat`, declared once so flags never drift apart."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from ..errors import SpecmlxError

Model = typer.Option(None, "--model", "-m", help="Target model: directory or hub id.")
Draft = typer.Option(None, "--draft", "-d", help="Draft model: directory or hub id.")
NoDraft = typer.Option(False, "--no-draft", help="Plain decoding of the target (the baseline).")
MaxTokens = typer.Option(256, "--max-tokens", "-n", help="Maximum tokens to generate.")
Temperature = typer.Option(0.0, "--temperature", "-t", help="0 = greedy.")
TopP = typer.Option(1.0, "--top-p", help="Nucleus sampling mass, in (0, 1].")
TopK = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = all).")
Gamma = typer.Option("4", "--gamma", "-g", help="Draft tokens per round (integer >= 0).")
Seed = typer.Option(0, "--seed", "-s", help="Random seed; the same seed gives the same output.")
Dtype = typer.Option("auto", "--dtype", help="auto (float32 on CPU), float32, float16, bfloat16.")


def parse_gamma(text: str) -> int:
    try:
        gamma = int(text)
    except ValueError:
        raise SpecmlxError(f"--gamma must be an integer >= 0, got {text!r}") from None
    if gamma < 0:
        raise SpecmlxError(f"--gamma must be >= 0, got {gamma}")
    return gamma


def load_pair(model: str | None, draft: str | None, no_draft: bool, dtype: str, log):
    """Load target and draft (None with --no-draft); the tiny demo pair if none is named."""
    from ..loading import check_pair, load
    from ..models import tiny_demo_pair

    if model is None:
        target_path, draft_path = tiny_demo_pair(log)
        log("no --model given: using the tiny demo pair (random weights, so its text is noise)")
        model = str(target_path)
        draft = draft or str(draft_path)
    target = load(model, dtype=dtype)
    if no_draft or draft is None:
        return target, None
    drafter = load(draft, dtype=dtype)
    check_pair(target, drafter)
    return target, drafter


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    if prompt is not None and prompt_file is not None:
        raise SpecmlxError("give --prompt or --prompt-file, not both")
    if prompt_file is not None:
        if str(prompt_file) == "-":
            return sys.stdin.read()
        if not prompt_file.is_file():
            raise SpecmlxError(f"prompt file {prompt_file} does not exist")
        return prompt_file.read_text()
    if prompt is None:
        raise SpecmlxError("no prompt: pass --prompt TEXT or --prompt-file FILE ('-' for stdin)")
    return prompt
