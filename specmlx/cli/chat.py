"""`specmlx chat`: a multi-turn REPL whose models keep their KV caches between turns.

Each turn hands the whole conversation, as token ids, to one Session, which prefills
only what its caches do not hold yet: a turn costs its new tokens (shown after every
reply). Replies go to stdout, everything else to stderr, so a pipe gets just the text.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, fields, replace

from rich.console import Console

from ..errors import SpecmlxError
from ..wording import counted
from . import app, options, progress, ranks, report, stream

HELP = """\
/help                  this list
/reset                 forget the conversation and clear both KV caches
/stats                 totals for this conversation, and since chat started
/set                   show the settings
/set NAME VALUE        NAME: temperature, top_p, top_k, gamma, tree, max_tokens, system
/draft on|off          speculative decoding on or off
/exit                  quit (also /bye, Ctrl-D)
\"\"\"                    start or end a multi-line message
Ctrl-C stops a reply; the conversation keeps what was shown."""

SETTING_NAMES = ("temperature", "top_p", "top_k", "gamma", "tree", "max_tokens", "system")


@dataclass
class Conversation:
    """What the models have seen: chat messages, and the exact token ids they became."""

    system: str | None = None
    messages: list[dict] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # every token fed or emitted, in order
    text: str = ""  # the rendered chat text that `ids` encode; the next turn extends it

    def clear(self) -> None:
        self.messages, self.ids, self.text = [], [], ""


@dataclass
class Settings:
    temperature: float
    top_p: float
    top_k: int
    gamma: int | str
    max_tokens: int
    seed: int
    draft_on: bool
    draft_mode: str = "model"
    sampling: str | None = None  # None: settings.DEFAULT_SAMPLING
    tree: int | str = "auto"  # settings.parse_tree's


@app.command()
def chat(
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
    stop: list[str] = options.Stop,
    quiet: bool = options.Quiet,
    verbose: bool = options.Verbose,
) -> None:
    """Chat with a model, speculatively when a draft is given; /help lists the commands."""
    num_draft = options.check_settings(
        max_tokens, temperature, top_p, top_k, gamma, draft_mode, sampling, tree
    )
    options.check_quiet_verbose(quiet, verbose)
    stops = stream.check_stops(stop)
    system = options.command_line_text(system, "--system") if system else system
    world = ranks.start(shard)  # alone: None; on several ranks, rank 0 reads and prints
    err = Console(stderr=True, soft_wrap=True, highlight=False)
    out = Console(soft_wrap=True, highlight=False)

    def note(msg: str, style: str | None = "dim") -> None:
        err.print(msg, style=style, markup=False)

    def report_note(msg: str) -> None:  # the start-up report and the stats: not with --quiet
        if not quiet:
            note(msg)

    target, drafter, timings = options.load_timed(
        model, draft, no_draft, dtype, report_note, cpu_weights, quiet, world, shard
    )

    from ..drafters import check_exact, default_mode
    from ..engine import Session
    from ..loading import backend
    from ..settings import parse_tree

    draft_mode = draft_mode or default_mode(drafter is not None)
    check_exact(target, drafter, draft_mode, num_draft)

    for line in report.startup_lines(target, drafter, timings, backend()):
        report_note(line)
    report_note("/help for commands, Ctrl-D or /exit to quit")
    session = Session(target, drafter)
    settings = Settings(
        temperature,
        top_p,
        top_k,
        num_draft,
        max_tokens,
        seed,
        drafter is not None,
        draft_mode,
        sampling,
        parse_tree(tree),
    )
    shown = Shown(stops, quiet, verbose, err)
    convo = Conversation(system=system)
    totals = Totals()
    ask = ranks.shared_input(terminal_input() if sys.stdin.isatty() else piped_input, world)
    while True:
        try:
            message = read_message(ask)
        except KeyboardInterrupt:
            note("\n(Ctrl-D or /exit to quit)")
            continue
        except EOFError:
            if sys.stdin.isatty():
                err.print()
            return
        if message.startswith("/"):
            if not run_command(message, session, settings, convo, totals, note):
                return
            continue
        if not message.strip():
            continue
        try:
            reply(message, session, settings, convo, totals, out, note, shown)
        except SpecmlxError as e:  # a bad setting or an over-long prompt: say so, keep chatting
            note(f"error: {e}", style="red")


@dataclass
class Shown:
    """How replies are shown: cut at stop strings; with stats (not --quiet); with a note
    per round (--verbose); a long prefill's progress on `err` where it is a terminal."""

    stops: list[str]
    quiet: bool = False
    verbose: bool = False
    err: Console | None = None


