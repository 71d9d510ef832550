"""The `specmlx` command: typer app, error handling. The only package that prints."""

from __future__ import annotations

import sys
from importlib import import_module

import typer

try:  # recent typer vendors its own copy of click
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover
    from click import exceptions as click_errors

from ..errors import SpecmlxError
from . import ranks, started  # noqa: F401  (started stamps the time report.process_start gives)

app = typer.Typer(
    name="specmlx",
    help="Quantized speculative decoding on MLX: a small draft model guesses, the target checks.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help: typer's rich help shows <bool> after every flag, as if it took a value
    # (its type column ignores is_flag), and reads [brackets] in help texts as markup.
    rich_markup_mode=None,
)


def version() -> str:
    """The installed distribution's version; the package's own where it is not installed
    (run from a source tree)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    try:
        return installed_version("specmlx")
    except PackageNotFoundError:
        from .. import __version__

        return __version__


def _print_version(asked: bool) -> None:
    if asked:
        print(f"specmlx {version()}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors."),
    no_fast_blas: bool = typer.Option(
        False,
        "--no-fast-blas",
        help="With --cpu-weights fp32: keep MLX's bundled BLAS, do not load OpenBLAS "
        "(also SPECMLX_FAST_BLAS=0).",
    ),
    show_version: bool = typer.Option(
        False,
        "--version",
        is_eager=True,  # before a missing command is complained of
        callback=_print_version,
        help="Print the version and exit.",
    ),
) -> None:
    """Quantized speculative decoding on MLX."""


# One module per command; each registers itself on `app` when imported.
COMMANDS = ("bench", "chat", "generate", "head", "models", "quantize", "serve")


def _register(argv: list[str]) -> None:
    """Import the command being run, or all of them for the top-level help: the others
    would add their imports (rich tables, the bench) to every cold start."""
    named = next((arg for arg in argv if not arg.startswith("-")), None)
    for name in [named] if named in COMMANDS else COMMANDS:
        import_module(f".{name}", __name__)


def asks_for_fp32(argv: list[str]) -> bool:
    """Whether the command line asks for fp32 CPU weights. Read before typer parses it: the
    fast BLAS those run on must be loaded before mlx is, and nothing else needs it."""
    pairs = zip(argv, argv[1:], strict=False)
    return "--cpu-weights=fp32" in argv or ("--cpu-weights", "fp32") in pairs


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors become one line on stderr and a non-zero exit."""
    as_process = argv is None  # the process's own entry point, not a call from Python
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    if as_process and asks_for_fp32(argv):
        from ..cpu import setup_cli

        # Before anything imports mlx: a fast BLAS must be in place when libmlx binds it.
        try:
            setup_cli(no_fast_blas="--no-fast-blas" in argv)
        except SpecmlxError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
    _register(argv)
    try:
        # Not standalone, so errors reach the handlers below; typer then *returns* the code
        # of an Exit, and turns a Ctrl-C into Exit(130), which would otherwise be dropped.
        exit_code = app(args=argv, prog_name="specmlx", standalone_mode=False)
        if not exit_code:
            ranks.finish()  # on several ranks: none leaves before all are done
    except SpecmlxError as e:
        if debug:
            raise
        ranks.say(f"error: {e}")
        sys.exit(2)
    except click_errors.NoArgsIsHelpError:
        sys.exit(0)  # typer has printed the help already
    except click_errors.ClickException as e:
        if debug:
            raise
        hint = f" (see `{e.ctx.command_path} --help`)" if getattr(e, "ctx", None) else ""
        print(f"error: {e.format_message()}{hint}", file=sys.stderr)
        sys.exit(e.exit_code)
    except (KeyboardInterrupt, typer.Abort):
        interrupted()
    except Exception as e:
        lost = ranks.lost_line(e)  # another rank stopped: one line, whatever the command
        if debug and not lost:
            raise
        ranks.say(lost or f"internal error: {type(e).__name__}: {e} (rerun with --debug)")
        sys.exit(1)
    if exit_code == INTERRUPTED:
        interrupted()
    if exit_code:  # commands return None: an int is the code of an Exit
        sys.exit(exit_code)


INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process that Ctrl-C stopped


def interrupted() -> None:
    ranks.say("interrupted")
    sys.exit(INTERRUPTED)
