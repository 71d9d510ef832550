"""The queue in front of the model pair: requests decode together, first come first seated.

One thread drives every model call, so the models and the Session pool are never touched
concurrently and the event loop stays free for other requests (and /health) while replies
decode. Up to batch.MAX_BATCH (SPECMLX_MAX_BATCH) requests decode at once, each on its own
Session, joining and leaving between rounds: each round runs ONE target pass over every
active request (specmlx.batch), and a newcomer's prompt is taken a chunk a round beside
the others' decode. A lone request runs exactly the engine's own path. A request submits
a Job and awaits its text; a Job whose client has gone is cancelled, and its decode stops
before its next round (or its next prefill chunk), so its Session's caches hold only what
was emitted.

Where the target is split over ranks (specmlx.distributed), only rank 0 serves HTTP; the
others `follow`: a `Mirror` sends each Job that rank 0 decodes to them, and rank 0's
choices in it (the Session taken and those dropped, and whether to go on after each
prefill chunk and each token: a client that leaves, a stop string), so that every rank
runs the same passes and stops at the same token. Batching across ranks is not built:
there the server decodes one request at a time, as it says in one log line at start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..batch import Batch, Seat
from ..engine import Stats, Step, generate
from ..stops import StopText
from .pool import SessionPool

log = logging.getLogger("specmlx.server")


@dataclass
class Finished:
    text: str  # what the client got: a stop string and everything after it cut off
    tokens: list[int]  # every token emitted (EOS excluded)
    finish_reason: str  # OpenAI's: "stop" (EOS or a stop string) or "length"
    stats: Stats
    cut: bool  # a stop string cut the text short of what `tokens` decode to
    # From the request's arrival (Job.arrived): the client's wait, the queue's included,
    # where Stats.ttft counts from the decode's start. (No token: the reply's end.)
    ttft_s: float
    queue_s: float  # arrival to the decode's start: other requests', prompt preparation


class Gone(Exception):
    """Raised inside a prefill whose client has gone, to stop it between chunks."""


class Job:
    def __init__(self, ids: list[int], settings: dict, stops: list[str], arrived: float):
        """arrived: time.perf_counter() when the request came in."""
        self.ids, self.settings, self.stops, self.arrived = ids, settings, stops, arrived
        self.cancelled = threading.Event()
        self.finished: Finished | None = None
        # Every Step decoded so far, on the loop: each arrives before the text it adds, so
        # a reply's pieces can carry their tokens' log-probabilities and sources.
        self.steps: list[Step] = []
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()

    def cancel(self) -> None:
        """Stop at the next round, or never start: nobody is listening any more."""
        self.cancelled.set()

    async def texts(self) -> AsyncIterator[str]:
        """The reply's text, piece by piece as it is decoded; `.finished` is set after the
        last one. An error in the decode is raised here."""
        while True:
            kind, value = await self._events.get()
            if kind == "step":
                self.steps.append(value)
            elif kind == "text":
                yield value
            elif kind == "done":
                self.finished = value
                return
            else:
                raise value

    async def result(self) -> Finished:
        async for _ in self.texts():
            pass
        assert self.finished is not None
        return self.finished

    def emit(self, kind: str, value) -> None:
        """From the decode thread: hand an event to the request waiting on the loop."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, (kind, value))
        except RuntimeError:  # the loop has closed (shutdown): nobody can receive it
            pass


class Mirror:
    """Rank 0's decisions, sent to the other ranks (nothing to send: one process)."""

    def __init__(self, world=None):
        self.world = world
        self.leader = world is None or world.rank() == 0

    def numbers(self, values: list[int]) -> list[int]:
        if self.world is None:
            return values
        from ..distributed import broadcast_ints

        return broadcast_ints(values, self.world)

    def flag(self, value: bool) -> bool:
        return bool(self.numbers([int(value)])[0])

    def job(self, job: Job | None) -> Replayed | None:
        """Rank 0: its next Job (None: the server stops) to the others; another rank: it."""
        if self.world is None:
            return None
        from ..distributed import broadcast_bytes

        sent = None
        if self.leader:
            fields = None if job is None else [job.ids, job.settings, job.stops]
            sent = json.dumps(fields).encode()
        fields = json.loads(broadcast_bytes(sent, self.world))
        if fields is None:
            return None
        ids, settings, stops = fields
        if settings.get("logit_bias"):  # JSON's keys are text
            settings["logit_bias"] = {int(k): v for k, v in settings["logit_bias"].items()}
        return Replayed(ids, settings, stops)


class Replayed:
    """Another rank's copy of rank 0's Job: decoded alike, its text sent nowhere."""

    def __init__(self, ids: list[int], settings: dict, stops: list[str]):
        self.ids, self.settings, self.stops = ids, settings, stops
        self.arrived = time.perf_counter()
        self.cancelled = threading.Event()  # never set: rank 0's flags decide

    def emit(self, kind: str, value) -> None:
        pass


