"""Continuous batching: the sequences decoding at once share one target pass a round.

Each sequence keeps everything of its own: its Session (the target's cache and its
drafters'), its policy, its keys, its text, and the engine's round loop itself runs for
it unchanged (engine._decode). Only the target's pass is shared. A sequence's decode is
a `Seat`: a thread that runs only while the model thread hands it the turn, so exactly
one thread ever touches the models, and a sequence's round stops where its target pass
would run (Target._forward). Once every seat has stopped there (or finished, or done one
chunk of its prompt), `Batch.round` runs ONE pass over all their tokens and hands each
its rows. Requests join and leave between rounds; a newcomer's prompt is taken one chunk
(caches.PREFILL_STEP) a round, so the others' streams never wait for a whole prompt.

The pass is mlx-lm's model over (B, widest) tokens: rows shorter than the round's
widest proposal are padded, and their padding never reaches a cache or a reply. Each
row's cache is its sequence's own (`RowsCache` is one layer's view of them): its keys
and values are written there, its RoPE positions are its own offset, and its attention
runs the very call it makes alone (the same function, its own cache, its own causal
mask), so a row attends exactly as alone, and specmlx's rollback (trim, rewind) works on
it unchanged after the round. mlx-lm's BatchKVCache does not fit this: it keeps the
batch in one left-padded buffer with one write position, where each row must roll back
by its own rejected drafts, and its masked attention over the padding is another
computation than the row's own.

Batch invariance. The rows' linear layers run as one (B · widest)-row product; RoPE
and attention run row by row, each row's as alone (`_by_rows`). Where a row alone runs
its decoder layers as one native op (cpu/blocks.py), the batched pass runs each layer as
one op over every row too (`decoder_layer_rows`: the same products over all rows, each
row's attention on its own cache): built op by op, the pass spent ~10 ms of a round in
Python building ~45 nodes a layer. On the CPU, specmlx's
native INT4/INT8 kernel, its norms and MLX's float32 product give each row the same bits
whatever rows run beside it (tests/test_batching.py checks the pass bit for bit), so a
reply equals the same request alone, greedy or sampled with the same seed. MLX's Metal
and CUDA matmuls choose kernels and reduction orders by shape and are not batch-invariant
in general: there a row's logits may differ from its own pass's in the last bits, so
where two tokens are within rounding of each other a greedy reply can take the other one
(it is still the target's greedy decoding up to float rounding, and a sampled reply still
follows the target's distribution).

What is batched: chains and plain rounds. A tree's pass, or a pass that keeps the
target's features for a head, runs alone in the round, exact but unshared; a sequence
whose cache is not a plain KV cache (a sliding window, a recurrent state), or a model
whose mask is not the causal one, runs its passes alone too. A batch-aware policy
(policy/batched.py) prices each round's width and γ per sequence.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from .caches import PaddedKVCache, layers
from .errors import SpecmlxError
from .loading import Model
from .policy.batched import BatchCosts, BatchPolicy, Want, choose_gammas

# The most sequences decoding at once; later requests wait for a seat, first come first
# served. Each holds its own caches (the Session pool's budget bounds what stays idle).
# SPECMLX_MAX_BATCH sets it (1: one request at a time, as before batching; a benchmark's
# baseline), read when a Batch is made.
MAX_BATCH = 8
ENV = "SPECMLX_MAX_BATCH"


def max_batch() -> int:
    text = os.environ.get(ENV, "").strip()
    if not text:
        return MAX_BATCH
    if not text.isdigit() or int(text) < 1:
        raise SpecmlxError(f"{ENV} must be a whole number of at least 1, not {text!r}")
    return int(text)


_ROW_CACHES = (KVCache, PaddedKVCache)


class NotBatchable(Exception):
    """A pass the rows cannot share (a mask other than the causal one): run each alone."""


class _Pass:
    """What every layer's view of one batched pass shares: the rows' lengths and masks."""

    def __init__(self, lengths: list[int]):
        self.lengths, self.width = lengths, max(lengths)
        self.masks: list | None = None


class RowsCache:
    """One layer's view of B sequences' own caches for a batched pass: RoPE reads each
    row's offset; keys and values go to each row's cache; `rows_attention` runs each
    row's attention on its own cache as it runs alone."""

    def __init__(self, rows: list, shared: _Pass):
        self.rows, self.shared = rows, shared
        self.offset = mx.array([c.offset for c in rows], mx.int32)
        self.fetched: list[tuple[mx.array, mx.array]] = []

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        """Each row's mask as its own cache makes it for its own length (the model asks
        the first layer's, before any layer writes); the batch's own is never read."""
        if return_array or window_size is not None:
            raise NotBatchable  # before any cache is written: the rows can still run alone
        self.shared.masks = [
            c.make_mask(m, return_array=False, window_size=None)
            for c, m in zip(self.rows, self.shared.lengths, strict=True)
        ]
        return None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.fetched = [
            c.update_and_fetch(keys[b : b + 1, :, :m], values[b : b + 1, :, :m])
            for b, (c, m) in enumerate(zip(self.rows, self.shared.lengths, strict=True))
        ]
        return keys, values  # read by nobody: rows_attention reads `fetched`


