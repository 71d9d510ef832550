"""`specmlx generate`: one prompt in, text out; scriptable with --json or --jsonl."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import typer
from rich.console import Console

from ..errors import SpecmlxError
from . import app, options, progress, ranks, report, stream


@app.command()
def generate(
    prompt_arg: str = typer.Argument(
        None,
        metavar="PROMPT",
        help="Prompt text (or --prompt / --prompt-file).",
        show_default=False,
    ),
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
    draft_mode: str | None = options.DraftMode,
    sampling: str | None = options.Sampling,
    tree: str = options.Tree,
    seed: int = options.Seed,
    dtype: str = options.Dtype,
    cpu_weights: str = options.CpuWeights,
    shard: str = options.Shard,
    system: str = options.System,
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of text."),
    as_jsonl: bool = typer.Option(
        False,
        "--jsonl",
        help='Stream JSON lines: one per token, {"token", "text", "from_draft"} ("text" is '
        'what the token adds, "" while held back; a last piece of text comes with "token" '
        'null), then one with "done": true and what --json prints.',
    ),
    stop: list[str] = options.Stop,
    quiet: bool = options.Quiet,
    verbose: bool = options.Verbose,
) -> None:
    """Generate a reply to one prompt, speculatively when a draft is given."""
    num_draft = options.check_settings(
        max_tokens, temperature, top_p, top_k, gamma, draft_mode, sampling, tree
    )
    options.check_quiet_verbose(quiet, verbose)
    if as_json and as_jsonl:
        raise SpecmlxError("give --json or --jsonl, not both")
    stops = stream.check_stops(stop)
    scripted = as_json or as_jsonl
    world = ranks.start(shard)  # alone: None; on several ranks, rank 0 reads and prints
    from ..distributed import from_leader

    text = from_leader(lambda: options.read_prompt(prompt, prompt_file, prompt_arg), world)
    if system is not None:
        system = options.command_line_text(system, "--system")
    err = Console(stderr=True, soft_wrap=True, highlight=False)

    def log(msg: str) -> None:
        if not (scripted or quiet):  # plain text: rich markup would eat anything in [brackets]
            err.print(msg, style="dim", markup=False)

    def detail(msg: str) -> None:  # --verbose: said even with --json
        err.print(msg, style="dim", markup=False)

    target, drafter, timings = options.load_timed(
        model, draft, no_draft, dtype, log, cpu_weights, quiet, world, shard
    )

    from ..cpu import blas_info
    from ..engine import encode_prompt
    from ..engine import generate as run
    from ..loading import backend

    if not scripted:
        for line in report.startup_lines(target, drafter, timings, backend()):
            log(line)
    tokenizer = target.tokenizer
    # transformers warns of a prompt longer than the model's context on its own; the
    # check below says so in one line, so its warning would only be a second.
    transformers_log = logging.getLogger("transformers")
    level = transformers_log.level
    transformers_log.setLevel(logging.ERROR)
    try:
        if not raw and getattr(tokenizer, "has_chat_template", False):
            messages = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": text})
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        else:
            ids = encode_prompt(target, text)
    finally:
        transformers_log.setLevel(level)
    # As chat does: past its context a model's positions are ones it never learned, and
    # a long prompt would otherwise be prefilled in full before anything was said.
    limit = target.config.get("max_position_embeddings")
    room = limit - len(ids) if limit else max_tokens
    if room < 1:
        raise SpecmlxError(
            f"the prompt is {len(ids)} tokens and {target.name} takes {limit}; shorten it"
        )
    with progress.prefill(err, show=not quiet) as on_prefill:
        gen = run(
            target,
            ids,
            num_draft=num_draft,
            draft_mode=draft_mode,
            sampling=sampling,
            tree=tree,
            draft=drafter,
            max_tokens=min(max_tokens, room),
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            on_prefill=on_prefill,
        )
        rounds = stream.round_notes(gen.stats, detail) if verbose else lambda: None
        text_out = ""
        try:
            for step, text in stream.stop_pieces(gen, stops):
                rounds()
                text_out += text
                if as_jsonl:
                    token = None if step is None else step.token
                    from_draft = bool(step and step.from_draft)
                    piece = {"token": token, "text": text, "from_draft": from_draft}
                    if step is not None or text:
                        print(json.dumps(piece, ensure_ascii=False), flush=True)
                elif not as_json:
                    sys.stdout.write(text)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            if text_out and not scripted:  # end the line of text: "interrupted" gets its own
                sys.stdout.write("\n")
                sys.stdout.flush()
            if gen.stats.tokens:  # what was generated is measured: say it, as at the end
                say_stats(log, gen, target, drafter, timings["cold_start_s"])
            raise
        finally:
            gen.close()  # stopped at a stop string: the rest is never decoded
    rounds()
    stopped = stream.reached_stop(gen, stops)
    first_token_s = timings["cold_start_s"] + gen.stats.ttft
    total_s = time.time() - report.process_start()
    stats = gen.stats
    if scripted:
        out = {
            "text": text_out,
            "tokens": gen.tokens,
            "finish_reason": "stop" if stopped else stats.finish_reason,
            "model": str(target.path),
            "draft": str(drafter.path) if drafter else None,
            "settings": {
                "max_tokens": max_tokens,
                "temperature": temperature,
                "top_p": top_p,
                "top_k": top_k,
                "gamma": num_draft,
                "tree": stats.tree,
                "seed": seed,
                "stop": stops,
                "dtype": target.dtype,
                "backend": backend(),
                "cpu_weights": {"target": target.weights, "draft": drafter and drafter.weights},
                "blas": blas_info(),
            },
            "stats": stats.to_dict(),
            "timings": {
                "load_s": timings["cold_start_s"] - timings["before_main_s"],
                "prefill_s": stats.prefill_time,
                "ttft_s": stats.ttft,
                "draft_s": stats.draft_time,
                "verify_s": stats.verify_time,
                "decode_s": stats.decode_time,
                # the cold start, part by part (process start = interpreter launch)
                "cold_start_s": timings["cold_start_s"],
                "interpreter_s": timings["before_main_s"],
                "import_s": timings["import_s"],
                "tokenizer_s": timings["tokenizer_s"],
                "weights_s": timings["weights_s"],
                "first_forward_s": stats.ttft,  # prefill + first round: the first passes
                "first_token_s": first_token_s,
                "total_s": total_s,
            },
            "memory": report.memory(),
        }
        print(json.dumps({"done": True, **out} if as_jsonl else out, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        say_stats(log, gen, target, drafter, timings["cold_start_s"], stopped)


def say_stats(log, gen, target, drafter, cold_start_s: float, stopped: bool = False) -> None:
    """The reply's stats line and the memory line, through `log`: at the reply's end, or
    after a Ctrl-C, for the tokens it had generated."""
    from ..loading import backend

    cpu = f" · {report.cpu_tag(target)}" if backend() == "cpu" else ""
    line = report.stats_line(gen.stats, report.plain_note(gen.stats, drafter is not None), stopped)
    first_token_s = cold_start_s + gen.stats.ttft
    log(f"{line}{cpu} · first token {first_token_s:.2f} s after start")
    log(report.memory_line())