def follow(pool: SessionPool, mirror: Mirror) -> int:
    """Another rank's server: decode each Job rank 0 decodes, until rank 0 stops; how many."""
    served = 0
    while (job := mirror.job(None)) is not None:
        try:
            decode(job, pool, mirror)
        except Exception:  # rank 0's decode raised the same, and told its client
            pass
        served += 1
    return served


class Worker:
    def __init__(self, pool: SessionPool, mirror: Mirror | None = None):
        self.pool = pool
        self.mirror = mirror or Mirror()
        self.decoded_tokens = 0  # every reply's, those cut short by a client leaving too
        self._jobs: queue.Queue[Job | None] = queue.Queue()  # FIFO: first come first served
        # made here, so that a bad SPECMLX_MAX_BATCH stops the server as it starts
        self._batch = Batch(pool.target, self.waiting) if self.mirror.world is None else None
        self._thread = threading.Thread(target=self._serve, name="specmlx-decode", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Finish the reply in progress (cut short if its client left), then end the thread."""
        self._jobs.put(None)
        self._thread.join()

    def submit(self, ids: list[int], settings: dict, stops: list[str], arrived: float) -> Job:
        """Queue a decode; call from the event loop."""
        job = Job(ids, settings, stops, arrived)
        self._jobs.put(job)
        return job

    def waiting(self) -> int:
        return self._jobs.qsize()

    def _serve(self) -> None:
        if self._batch is not None:
            self._serve_batched(self._batch)
            return
        log.info(
            "serving on %d ranks: one request at a time (batching across ranks is not built)",
            self.mirror.world.size(),
        )
        while (job := self._jobs.get()) is not None:
            if job.cancelled.is_set():  # its client left while it waited
                continue
            self.mirror.job(job)
            self._decode(job)
        self.mirror.job(None)  # the other ranks stop following

    def _serve_batched(self, batch: Batch) -> None:
        """Seat waiting Jobs while there is room, then run a round; after stop(), finish
        the replies in progress."""
        stopping = False
        while not (stopping and not batch.seats):
            while not stopping and batch.has_room():
                try:
                    job = self._jobs.get(block=not batch.seats)
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                elif not job.cancelled.is_set():  # else its client left while it waited
                    batch.add(lambda seat, job=job: self._decode(job, seat))
            for seat in batch.round() if batch.seats else []:
                if seat.error is not None:  # the decode's own errors go to its client
                    log.error("a decode ended in error", exc_info=seat.error)

    def _decode(self, job: Job, seat: Seat | None = None) -> None:
        """Decode one Job (in `seat` of a batch, or alone) and tell its client the end."""
        try:
            done = decode(job, self.pool, self.mirror, seat)
        except Gone:  # its client left during the prefill: nobody to tell
            return
        except Exception as e:  # the request's error, never the thread's end
            job.emit("error", e)
            return
        self.decoded_tokens += done.stats.tokens
        job.emit("done", done)


def decode(
    job: Job | Replayed, pool: SessionPool, mirror: Mirror | None = None, seat: Seat | None = None
) -> Finished:
    """Run one Job on the Session that holds the longest prefix of its prompt; `seat`: its
    place in a batch, whose rounds share one target pass (None: alone)."""
    started, first = time.perf_counter(), None
    mirror = mirror or Mirror()

    def prefilled(done: int, total: int) -> None:
        if mirror.flag(job.cancelled.is_set()):
            raise Gone  # generate() leaves the caches for the next call to prefill anew
        if seat is not None:
            seat.prefilled(done, total)  # a chunk a round, beside the others' decode

    session = pool.take(job.ids, mirror)
    session.target.batch = seat
    try:
        gen = generate(
            session.model,
            job.ids,
            draft=session.draft,
            session=session,
            on_prefill=prefilled,
            **job.settings,
        )
        stop = StopText(job.stops)
        pieces, shown, cut = [], 0, False

        def send(text: str) -> None:
            if text:
                pieces.append(text)
                job.emit("text", text)

        try:
            for step in gen:
                first = first or time.perf_counter()
                job.emit("step", step)
                shown += len(step.text)
                text, cut = stop.add(step.text)
                send(text)
                if mirror.flag(cut or job.cancelled.is_set()):
                    break
                if seat is not None:
                    seat.between_tokens()
            else:
                # The detokenizer's held-back bytes, flushed once the last token is known.
                text, cut = stop.add(gen.text[shown:])
                send(text if cut else text + stop.flush())
        finally:
            gen.close()  # a Generation stopped early trims the caches to what was emitted
    finally:
        session.target.batch = None
        pool.give_back(session, mirror)
    stats = gen.stats
    if seat is not None:
        stats.batch = seat.report()
    reason = "stop" if cut or stats.finish_reason == "eos" else "length"
    ttft = (first or time.perf_counter()) - job.arrived
    return Finished(
        "".join(pieces), list(gen.tokens), reason, stats, cut, ttft, started - job.arrived
    )
