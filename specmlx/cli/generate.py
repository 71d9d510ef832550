"""`specmlx generate`: one prompt in, text out; scriptable with --json."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer
from rich.console import Console

from . import app, options


def stats_line(stats, backend: str) -> str:
    """One line of numbers, all read from Stats (never recomputed here)."""
    parts = [
        f"{stats.tokens} tokens",
        f"{stats.decode_tps:.1f} tok/s",
        f"prefill {stats.prompt_tokens} tok in {stats.prefill_time:.2f} s",
        f"TTFT {stats.ttft:.2f} s",
    ]
    if stats.drafted:
        parts += [
            f"α {stats.acceptance:.2f}",
            f"τ {stats.tokens_per_pass:.2f}",
            f"γ {stats.gamma}",
            f"draft/verify {stats.draft_time:.2f}/{stats.verify_time:.2f} s",
        ]
    parts.append(backend)
    return " · ".join(parts)


@app.command()
def generate(
    prompt: str = typer.Option(None, "--prompt", "-p", help="Prompt text."),
    prompt_file: Path = typer.Option(
        None, "--prompt-file", "-f", help="Read the prompt (- = stdin)."
    ),
    model: str = options.Model,
    draft: str = options.Draft,
    no_draft: bool = options.NoDraft,
    max_tokens: int = options.MaxTokens,
    temperature: float = options.Temperature,
    top_p: float = options.TopP,
    top_k: int = options.TopK,
    gamma: str = options.Gamma,
    seed: int = options.Seed,
    dtype: str = options.Dtype,
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of text."),
) -> None:
    """Generate a reply to one prompt, speculatively when a draft is given."""
    from ..loading import backend
    from ..sampling import SamplingParams
    from ..speculative import generate as run

    t_start = time.perf_counter()
    err = Console(stderr=True, soft_wrap=True)
    SamplingParams(temperature, top_p, top_k)  # validate before loading anything
    num_draft = options.parse_gamma(gamma)
    if max_tokens < 1:
        raise options.SpecmlxError(f"--max-tokens must be >= 1, got {max_tokens}")
    text = options.read_prompt(prompt, prompt_file)
    log = (lambda msg: None) if as_json else (lambda msg: err.print(f"[dim]{msg}[/dim]"))
    target, drafter = options.load_pair(model, draft, no_draft, dtype, log)
    load_time = time.perf_counter() - t_start
    tokenizer = target.tokenizer
    if not raw and getattr(tokenizer, "has_chat_template", False):
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    else:
        ids = text
    gen = run(
        target,
        ids,
        draft=drafter,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        num_draft=num_draft,
        seed=seed,
    )
    for step in gen:
        if not as_json:
            sys.stdout.write(step.text)
            sys.stdout.flush()
    stats = gen.stats
    if as_json:
        out = {
            "text": gen.text,
            "tokens": gen.tokens,
            "model": str(target.path),
            "draft": str(drafter.path) if drafter else None,
            "settings": {
                "max_tokens": max_tokens,
                "temperature": temperature,
                "top_p": top_p,
                "top_k": top_k,
                "gamma": num_draft,
                "seed": seed,
                "dtype": target.dtype,
                "backend": backend(),
            },
            "stats": stats.to_dict(),
            "timings": {
                "load_s": load_time,
                "prefill_s": stats.prefill_time,
                "ttft_s": stats.ttft,
                "draft_s": stats.draft_time,
                "verify_s": stats.verify_time,
                "decode_s": stats.decode_time,
            },
        }
        print(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        err.print(f"[dim]{stats_line(stats, backend())} · load {load_time:.2f} s[/dim]")
