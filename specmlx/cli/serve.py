"""`specmlx serve`: the model pair behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import logging
import socket

import typer
from rich.console import Console

from ..errors import SpecmlxError
from . import app, options, ranks, report

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


@app.command()
def serve(
    model: str = options.Model,
    draft: str = options.Draft,
    no_draft: bool = options.NoDraft,
    max_tokens: int = typer.Option(
        256, "--max-tokens", "-n", help="Maximum tokens for a request that does not say."
    ),
    gamma: str = options.Gamma,
    draft_mode: str | None = options.DraftMode,
    sampling: str | None = options.Sampling,
    dtype: str = options.Dtype,
    cpu_weights: str = options.CpuWeights,
    shard: str = options.Shard,
    host: str = typer.Option(
        "127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."
    ),
    port: int = typer.Option(8080, "--port", help="Port to listen on (0: any free one)."),
    api_key: str = typer.Option(
        None,
        "--api-key",
        envvar="SPECMLX_API_KEY",
        help="Require this bearer token on /v1 requests (also SPECMLX_API_KEY).",
    ),
    cache_gb: float = typer.Option(
        4.0, "--cache-gb", help="Memory for the KV caches kept between requests, in GiB."
    ),
    strict_model: bool = typer.Option(
        False,
        "--strict-model",
        help="Answer only requests that name this model (by default any name is served as "
        "it, and noted in the log).",
    ),
    max_body_mb: float = typer.Option(
        4.0, "--max-body-mb", help="Largest request body, in MiB (larger ones get a 413)."
    ),
) -> None:
    """Serve the model pair over an OpenAI-compatible HTTP API (chat and completions).

    A request that gives no temperature samples at 1.0, OpenAI's default, where generate
    and chat decode greedily (their -t defaults to 0): send "temperature": 0 for theirs.
    """
    num_draft = options.check_settings(max_tokens, 0.0, 1.0, 0, gamma, draft_mode, sampling)
    if cache_gb < 0:
        raise SpecmlxError(f"--cache-gb must be >= 0, got {cache_gb}")
    if not max_body_mb > 0:
        raise SpecmlxError(f"--max-body-mb must be > 0, got {max_body_mb}")
    world = ranks.start(shard)  # several ranks: rank 0 serves, the others follow its rounds
    leader = world is None or world.rank() == 0
    err = Console(stderr=True, soft_wrap=True, highlight=False)

    def log(msg: str) -> None:
        err.print(msg, style="dim", markup=False)

    # Bound before the slow load, so that a port in use is said at once.
    listener = bind(host, port) if leader else None
    target, drafter, timings = options.load_timed(
        model, draft, no_draft, dtype, log, cpu_weights, False, world, shard
    )

    import uvicorn

    from ..drafters import check_exact
    from ..loading import backend
    from ..server import Defaults, make_app

    check_exact(target, drafter, draft_mode, num_draft)
    if not leader:
        follow(target, drafter, cache_gb)
        return
    for line in report.startup_lines(target, drafter, timings, backend()):
        log(line)
    bound_host, bound_port = listener.getsockname()[:2]
    url_host = f"[{bound_host}]" if ":" in bound_host else bound_host
    log(f"serving {model or target.name} at http://{url_host}:{bound_port}/v1")
    if host in LOCAL_HOSTS:
        log("bound to localhost only: other machines cannot connect (--host 0.0.0.0 to allow)")
    elif api_key is None:
        log("listening beyond localhost with no --api-key: anyone who can reach it can use it")
    server_app = make_app(
        target,
        drafter,
        model_id=model or target.name,
        api_key=api_key,
        cache_bytes=int(cache_gb * (1 << 30)),
        defaults=Defaults(max_tokens, num_draft, draft_mode, sampling),
        strict_model=strict_model,
        max_body_bytes=int(max_body_mb * (1 << 20)),
        world=world,
    )
    # One line per request (specmlx.server's), on stderr beside the startup lines.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    server_log = logging.getLogger("specmlx.server")
    server_log.addHandler(handler)
    server_log.setLevel(logging.INFO)
    config = uvicorn.Config(server_app, log_level="warning", timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[listener])
    ranks.release()  # the decode thread told the other ranks that it ends


def follow(target, drafter, cache_gb: float) -> None:
    """A rank but 0: run the passes of every request rank 0's server decodes, until it
    stops (specmlx.server.worker.follow)."""
    from ..server.pool import SessionPool
    from ..server.worker import Mirror
    from ..server.worker import follow as follow_rank_0

    pool = SessionPool(target, drafter, int(cache_gb * (1 << 30)))
    follow_rank_0(pool, Mirror(ranks.world()))
    ranks.release()  # rank 0 said it ends


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, or a one-line error naming the address."""
    if not 0 <= port <= 65535:  # bind() would raise OverflowError, not an OSError
        raise SpecmlxError(f"--port must be from 0 to 65535 (0: any free one), got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SpecmlxError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(128)
    return sock
