"""More than one machine: the target split over MLX's distributed group, with mlx-lm's sharding.

`mlx.launch` (or mpirun, or any launcher MLX's `mx.distributed.init` reads) starts one
process per rank; `group()` is then their world. The target is split over it as mlx-lm's
`sharded_load` splits it: tensor parallel through the model class's `shard(group)`
(each linear layer cut by rows or columns, an all-sum after each attention and MLP), or
pipeline parallel through `model.pipeline(group)` (each rank runs a run of layers; rank
0 the last ones). specmlx adds no transport of its own: every byte between ranks is an
MLX collective (`all_sum`, and mlx-lm's own send/recv/all_gather inside the pipeline).

Sharding happens before specmlx.cpu.prepare patches the model (loading.load calls
`shard` right after the model is built, its weights still lazy or mapped, so a rank
reads only its part). The native CPU kernel then takes what it recognises and leaves the
rest to MLX: the sharded linear layers (mlx.nn's Quantized{AllToSharded,ShardedToAll}
Linear) run on the INT4 kernel with their all-sum kept (cpu.quantized); the gated MLP,
the fused q/k/v and the fused decoder block skip them, so every all-sum stays in the
pass; attention, norms, RoPE, embedding and head keep the native ops.

The rounds' lockstep (one plan for every rank) is specmlx.lockstep's.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from .errors import SpecmlxError

SHARDS = ("auto", "tensor", "pipeline")

_world: list = []  # [the group or None], once asked
_links: list[socket.socket] = []  # the backend's connections to the other ranks (watch)


def group() -> Any | None:
    """The world this process belongs to, where it is one of several ranks (a launcher set
    up MLX's distributed backend: mlx.launch's ring or JACCL, MPI, NCCL); None alone."""
    if not _world:
        before = _connections()
        world = mx.distributed.init() if mx.distributed.is_available() else None
        _world.append(world if world is not None and world.size() > 1 else None)
        after = _connections() if _world[0] is not None else {}
        for fd, sock in [*before.items(), *after.items()]:
            if fd in before or fd not in after:
                sock.close()
            else:  # what init connected: the links to the other ranks
                _links.append(sock)
    return _world[0]


def rank(world: Any | None) -> int:
    return 0 if world is None else world.rank()


def can_shard(module: Any) -> dict[str, bool]:
    """Which splits mlx-lm's class for this model has."""
    inner = module.get("model") if hasattr(module, "get") else None
    return {"tensor": hasattr(module, "shard"), "pipeline": hasattr(inner, "pipeline")}


def pick_shard(module: Any, how: str) -> str:
    """The split `how` asks for ("auto": tensor where the model has it, else pipeline), or
    a one-line refusal where the model's mlx-lm class has neither, or not that one."""
    if how not in SHARDS:
        raise SpecmlxError(f"--shard must be one of {', '.join(SHARDS)}, got {how!r}")
    has = can_shard(module)
    kind = getattr(module, "model_type", type(module).__name__)
    if not any(has.values()):
        raise SpecmlxError(
            f"mlx-lm's {kind} cannot be split over ranks (its class has neither shard() nor "
            "pipeline()): it runs on one machine only; pick a model mlx-lm can split (qwen2, "
            "qwen3, llama, deepseek_v3, ...)"
        )
    if how == "auto":
        how = "tensor" if has["tensor"] else "pipeline"
    if has[how]:
        return how
    other = "pipeline" if how == "tensor" else "tensor"
    raise SpecmlxError(f"mlx-lm's {kind} cannot be split by {how} parallelism; use --shard {other}")


def shard(module: Any, how: str, world: Any, name: str) -> str:
    """Split `module` over `world` as mlx-lm's sharded_load does; returns the split used
    ("tensor" or "pipeline"). Its weights stay lazy: each rank reads only its part."""
    how = pick_shard(module, how)
    try:
        if how == "tensor":
            module.shard(world)
        else:
            module.model.pipeline(world)
    except (ValueError, AssertionError) as e:  # a dimension the ranks do not divide
        raise SpecmlxError(
            f"cannot split {name} over {world.size()} ranks by {how} parallelism ({e}); "
            "try the other --shard, or another number of ranks"
        ) from e
    return how


# -- small broadcasts: rank 0's values to every rank, as one all-sum -----------------