def reply(
    message, session, settings, convo, totals, out: Console, note, shown: Shown | None = None
) -> None:
    """One turn: encode the conversation, stream the reply, record it and its stats."""
    shown = shown or Shown([])
    from ..engine import generate

    target = session.model
    ids, rendered = conversation_ids(target.tokenizer, convo, message)
    limit = target.config.get("max_position_embeddings")
    room = limit - len(ids) if limit else settings.max_tokens
    if room < 1:
        note(
            f"context full: the conversation is {len(ids)} tokens and {target.name} takes "
            f"{limit}; /reset to start a new one",
            style="yellow",
        )
        return
    bar = progress.prefill(shown.err, show=not shown.quiet)
    # On several ranks a Ctrl-C ends the chat: it reaches each rank at another token, or
    # only rank 0, and every rank must stop a reply at the same one.
    stop_soft = nullcontext([]) if ranks.world() else sigint_flag()
    with stop_soft as interrupted, bar as on_prefill:
        gen = generate(
            target,
            ids,
            num_draft=settings.gamma if settings.draft_on else 0,
            draft_mode=settings.draft_mode,
            sampling=settings.sampling,
            tree=settings.tree,
            draft=session.draft if settings.draft_on else None,
            session=session,
            max_tokens=min(settings.max_tokens, room),
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k,
            seed=settings.seed,
            on_prefill=on_prefill,
        )
        rounds = stream.round_notes(gen.stats, note) if shown.verbose else lambda: None
        text = ""
        try:
            for _step, piece in stream.stop_pieces(gen, shown.stops):
                rounds()
                out.out(piece, end="")
                text += piece
                if interrupted:
                    break
        except KeyboardInterrupt:  # a second Ctrl-C: stop even mid-round
            if ranks.world():
                raise
            interrupted.append(signal.SIGINT)
        finally:
            gen.close()  # the Session trims both caches back to what was emitted
    rounds()
    out.out("")
    if interrupted:
        note("[interrupted]")
    remember(convo, message, ids, rendered, text, gen, target.tokenizer)
    totals.add(gen.stats)
    if not shown.quiet:
        plain = report.plain_note(gen.stats, session.draft is not None, settings.draft_on)
        note(report.stats_line(gen.stats, plain, stream.reached_stop(gen, shown.stops)))
    if limit and len(convo.ids) >= limit:
        note(f"context full ({limit} tokens): /reset to start a new conversation", style="yellow")