def rows_attention(inner: Callable) -> Callable:
    """mlx-lm's attention function `inner` (or the one the CPU backend put in its place),
    run row by row on a RowsCache; any other call passes through."""

    def attention(queries, keys, values, cache, scale, mask, sinks=None):
        if not isinstance(cache, RowsCache):
            return inner(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        shared, out = cache.shared, []
        if shared.masks is None:  # a model that asked no mask: each row's default
            shared.masks = [None if m == 1 else "causal" for m in shared.lengths]
        for b, (row, m, (k, v)) in enumerate(
            zip(cache.rows, shared.lengths, cache.fetched, strict=True)
        ):
            q = queries[b : b + 1, :, :m]
            o = inner(q, k, v, cache=row, scale=scale, mask=shared.masks[b], sinks=sinks)
            if m < shared.width:
                o = mx.pad(o, [(0, 0), (0, 0), (0, shared.width - m), (0, 0)])
            out.append(o)
        return mx.concatenate(out, axis=0)

    return attention


def batchable(cache: list) -> bool:
    """Whether a sequence's target cache can be a row of a batched pass: plain KV caches,
    whose rows attend over every position they hold."""
    return all(type(c) in _ROW_CACHES for c in layers(cache))


class _RowsRoPE:
    """An attention's RoPE run row by row, each at its own offset (an int, as alone), for
    one batched pass: the native RoPE takes one offset, and MLX's over several offsets
    computes other bits than the native one a row gets alone."""

    def __init__(self, inner, offsets: list[int]):
        self.inner, self.offsets = inner, offsets

    def __call__(self, x: mx.array, offset=None) -> mx.array:
        rows = [self.inner(x[b : b + 1], offset=o) for b, o in enumerate(self.offsets)]
        return mx.concatenate(rows, axis=0)


_OWNERS: dict[int, tuple[list, list]] = {}  # id(model module) -> _owners' answer


def _owners(model: Model) -> tuple[list, list]:
    """(the Python modules that define the model's attention function, its attention
    modules that own a RoPE): what a batched pass swaps. Walked once per model."""
    key = id(model.module)
    if key not in _OWNERS:
        modules = list(model.module.modules())
        sources = {sys.modules.get(type(m).__module__) for m in modules}
        sources = [s for s in sources if hasattr(s, "scaled_dot_product_attention")]
        ropes = [m for m in modules if isinstance(m.get("rope"), nn.Module)]
        _OWNERS[key] = (sources, ropes)
    return _OWNERS[key]


@contextmanager
def _by_rows(model: Model, offsets: list[int]):
    """The model's attention function and RoPEs run row by row for one pass (the model
    thread alone runs passes: nothing else sees the swap)."""
    sources, ropes = _owners(model)
    attentions = [(s, s.scaled_dot_product_attention) for s in sources]
    originals = [(m, m.rope) for m in ropes]
    for source, inner in attentions:
        source.scaled_dot_product_attention = rows_attention(inner)
    for module, rope in originals:
        module.rope = _RowsRoPE(rope, offsets)
    try:
        yield
    finally:
        for source, inner in attentions:
            source.scaled_dot_product_attention = inner
        for module, rope in originals:
            module.rope = rope


def batched_pass(model: Model, rows: list[tuple[list, mx.array]]) -> list[mx.array]:
    """ONE pass of `model` over each (cache, tokens) row: each row's logits (L, V), its
    keys and values written to its own cache. Raises NotBatchable, with no cache
    touched, where the model's mask is not the causal one."""
    lengths = [int(x.shape[0]) for _, x in rows]
    shared = _Pass(lengths)
    padded = zip(rows, lengths, strict=True)
    tokens = mx.stack([mx.pad(x, (0, shared.width - m)) for (_, x), m in padded])
    per_layer = zip(*(layers(cache) for cache, _ in rows), strict=True)
    views = [RowsCache(list(caches), shared) for caches in per_layer]
    with _by_rows(model, [c.offset for c in views[0].rows]):
        logits = model.module(tokens, cache=views)
    return [logits[b, :m] for b, m in enumerate(lengths)]


class _Runner:
    """A thread that runs seats' works one after another, for the process's life. MLX
    gives each thread a stream of its own, with a worker thread behind it that outlives
    the thread (a thread a request would leak one each), so seats reuse these."""

    _idle: list[_Runner] = []
    _lock = threading.Lock()

    def __init__(self):
        self._go = threading.Semaphore(0)
        self._seat: Seat | None = None
        threading.Thread(target=self._loop, name="specmlx-seat", daemon=True).start()

    @classmethod
    def take(cls) -> _Runner:
        with cls._lock:
            return cls._idle.pop() if cls._idle else cls()

    def give_back(self) -> None:
        with self._lock:
            self._idle.append(self)

    def run(self, seat: Seat) -> None:
        self._seat = seat
        self._go.release()

    def _loop(self) -> None:
        while True:
            self._go.acquire()
            seat, self._seat = self._seat, None
            seat._main(self)


class Seat:
    """One sequence's decode in a batch: `work(seat)` runs on a thread other than the model
    thread's (a _Runner), but only between `Batch.round`'s hand-over and the seat's next
    stop, so the models are only ever used by one thread at a time."""

    def __init__(self, batch: Batch, work: Callable[[Seat], None]):
        self.batch, self.work = batch, work
        self.state = "new"  # new, running, stopped (its turn is over), waiting (a pass), done
        self.tokens: mx.array | None = None  # the pass it waits for: its rows' tokens
        self.cache: list | None = None
        self.logits: mx.array | None = None
        self.error: BaseException | None = None
        self.policy: BatchPolicy | None = None
        self.rounds_by_size: dict[int, int] = {}  # its passes by how many rows they held
        self.capped = 0  # rounds whose γ the batch lowered
        self._go, self._back = threading.Semaphore(0), threading.Semaphore(0)

    # -- the model thread's side ----------------------------------------------

    def turn(self) -> None:
        """Let the seat run until it stops: at a pass, a prompt chunk's end, or its end."""
        if self.state == "new":
            self.state = "running"
            _Runner.take().run(self)
        else:
            self.state = "running"
            self._go.release()
        self._back.acquire()

    def _main(self, runner: _Runner) -> None:
        try:
            self.work(self)
        except BaseException as e:  # the work's own errors are its to report
            self.error = e
        finally:
            self.state = "done"
            runner.give_back()  # before the turn ends: the next seat may take it
            self._back.release()

    # -- the seat's side ----------------------------------------------------------

    def _stop(self, state: str) -> None:
        self.state = state
        self._back.release()
        self._go.acquire()

    @property
    def shared(self) -> bool:
        """Whether other sequences decode beside this one now."""
        return len(self.batch.seats) > 1

    def forward(self, model: Model, cache: list, x: mx.array, shareable: bool) -> mx.array | None:
        """The logits (L, V) of this seat's target pass over x, a row of the round's one
        pass; None where the engine runs its own: alone (today's path, unchanged), or a
        pass that cannot be a row (not `shareable`: a tree's, one keeping features; or
        a cache that is no plain KV cache), which then runs in the seat's next turn."""
        if not self.shared:
            return None
        if not (shareable and batchable(cache)):
            self._stop("stopped")
            return None
        # MLX streams are per thread: what this thread computed lazily (the drafts, a
        # trimmed cache) is computed here, so the model thread's pass meets only values.
        mx.eval(x, [(c.keys, c.values) for c in layers(cache) if c.keys is not None])
        self.tokens, self.cache = x, cache
        self._stop("waiting")
        logits, self.logits = self.logits, None
        return logits

    def between_tokens(self) -> None:
        """Called between a reply's tokens: a seat alone gives the turn back where a
        request waits for a seat (shared, it stops at every pass anyway)."""
        if not self.shared and self.batch.newcomers():
            self._stop("stopped")

    def prefilled(self, done: int, total: int) -> None:
        """Called after each chunk of the prompt (the engine's on_prefill): one chunk a
        round, where others decode or wait."""
        if done and (self.shared or self.batch.newcomers()):
            self._stop("stopped")

    def wrap(self, policy):
        """The engine's policy for this seat, priced for the batch (auto only)."""
        if hasattr(policy, "scheduler"):  # auto γ: a fixed γ is the client's to choose
            self.policy = BatchPolicy(policy, self)
            return self.policy
        return policy

    def report(self) -> dict:
        """What the batch did in this seat's call, for its stats."""
        return {
            "rounds_by_size": dict(sorted(self.rounds_by_size.items())),
            "capped_rounds": self.capped,
            "verifies": "chains",  # batched rounds verify chains; a tree's pass runs alone
        }


class Batch:
    """The sequences decoding at once, driven round by round from the model thread."""

    def __init__(self, model: Model, waiting: Callable[[], int] = lambda: 0):
        """`waiting`: how many requests wait for a seat (they make a lone seat stop)."""
        self.model, self.waiting = model, waiting
        self.size = max_batch()  # the most seats
        self.seats: list[Seat] = []
        self.costs = BatchCosts()
        self.gammas: dict[Seat, int] = {}  # this round's γ cap per seat (auto seats)

    def newcomers(self) -> bool:
        return len(self.seats) < self.size and self.waiting() > 0

    def has_room(self) -> bool:
        return len(self.seats) < self.size

    def add(self, work: Callable[[Seat], None]) -> Seat:
        """A new sequence: `work(seat)` runs its decode from its first turn."""
        seat = Seat(self, work)
        self.seats.append(seat)
        return seat

    def round(self) -> list[Seat]:
        """One round: every seat that is not waiting for a pass takes its turn (a
        newcomer starts, a prompt goes on by a chunk), then ONE pass over the seats
        waiting for one, and they go on to their next pass. Returns the seats that
        finished (removed; `.error` set where their work raised)."""
        for seat in list(self.seats):
            if seat.state != "waiting":
                seat.turn()
        waiting = [s for s in self.seats if s.state == "waiting"]
        if waiting:
            self._pass(waiting)
        self._plan()
        for seat in waiting:
            seat.rounds_by_size[len(waiting)] = seat.rounds_by_size.get(len(waiting), 0) + 1
            seat.turn()
        done = [s for s in self.seats if s.state == "done"]
        self.seats = [s for s in self.seats if s.state != "done"]
        return done

    def _pass(self, seats: list[Seat]) -> None:
        rows = [(s.cache, s.tokens) for s in seats]
        start = time.perf_counter()

        def alone() -> list[mx.array]:
            return [self.model.module(x[None], cache=c)[0] for c, x in rows]

        try:  # one row (the others are taking their prompts): its own pass
            logits = batched_pass(self.model, rows) if len(rows) > 1 else alone()
        except NotBatchable:
            logits = alone()
        mx.eval(logits)
        width = max(int(x.shape[0]) for _, x in rows)
        self.costs.observe(len(seats), width, time.perf_counter() - start)
        for seat, out in zip(seats, logits, strict=True):
            seat.logits, seat.tokens, seat.cache = out, None, None

    def _plan(self) -> None:
        """This round's γ per auto seat, from what each wanted last round (policy/batched)."""
        priced = [s for s in self.seats if s.policy is not None and s.policy.want is not None]
        if len(self.seats) < 2 or not priced:
            self.gammas = {}
            return
        wants = [s.policy.want for s in priced]
        others = len(self.seats) - len(priced)  # rows the round has anyway
        gammas = choose_gammas(wants, self.costs.pricer(len(self.seats), wants), others)
        self.gammas = dict(zip(priced, gammas, strict=True))

    def cap(self, seat: Seat) -> int | None:
        """The γ the batch allows `seat` this round; None: no cap (alone, or unpriced)."""
        if not seat.shared:
            return None
        return self.gammas.get(seat)


def run_together(model: Model, works: list[Callable[[Seat], None]]) -> None:
    """Run each work as a seat of one batch until all are done (tests, benchmarks); the
    first error raised by any work is raised here once all have ended."""
    batch = Batch(model)
    seats = [batch.add(w) for w in works]
    while batch.seats:
        batch.round()
    for seat in seats:
        if seat.error is not None:
            raise seat.error


__all__ = ["Batch", "NotBatchable", "Seat", "Want", "batched_pass", "run_together"]
