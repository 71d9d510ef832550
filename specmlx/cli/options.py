"""Options shared by `generate` and `chat`, declared once so flags never drift apart."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer

from .. import drafters
from ..errors import SpecmlxError
from ..settings import DEFAULT_SAMPLING, MAX_GAMMA, MAX_TREE

Model = typer.Option(
    None, "--model", "-m", help="Target model: directory, hub id, or tiny (random demo pair)."
)
Draft = typer.Option(
    None,
    "--draft",
    "-d",
    help="What drafts: a draft model (directory or hub id), a head (a directory that "
    "`specmlx head train` wrote, or an EAGLE-3 checkpoint), mtp (the MTP layers the target's "
    "own checkpoint ships; the default where it has them), or auto (the smallest local model "
    "with the target's tokenizer; see `specmlx models`).",
)
AUTO_DRAFT = "auto"
NoDraft = typer.Option(False, "--no-draft", help="Plain decoding of the target (the baseline).")
MaxTokens = typer.Option(256, "--max-tokens", "-n", help="Maximum tokens to generate.")
Temperature = typer.Option(0.0, "--temperature", "-t", help="0 = greedy.")
TopP = typer.Option(1.0, "--top-p", help="Nucleus sampling mass, in (0, 1].")
TopK = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = all).")
Gamma = typer.Option(
    "auto",
    "--gamma",
    "-g",
    help=f"Draft tokens per round: an integer from 0 to {MAX_GAMMA}, or auto (chosen each round "
    "from measured costs and acceptance; plain decoding where speculation would lose).",
)
Sampling = typer.Option(
    None,
    "--sampling",
    help="At a temperature above 0, how drafts are judged: rejection (modified rejection "
    "sampling: the most drafts accepted; a seed repeats a reply where the rounds repeat) or "
    "coupled (each position drawn from uniforms keyed by the seed and the position, a draft "
    "passing where it equals the target's own draw: a seed gives one reply, the same as "
    "--no-draft's, whatever the rounds). Default: " + DEFAULT_SAMPLING + ".",
    show_default=False,
)
Tree = typer.Option(
    "auto",
    "--tree",
    help="Trees of drafts (several candidates where the drafter is unsure, verified in one "
    f"pass, exactly at any temperature): auto (with auto gamma, a tree of up to {MAX_TREE} "
    "nodes in the rounds where the measured cost of verifying more tokens and this text's "
    "acceptance make it beat a chain; chains with a fixed gamma), off (chains), or N from 2 "
    f"to {MAX_TREE} (at most N drafted nodes a round; with a fixed gamma, N nodes up to gamma "
    "deep, shaped by this text's acceptance: a chain where every draft passes).",
)
DraftMode = typer.Option(
    None,
    "--draft-mode",
    help="Where drafts come from: "
    + "; ".join(f"{k.name} ({k.summary})" for k in drafters.kinds())
    + "; auto (each of them that can run, free ones first, the γ policy choosing each round). "
    "Default: auto with a draft model, else none (--no-draft is the target alone).",
    show_default=False,
)


def seed_in_range(seed: int) -> int:
    """The seed's rule (settings.check_seed), checked as the flag is parsed."""
    from ..settings import check_seed

    try:
        return check_seed(seed)
    except SpecmlxError as e:
        raise typer.BadParameter(str(e)) from None


Seed = typer.Option(
    0,
    "--seed",
    "-s",
    callback=seed_in_range,
    help="Random seed: the same seed gives the same output at temperature 0 or with a fixed "
    "--gamma (auto follows timings, so it repeats the distribution, not the sample).",
)
Dtype = typer.Option("auto", "--dtype", help="auto (float32 on CPU), float32, float16, bfloat16.")
CpuWeights = typer.Option(
    "auto",
    "--cpu-weights",
    help="CPU weights: int4 (as stored), fp32 (INT4 expanded at load, on OpenBLAS loaded at "
    "start-up for it), auto (int4 where specmlx's native kernel runs, else fp32 if a fast "
    "BLAS is already loaded and memory allows).",
)
System = typer.Option(None, "--system", help="System prompt (uses the model's chat template).")
Shard = typer.Option(
    "auto",
    "--shard",
    help="Under mlx.launch (several ranks): how the target is split over them: tensor (each "
    "layer's weights cut across the ranks), pipeline (each rank runs a run of layers), or "
    "auto (tensor where mlx-lm's class for the model has it, else pipeline). Drafts run on "
    "rank 0; rank 0 reads and prints.",
)