def conversation_ids(tokenizer, convo: Conversation, message: str) -> tuple[list[int], str]:
    """Token ids (and rendered text) of the conversation plus a new user message.

    The ids already seen are kept as they are and only the new text is encoded, so the
    prefix matches the caches token for token (re-encoding a reply may tokenize it
    differently from how it was generated). When the chat template rewrites history
    (e.g. trims it), the whole text is encoded and the Session reuses what still matches.
    """

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    if not getattr(tokenizer, "has_chat_template", False):
        # A base model: the conversation is plain text, one message per line.
        text = convo.text + message + "\n"
        new = message + "\n"
        if convo.ids:
            return convo.ids + encode(new), text
        return tokenizer.encode(new), text
    messages = [{"role": "system", "content": convo.system}] if convo.system else []
    messages += convo.messages + [{"role": "user", "content": message}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if convo.ids and text.startswith(convo.text):
        return convo.ids + encode(text[len(convo.text) :]), text
    return encode(text), text


def remember(
    convo: Conversation, message: str, ids: list[int], rendered: str, reply: str, gen, tokenizer
):
    """Add the turn to the conversation; the reply is what was shown (`reply`)."""
    convo.messages += [
        {"role": "user", "content": message},
        {"role": "assistant", "content": reply},
    ]
    if tokenizer.decode(gen.tokens) == reply:
        convo.ids, convo.text = ids + gen.tokens, rendered + reply
    else:
        # An interrupted multi-byte character, or a reply cut at a stop string: let the
        # next turn re-encode the text (the Session reuses the prefix that still matches).
        convo.ids, convo.text = [], ""


@dataclass
class Totals:
    """Every reply's Stats: since chat started, and in this conversation (since /reset)."""

    session: list = field(default_factory=list)
    conversation: list = field(default_factory=list)

    def add(self, stats) -> None:
        self.session.append(stats)
        self.conversation.append(stats)


def summed(replies: list):
    """One Stats holding the sum of every per-reply count and time (the ratios follow)."""
    from ..engine import Stats

    total = Stats()
    for stats in replies:
        for f in fields(stats):
            value = getattr(stats, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if f.name not in (
                    "gamma",
                    "tree",
                    "ttft",
                    "predicted_tps",
                    "draft_ratio",
                    "forecast_alpha",
                ):
                    setattr(total, f.name, getattr(total, f.name) + value)
    return total


def run_command(line: str, session, settings: Settings, convo, totals, note) -> bool:
    """Handle a slash command; False means quit."""
    name, _, arg = line[1:].strip().partition(" ")
    name, arg = name.lower(), arg.strip()
    if name in ("exit", "quit", "bye"):
        return False
    if name in ("help", "?"):
        note(HELP, style=None)
    elif name == "reset":
        convo.clear()
        session.reset()
        totals.conversation.clear()
        note("conversation cleared (both KV caches emptied)")
    elif name == "stats":
        show_totals(session, convo, totals, note)
    elif name == "set":
        try:
            change_setting(arg, settings, convo, note)
        except SpecmlxError as e:
            note(f"error: {e}", style="red")
    elif name == "draft":
        if arg not in ("on", "off"):
            note("usage: /draft on|off", style="red")
        elif session.draft is None:
            note("no draft model loaded: start chat with --draft DIR", style="red")
        else:
            settings.draft_on = arg == "on"
            note(f"speculative decoding {arg}")
    else:
        note(f"unknown command /{name}; /help lists them", style="red")
    return True


def change_setting(arg: str, settings: Settings, convo: Conversation, note) -> None:
    """`/set NAME VALUE`, validated the same way as the command-line flags."""
    from ..settings import check_settings, parse_gamma, parse_tree

    if not arg:
        shown = {
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "top_k": settings.top_k,
            "gamma": settings.gamma if settings.draft_on else f"{settings.gamma} (draft off)",
            "tree": settings.tree,
            "max_tokens": settings.max_tokens,
            "system": convo.system or "",
        }
        note("  ".join(f"{k}={v!r}" if k == "system" else f"{k}={v}" for k, v in shown.items()))
        return
    name, _, value = arg.partition(" ")
    name, value = name.lower().replace("-", "_"), value.strip()
    if name not in SETTING_NAMES:
        raise SpecmlxError(f"cannot set {name!r}; settable: {', '.join(SETTING_NAMES)}")
    if name == "system":
        convo.system = value or None
        note("system prompt " + ("set" if value else "cleared"))
        return
    if not value:
        raise SpecmlxError(f"/set {name} needs a value")
    if name == "gamma":
        settings.gamma = parse_gamma(value)  # the flag's rule, its maximum included
    elif name == "tree":
        settings.tree = parse_tree(value)  # the flag's rule
    else:
        kind = float if name in ("temperature", "top_p") else int
        try:
            number = kind(value)
        except ValueError:
            raise SpecmlxError(f"/set {name}: {value!r} is not a {kind.__name__}") from None
        changed = replace(settings, **{name: number})
        check_settings(  # raises if invalid
            changed.max_tokens,
            changed.temperature,
            changed.top_p,
            changed.top_k,
            changed.gamma,
            changed.draft_mode,
        )
        setattr(settings, name, number)
    note(f"{name} = {getattr(settings, name)}")


def show_totals(session, convo: Conversation, totals: Totals, note) -> None:
    limit = session.model.config.get("max_position_embeddings")
    lines = [
        f"context {len(session.target.cached)}/{limit or '?'} tokens in the cache, "
        f"{counted(len(convo.messages) // 2, 'turn')}",
    ]
    for label, replies in (
        ("this conversation", totals.conversation),
        ("since chat started", totals.session),
    ):
        count = counted(len(replies), "reply", "replies")
        lines += [f"{label}: {count}", *totals_lines(replies)]
    lines.append(report.memory_line())
    for line in lines:
        note(line, style=None)


def totals_lines(replies: list) -> list[str]:
    """The sums of some replies' stats, indented under the label they are shown with."""
    total = summed(replies)
    lines = [
        f"  replies {counted(total.tokens, 'token')} in "
        f"{total.decode_time:.2f} s ({total.decode_tps:.1f} tok/s)",
        f"  prefill {total.prefill_tokens} new of {counted(total.prompt_tokens, 'prompt token')} "
        f"(the rest came from the KV cache)",
    ]
    if total.drafted:
        lines.append(
            f"  α {total.acceptance:.2f} · τ {total.tokens_per_pass:.2f} · "
            f"verify/draft {total.verify_time:.2f}/{total.draft_time:.2f} s"
        )
    return lines


def read_message(ask: Callable[[str], str]) -> str:
    """One message; a line starting with \"\"\" opens a multi-line one until \"\"\"."""
    line = ask(">>> ")
    if not line.lstrip().startswith('"""'):
        return line.strip()
    first = line.lstrip()[3:]
    if first.rstrip().endswith('"""'):
        return first.rstrip()[:-3].strip()
    lines = [first]
    while True:
        more = ask("... ")
        if more.rstrip().endswith('"""'):
            lines.append(more.rstrip()[:-3])
            return "\n".join(lines).strip()
        lines.append(more)


def terminal_input() -> Callable[[str], str]:
    """input() with line editing and history, for a person at a terminal."""
    try:
        import readline  # noqa: F401  (importing it is what turns editing on)
    except ImportError:  # pragma: no cover  (Windows)
        pass
    return input


def piped_input(prompt: str) -> str:
    """A line from a pipe: no prompt is echoed, and the end of input is EOF."""
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


@contextmanager
def sigint_flag() -> Iterator[list]:
    """During a reply, the first Ctrl-C asks to stop at the next token; a second one stops now.

    Stopping between tokens leaves nothing half-done; the second press is for a long prefill.
    """
    hits: list = []

    def on_sigint(signum, frame):
        hits.append(signum)
        if len(hits) > 1:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield hits
    finally:
        signal.signal(signal.SIGINT, previous)
