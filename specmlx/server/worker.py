"""The queue in front of the model pair: one decode at a time, first come first served.

A single thread makes every model call, so the models and the Session pool are never
touched concurrently and the event loop stays free for other requests (and /health)
while a reply decodes. A request submits a Job and awaits its text; a Job whose client
has gone is cancelled, and the thread stops it before the next round (or the next
prefill chunk), so the Session's caches hold only what was emitted.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..engine import Stats, generate
from ..stops import StopText
from .pool import SessionPool


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
            if kind == "text":
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


class Worker:
    def __init__(self, pool: SessionPool):
        self.pool = pool
        self.decoded_tokens = 0  # every reply's, those cut short by a client leaving too
        self._jobs: queue.Queue[Job | None] = queue.Queue()  # FIFO: first come first served
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
        while (job := self._jobs.get()) is not None:
            if job.cancelled.is_set():  # its client left while it waited
                continue
            try:
                done = decode(job, self.pool)
            except Gone:  # its client left during the prefill: nobody to tell
                continue
            except Exception as e:  # the request's error, never the thread's end
                job.emit("error", e)
                continue
            self.decoded_tokens += done.stats.tokens
            job.emit("done", done)


def decode(job: Job, pool: SessionPool) -> Finished:
    """Run one Job on the Session that holds the longest prefix of its prompt."""
    started, first = time.perf_counter(), None

    def prefilled(done: int, total: int) -> None:
        if job.cancelled.is_set():
            raise Gone  # generate() leaves the caches for the next call to prefill anew

    session = pool.take(job.ids)
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
                shown += len(step.text)
                text, cut = stop.add(step.text)
                send(text)
                if cut or job.cancelled.is_set():
                    break
            else:
                # The detokenizer's held-back bytes, flushed once the last token is known.
                text, cut = stop.add(gen.text[shown:])
                send(text if cut else text + stop.flush())
        finally:
            gen.close()  # a Generation stopped early trims the caches to what was emitted
    finally:
        pool.give_back(session)
    stats = gen.stats
    reason = "stop" if cut or stats.finish_reason == "eos" else "length"
    ttft = (first or time.perf_counter()) - job.arrived
    return Finished(
        "".join(pieces), list(gen.tokens), reason, stats, cut, ttft, started - job.arrived
    )