def check_settings(
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    gamma: str,
    draft_mode: str | None,
    sampling: str | None = None,
    tree: str = "auto",
) -> int | str:
    """Validate the generation flags before anything slow is loaded; return γ parsed."""
    from ..settings import check_settings as check
    from ..settings import parse_tree

    parse_tree(tree)
    return check(max_tokens, temperature, top_p, top_k, gamma, draft_mode, sampling)[1]


def load_pair(
    model: str | None,
    draft: str | None,
    no_draft: bool,
    dtype: str,
    log,
    cpu_weights: str = "auto",
    quiet: bool = False,
    world=None,
    shard: str = "auto",
):
    """Load target and draft (None with --no-draft); the default pair if none is named
    (see specmlx.models.resolve_pair; `--model tiny` is the tiny random demo pair). A
    first use that builds the offline pair shows `specmlx quantize`'s bar on stderr
    while it converts (not with `quiet`). With `world` (several ranks: cli.ranks), the
    target is split over it by `shard`; the draft is whole on every rank, its weights
    read on rank 0 alone (the only one that drafts: specmlx.lockstep)."""
    from rich.console import Console

    from ..loading import check_pair, load
    from ..models import resolve_pair
    from . import progress

    with progress.conversion(Console(stderr=True), "converting to INT4", not quiet) as shown:
        model, draft = resolve_pair(model, draft, log, on_progress=shown)
    if draft == AUTO_DRAFT and not no_draft:
        draft = pick_auto_draft(model, log)
    # Weights are read now (not at the first forward) so "ready" means ready.
    target = load(model, dtype=dtype, lazy=False, cpu_weights=cpu_weights, group=world, shard=shard)
    if no_draft:
        return target, None
    head = load_head(target, draft, log)
    if head is not None or draft is None:
        return target, head
    lazy = world is not None and world.rank() != 0
    drafter = load(draft, dtype=dtype, lazy=lazy, cpu_weights=cpu_weights, tokenizer_from=target)
    check_pair(target, drafter)
    return target, drafter


def load_head(target, draft: str | None, log):
    """The head `--draft` names (a head directory, an EAGLE-3 checkpoint, or mtp), said in
    one line; with no --draft, the MTP layer the target's checkpoint ships, where it has
    one (a drafter that costs no second model); None where it names a draft model, or
    there is none."""
    from .. import heads
    from ..loading import resolve_path

    if draft is None:
        from ..heads.mtp import has_mtp

        if not has_mtp(target.path):
            return None
        draft = heads.MTP
    if draft == heads.MTP:
        from ..heads import mtp

        head = mtp.load_mtp(target)
        log(f"draft: the MTP layers in {target.name}'s checkpoint ({head.describe()})")
        return head
    path = resolve_path(draft)
    found = heads.what_is(path)
    if found == "head":
        from ..heads.store import load_head as load

        head = load(path, target)
    elif found == "eagle3":
        from ..heads.eagle3 import load_eagle3

        head = load_eagle3(path, target)
    else:
        return None
    log(f"draft: {path} is a head: {head.describe()}")
    return head


def pick_auto_draft(model: str, log) -> str | None:
    """--draft auto: the smallest local model that shares the target's tokenizer (None:
    the target decodes alone), said in one line either way."""
    from .. import inventory
    from ..wording import human_bytes

    entries = inventory.list_models()
    # A hub id is looked up in the cache the listing read: auto never goes online.
    hub = {e.name: e.path for e in entries if e.where == inventory.HUB}
    target = hub.get(model) or Path(model)
    picked = inventory.smallest_same_tokenizer(target, entries) if target.is_dir() else None
    if picked is None:
        log("draft auto: no local model has the target's tokenizer; running the target alone")
        return None
    size = human_bytes(picked.size_bytes)
    log(
        f"draft auto: picked {picked.name} ({size}), the smallest local model with the "
        "target's tokenizer"
    )
    return str(picked.path)