def broadcast(x: mx.array, world: Any) -> mx.array:
    """`x` as rank 0 holds it, on every rank: the others pass an array of the same shape and
    dtype (its values unused). An all-sum with zeros: exact, and works on every backend."""
    if world.rank() != 0:
        x = mx.zeros_like(x)
    out = mx.distributed.all_sum(x, group=world, stream=mx.cpu)
    mx.eval(out)
    return out


def broadcast_ints(values: list[int], world: Any) -> list[int]:
    """A fixed-length list of ints from rank 0 (the others pass as many, unused)."""
    return broadcast(mx.array(values, mx.int32), world).tolist()


def broadcast_bytes(data: bytes | None, world: Any) -> bytes:
    """Bytes from rank 0 (the others pass None): their length first, then them."""
    n = broadcast_ints([len(data) if data is not None else 0], world)[0]
    if n == 0:
        return b""
    mine = np.frombuffer(data, np.uint8) if world.rank() == 0 else np.zeros(n, np.uint8)
    return bytes(np.array(broadcast(mx.array(mine.astype(np.int32)), world), np.uint8))


def from_leader(read, world: Any | None) -> str:
    """`read()`'s text, read on rank 0 alone (a prompt file or stdin that only it has) and
    sent to the others. Where rank 0's read fails, the others stop too, saying so."""
    if world is None:
        return read()
    ok, text = 1, None
    if world.rank() == 0:
        try:
            text = read()
        except BaseException:
            broadcast_ints([0], world)
            raise
    ok = broadcast_ints([ok], world)[0]
    if not ok:
        raise SpecmlxError("rank 0 could not read the input (its own message says why)")
    return broadcast_bytes(None if text is None else text.encode("utf-8"), world).decode("utf-8")


# -- a rank that stops ----------------------------------------------------------------

# What MLX's backends raise once a peer's connection is gone.
LOST = ("connection to a peer was lost", "Too many send/recv errors", "closed by the peer")


def lost_peer(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, RuntimeError) and text.startswith("[") and any(s in text for s in LOST)


def lost_line(why: str, world: Any | None) -> str:
    """The one line a rank says when another stopped (that rank's own line says why)."""
    size = f" of {world.size()}" if world is not None else ""
    return (
        f"rank {rank(world)}{size} lost the other ranks ({why}): one of them stopped or its "
        "host went down; its own message, if any, says why"
    )


# -- a watchdog: a lost rank noticed even where the backend would wait for it forever ----
#
# MLX's ring backend raises on a collective that starts after a peer's socket closed,
# but one already waiting on a peer that dies may wait for good (seen with mlx 0.32 on
# localhost). So a thread peeks, twice a second, at the TCP connections that init made
# (MLX's own sockets: nothing is sent on them, MSG_PEEK reads nothing off them): end of
# stream or a reset means a rank is gone. Keepalive probes on them make a host that
# vanished without closing them (power, cable) show as a reset within seconds too.
# Backends without TCP links (JACCL's RDMA, MPI's own) are not watched.

KEEPALIVE = {"TCP_KEEPIDLE": 5, "TCP_KEEPALIVE": 5, "TCP_KEEPINTVL": 2, "TCP_KEEPCNT": 3}


def watch(on_lost: Callable[[str], None], every: float = 0.5) -> bool:
    """Call `on_lost(why)` from a thread once a link to another rank is gone; whether any
    link is watched. Once per process."""
    if not _links or any(t.name == "rank-watch" for t in threading.enumerate()):
        return bool(_links)
    for sock in _links:
        _keepalive(sock)

    def run() -> None:
        while True:
            for sock in _links:
                why = _gone(sock)
                if why:
                    on_lost(why)
                    return
            time.sleep(every)

    threading.Thread(target=run, name="rank-watch", daemon=True).start()
    return True


def _gone(sock: socket.socket) -> str:
    """Why this link is gone ('' while it holds)."""
    try:
        data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return ""
    except OSError as e:
        return f"its link to a rank failed: {e.strerror or e}"
    return "" if data else "a rank closed its link"


def _keepalive(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in KEEPALIVE.items():
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except OSError:
        pass


def _connections() -> dict[int, socket.socket]:
    """This process's connected TCP sockets by descriptor, each as a socket object over a
    duplicate of it (closing one leaves the backend's own open)."""
    folder = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    try:
        fds = [int(name) for name in os.listdir(folder)]
    except OSError:
        return {}
    found = {}
    for fd in fds:
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:  # not a socket (or closed since the listing)
            continue
        try:
            if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.getpeername()  # connected: a listening socket has no peer
                found[fd] = sock
                continue
        except OSError:
            pass
        sock.close()
    return found