def load_timed(
    model: str | None,
    draft: str | None,
    no_draft: bool,
    dtype: str,
    log,
    cpu_weights: str = "auto",
    quiet: bool = False,
    world=None,
    shard: str = "auto",
):
    """load_pair, plus where the cold start went: returns (target, draft, timings).

    timings (seconds): before_main_s (interpreter start and the CLI's own imports),
    import_s (mlx, the engine; transformers only where a tokenizer needs it, and then
    inside tokenizer_s), weights_s (with mlx-lm's model module), tokenizer_s (both models),
    cold_start_s (process start to both models ready).
    """
    from ..cpu import CPU_WEIGHTS
    from .report import process_start

    if cpu_weights not in CPU_WEIGHTS:  # before the slow imports
        raise SpecmlxError(f"--cpu-weights must be one of {', '.join(CPU_WEIGHTS)}")
    t0 = time.perf_counter()
    before_main = time.time() - process_start()
    from .. import engine  # noqa: F401  (mlx and the engine: most of what imports cost)

    import_s = time.perf_counter() - t0
    target, drafter = load_pair(
        model, draft, no_draft, dtype, log, cpu_weights, quiet, world, shard
    )
    loaded = [m for m in (target, drafter) if m is not None]
    timings = {
        "before_main_s": before_main,
        "import_s": import_s,
        "weights_s": sum(m.info.get("weights_s", 0.0) for m in loaded),
        "tokenizer_s": sum(m.info.get("tokenizer_s", 0.0) for m in loaded),
        "cold_start_s": time.time() - process_start(),
    }
    return target, drafter, timings


def read_prompt(prompt: str | None, prompt_file: Path | None, argument: str | None = None) -> str:
    """The prompt from exactly one of: the command's argument, --prompt, --prompt-file."""
    sources = {"an argument": argument, "--prompt": prompt, "--prompt-file": prompt_file}
    given = [name for name, value in sources.items() if value is not None]
    if len(given) > 1:
        raise SpecmlxError(f"give the prompt once, not as {' and '.join(given)}")
    prompt = argument if argument is not None else prompt
    if prompt_file is not None:
        if str(prompt_file) == "-":
            return utf8(sys.stdin.buffer.read(), "the prompt on stdin")
        if prompt_file.is_dir():
            raise SpecmlxError(
                f"prompt file {prompt_file} is a directory; give -f a file (- for stdin)"
            )
        if not prompt_file.exists():
            raise SpecmlxError(f"prompt file {prompt_file} does not exist")
        try:  # not only regular files: -f /dev/stdin or a named pipe reads as well
            data = prompt_file.read_bytes()
        except OSError as e:
            raise SpecmlxError(f"cannot read prompt file {prompt_file}: {e.strerror}") from None
        return utf8(data, f"prompt file {prompt_file}")
    if prompt is None:
        raise SpecmlxError(
            "no prompt: pass it as an argument, --prompt TEXT or --prompt-file FILE ('-' for stdin)"
        )
    return command_line_text(prompt, "the prompt")


def utf8(data: bytes, source: str) -> str:
    """data decoded, or refused in one line: tokenizers take UTF-8 text only."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecmlxError(
            f"{source} is not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start}"
        ) from None


def command_line_text(text: str, source: str) -> str:
    """An argument checked for UTF-8: Python hands on bytes it could not decode from the
    command line as lone surrogates, which the tokenizer rejects with a TypeError."""
    try:
        return utf8(text.encode("utf-8", "surrogateescape"), source)
    except UnicodeEncodeError:  # a surrogate that no undecodable byte stands for
        raise SpecmlxError(f"{source} is not UTF-8 text") from None


Stop = typer.Option(
    None,
    "--stop",
    help="Stop where this text first appears; it is never printed (repeatable).",
)
Quiet = typer.Option(False, "--quiet", "-q", help="No start-up report or stats on stderr.")
Verbose = typer.Option(
    False,
    "--verbose",
    "-v",
    help="Also note each round on stderr: γ used, drafts accepted, draft and verify times.",
)


def check_quiet_verbose(quiet: bool, verbose: bool) -> None:
    if quiet and verbose:
        raise SpecmlxError("give --quiet or --verbose, not both")
