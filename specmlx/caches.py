"""Caches for both models: mlx-lm's, or a padded one where shapes must repeat; which of
them a round can roll back exactly.

Speculation rolls a cache back by the rejected drafts after every round. mlx-lm's
`trim` does that exactly only for caches that keep every position (KVCache and its
quantized and padded kinds). A sliding window that has wrapped has overwritten what a
trim would need, and a recurrent state (ArraysCache) has no positions to drop: for them
`trim_prompt_cache` trims nothing and returns 0. So a round takes a `checkpoint` of such
caches before its pass (views of their arrays: MLX arrays are values, so a view keeps
what the pass then overwrites) and `rewind` restores it and runs the accepted tokens
again, a pass over n + 1 tokens that a rejection costs. A sliding window right after a
pass over several tokens is still in time order, so there it is cut instead, at no cost.
A kind not known here is refused for speculation (`check_rollback`), never guessed at.

MLX's CUDA backend (0.32.4) builds attention kernels per shape: a target pass over a few
new tokens costs several times more at a KV length it has not seen, and a growing
context is always new, so on that backend every verify pass paid the build and
speculation lost (bench/results/gpu_h200.md). PaddedKVCache makes a pass over several
tokens see the whole buffer, which grows in steps of 256 positions, with a mask that
hides its unused tail: their KV length then changes once per 256 tokens. Masked positions get zero
weight, so the result is the same up to float rounding (tested against mlx-lm's cache).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from .errors import SpecmlxError


class Model(Protocol):
    """What these functions use of a loaded model (specmlx.loading.Model): its module runs
    the passes; its config and name go into a refusal."""

    module: nn.Module
    config: dict
    name: str


ENV = "SPECMLX_KV_PADDING"  # "1" always, "0" never, unset: where kernels are per shape


class PaddedKVCache(KVCache):
    """mlx-lm's KVCache whose keys and values are always the whole buffer."""

    def _capacity(self, new: int) -> int:
        """Buffer length once `new` more positions are stored: a multiple of `step`."""
        have = 0 if self.keys is None else self.keys.shape[2]
        need = self.offset + new
        return have if need <= have else -(-need // self.step) * self.step

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        start, capacity = self.offset, self._capacity(keys.shape[2])
        have = 0 if self.keys is None else self.keys.shape[2]
        if capacity > have:
            batch, heads, _, _ = keys.shape
            grow_k = mx.zeros((batch, heads, capacity - have, keys.shape[3]), keys.dtype)
            grow_v = mx.zeros((batch, heads, capacity - have, values.shape[3]), values.dtype)
            if self.keys is None:
                self.keys, self.values = grow_k, grow_v
            else:
                self.keys = mx.concatenate([self.keys, grow_k], axis=2)
                self.values = mx.concatenate([self.values, grow_v], axis=2)
        self.offset += keys.shape[2]
        self.keys[..., start : self.offset, :] = keys
        self.values[..., start : self.offset, :] = values
        if keys.shape[2] == 1:  # one query: mlx-lm's exact length and no mask
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        """(n, buffer length) booleans: causal over the stored positions, off beyond.

        A single query keeps mlx-lm's unpadded path: its kernel takes any length without
        a rebuild, and padding it cost plain decoding ~25% on the H200.
        """
        if n == 1:
            return super().make_mask(n, return_array=return_array, window_size=window_size)
        if window_size is not None:
            raise ValueError("PaddedKVCache does not support sliding-window attention")
        queries = mx.arange(self.offset, self.offset + n)[:, None]
        return mx.arange(self._capacity(n))[None] <= queries


def padding_wanted() -> bool:
    """Whether attention kernels are built per shape here (MLX CUDA), or ENV says so."""
    setting = os.environ.get(ENV, "")
    if setting in ("0", "1"):
        return setting == "1"
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def make_cache(module: nn.Module) -> list:
    """mlx-lm's prompt cache for `module`, padded where `padding_wanted()` and every layer
    uses a plain KVCache (sliding windows and state-space layers keep their own)."""
    caches = make_prompt_cache(module)
    if padding_wanted() and all(type(c) is KVCache for c in caches):
        return [PaddedKVCache() for _ in caches]
    return caches


# Kinds whose trim(n) drops exactly the last n positions and leaves the rest as it was.
EXACT_TRIM = (KVCache, QuantizedKVCache, ConcatenateKVCache)
# Kinds rewound from a checkpoint of their whole state (see the module's docstring).
REWOUND = (RotatingKVCache, ArraysCache, ChunkedKVCache)


def layers(cache: list) -> list:
    """Every layer's cache, the parts of a CacheList (hybrid layers) one by one."""
    out = []
    for layer in cache:
        out += layers(list(layer.caches)) if isinstance(layer, CacheList) else [layer]
    return out


def unrollable(cache: list) -> str | None:
    """The name of the first cache kind in `cache` that cannot be rolled back, or None."""
    return next(
        (type(c).__name__ for c in layers(cache) if not isinstance(c, EXACT_TRIM + REWOUND)),
        None,
    )


def trims_exactly(cache: list) -> bool:
    return all(isinstance(c, EXACT_TRIM) for c in layers(cache))


def check_rollback(*models) -> None:
    """Refuse, before anything is decoded, to speculate on a model whose cache a rejected
    draft could not be rolled back from exactly (it would emit text that is not the
    target's). Each of `models` is a loaded Model."""
    for model in models:
        kind = unrollable(make_prompt_cache(model.module))
        if kind is not None:
            arch = model.config.get("model_type", "this architecture")
            raise SpecmlxError(
                f"speculative decoding on {arch} ({model.name}) is not exact: its {kind} "
                "layers cannot be rolled back after a rejected draft; run the target "
                "alone (--no-draft, or num_draft=0)"
            )


def trim(cache: list, n: int) -> None:
    """Drop the last n positions of every layer, or fail loudly: a short trim would leave
    entries of rejected drafts behind, and the text that follows would not be the
    target's."""
    if n <= 0:
        return
    exact = trims_exactly(cache)
    trimmed = {layer.trim(n) for layer in cache} if exact else {0}
    if trimmed != {n}:
        raise SpecmlxError(
            f"internal: a cache rollback by {n} positions trimmed {sorted(trimmed)} "
            "(a layer held fewer positions, or cannot be trimmed); nothing after this "
            "would be exact"
        )


def checkpoint(cache: list) -> list | None:
    """What `rewind` needs to undo the next passes over `cache`; None where a trim does."""
    if trims_exactly(cache):
        return None
    return [c.offset if isinstance(c, EXACT_TRIM) else _hold(c.state) for c in layers(cache)]


def rewind(model: Model, cache: list, saved: list | None, kept: list[int], dropped: int) -> int:
    """Drop the last `dropped` positions that the passes since `saved` added; `kept` are
    the tokens of those passes that stay. Returns how many tokens had to be run again."""
    if dropped <= 0:
        return 0
    if saved is None:
        trim(cache, dropped)
        return 0
    every = layers(cache)
    if all(isinstance(c, EXACT_TRIM) or _cuttable(c, dropped) for c in every):
        for c in every:
            _cut(c, dropped) if isinstance(c, RotatingKVCache) else trim([c], dropped)
        return 0
    restore(cache, saved)
    prefill(model, cache, kept)
    return len(kept)


def restore(cache: list, saved: list) -> None:
    """Put every layer of `cache` back as `checkpoint` found it (the layers must be the
    ones it saw, and have only grown or been restored since)."""
    for c, state in zip(layers(cache), saved, strict=True):
        if isinstance(c, EXACT_TRIM):
            trim([c], c.offset - state)
        else:
            c.state = _hold(state)


def state_of(cache: list) -> list:
    """Every layer's whole state, as views (see _hold), before a pass that is built but
    may never run: `set_state` takes that pass back out unrun. (A trim would only move the
    offsets: the pass's writes would stay in the arrays, and be computed when next read.)
    Drop it before the pass runs: while its views live, the pass copies each layer's
    arrays instead of writing into them."""
    return [_hold(c.state) for c in layers(cache)]


def set_state(cache: list, states: list) -> None:
    for c, state in zip(layers(cache), states, strict=True):
        c.state = state


def _hold(state):
    """The state with each array replaced by a view of it: the cache's own arrays may be
    written in place after this, the views keep what they held."""
    if isinstance(state, (list, tuple)):
        return type(state)(_hold(x) for x in state)
    return state[...] if isinstance(state, mx.array) else state


def _cuttable(c, n: int) -> bool:
    """Whether a sliding window's last n positions can be cut off as they are: it is in
    time order with the newest last, and cutting them leaves every position the window
    still needs (nothing was evicted yet, or a pass over several tokens kept window +
    tokens - 1 of them, as mlx-lm does, so that every new token saw a whole window)."""
    if not isinstance(c, RotatingKVCache) or c.keys is None or c._idx != c.keys.shape[2]:
        return False
    return c._idx > n and (c.offset == c._idx or c._idx - n >= c.max_size)


def _cut(c: RotatingKVCache, n: int) -> None:
    c.keys, c.values = c.keys[..., : c._idx - n, :], c.values[..., : c._idx - n, :]
    c._idx -= n
    c.offset -= n


# Kinds a tree of drafts can be verified on in one pass and cut to its accepted path: those
# that keep every position, and sliding windows, which a pass over several tokens leaves in
# time order with the new entries last (see _cuttable).
TREE_KINDS = (*EXACT_TRIM, RotatingKVCache)


def verifies_trees(cache: list) -> bool:
    return all(isinstance(c, TREE_KINDS) for c in layers(cache))


def keep_rows(cache: list, rows: list[int], written: int) -> None:
    """After a tree pass wrote `written` entries, the newest of each layer, keep those of
    the pass rows `rows` (ascending), moved up to follow the entries before the pass, and
    drop the rest."""
    moved = rows != list(range(len(rows)))
    for c in layers(cache):
        # where the pass's entries start: a window holds them last, in time order
        end = c._idx if isinstance(c, RotatingKVCache) else c.offset
        start = end - written
        if moved:
            index = mx.array([start + r for r in rows], mx.uint32)
            for a in _arrays((c.keys, c.values)):
                a[..., start : start + len(rows), :] = mx.take(a, index, axis=2)
        dropped = written - len(rows)
        if isinstance(c, RotatingKVCache):
            if dropped and not _cuttable(c, dropped):
                raise SpecmlxError("internal: a tree's window could not be cut to its path")
            if dropped:
                _cut(c, dropped)
        elif c.trim(dropped) != dropped:
            raise SpecmlxError("internal: a tree's cache could not be cut to its kept path")


def _arrays(state) -> list:
    """The arrays of a layer's keys and values (a quantized cache keeps three each)."""
    if isinstance(state, (list, tuple)):
        return [a for part in state for a in _arrays(part)]
    return [state]


PREFILL_STEP = 512  # tokens per prefill chunk: bounds the activations' memory


def prefill(
    model: Model,
    cache: list,
    tokens: list[int],
    step: int = PREFILL_STEP,
    progress: Callable[[int, int], None] | None = None,
    forward: Callable[[mx.array, list], mx.array] | None = None,
) -> list[mx.array]:
    """Run `tokens` through `model` into `cache`, in chunks so memory stays bounded.

    `progress` is called with (tokens done, tokens in all): before the first chunk and
    after each one. `forward(x (1, L), cache)`: the pass to run instead of the model's
    own, whose outputs (one per chunk) are returned (the target's features for a drafter
    that reads them); by default nothing is returned (the logits are never computed)."""
    if progress is not None and tokens:
        progress(0, len(tokens))
    kept = []
    for start in range(0, len(tokens), step):
        chunk = mx.array(tokens[start : start + step], mx.uint32)[None]
        out = (forward or model.module)(chunk, cache=cache)
        if forward is not None:
            kept.append(out)
        mx.eval([c.state for c in cache], kept[-1:])
        if progress is not None:
            progress(min(start + step, len(tokens)), len(tokens))
    return kept


def timed_pass(
    model: Model,
    cache: list,
    tokens: list[int],
    forward: Callable[[mx.array, list], mx.array] | None = None,
) -> float:
    """Seconds for one forward pass over `tokens`; the cache is left as it was.
    `forward(x, cache)`: the pass to time over the (k,) tokens x, where it is not the
    model's own (a draft head cut to a sub-vocabulary)."""
    saved = checkpoint(cache)
    start = time.perf_counter()
    x = mx.array(tokens, mx.uint32)
    mx.eval(forward(x, cache) if forward is not None else model.module(x[None], cache=cache))
    seconds = time.perf_counter() - start
    rewind(model, cache, saved, [], len(tokens))
    return seconds


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share (mlx_lm.utils has one, but importing that
    module imports transformers)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


@dataclass
class Snapshot:
    """A cache that cannot be trimmed, as it was when it held `tokens` (a call's prompt):
    a later call whose prompt starts with them restores it instead of prefilling from
    the start (the same prompt again with another seed, a bench's repeats). It holds
    views of the layers' arrays, so a sliding window's buffer is copied once by the next
    write into it."""

    tokens: list[int]
    layers: list  # the layer objects it was taken of: a remade cache cannot restore it
    saved: list

    def fits(self, cache: list, tokens: list[int]) -> bool:
        now = layers(cache)
        prefix = common_prefix_len(self.tokens, tokens) == len(self.tokens)
        if len(now) != len(self.layers) or not prefix:
            return False
        # the same layers; one that trims holds what it held then, and more, never less
        return all(
            c is was and (not isinstance(c, EXACT_TRIM) or c.offset >= offset)
            for c, was, offset in zip(now, self.layers, self.saved, strict=True)
        )


def snapshot(cache: list, tokens: list[int]) -> Snapshot | None:
    """A Snapshot of `cache`, which holds `tokens`; None where trims roll it back."""
    if trims_exactly(cache) or not tokens:
        return None
    return Snapshot(list(tokens), layers(cache), checkpoint(cache))


def align_cache(
    model: Model,
    cache: list,
    cached: list[int],
    tokens: list[int],
    saved: Snapshot | None = None,
) -> int:
    """Trim `cache` to the longest prefix of `tokens` it holds; return that length.

    `cached` is what the cache held at the end of the last complete round, or [] when a
    round was interrupted mid-pass. A cache that cannot be trimmed exactly (a sliding
    window, a recurrent state) is kept only when it holds a prefix of `tokens` as it is,
    else restored from `saved` where that fits, and otherwise made anew, to be
    prefilled from the start.
    """
    keep = common_prefix_len(cached, tokens)
    if not trims_exactly(cache):
        if cached and keep == len(cached):
            return keep
        if saved is not None and saved.fits(cache, tokens):
            restore(cache, saved.saved)
            cached[:] = saved.tokens
            return len(cached)
        cache[:] = make_cache(model.module)
        cached.clear()
        return 0
    offset = cache[0].offset if cache and hasattr(cache[0], "offset") else len(cached)
    if offset > len(cached):  # an interrupted round's extra entries
        trim(cache, offset - len(cached))
    elif offset < len(cached):  # never expected; start over rather than trust it
        cache[:] = make_cache(model.module)
        cached.clear()
        return 0
    trim(cache, len(cached) - keep)
    del cached[keep:]
    return keep


def sync_cache(
    model: Model,
    cache: list,
    cached: list[int],
    tokens: list[int],
    progress: Callable[[int, int], None] | None = None,
    saved: Snapshot | None = None,
    forward: Callable[[mx.array, list], mx.array] | None = None,
) -> tuple[int, list[mx.array]]:
    """Make `cache` hold exactly `tokens`, reusing the longest prefix it already holds
    (or `saved`: see align_cache).

    Returns how many tokens had to be processed (the prefill of this call, which
    `progress` follows) and what `forward` returned over them (see `prefill`).
    """
    keep = align_cache(model, cache, cached, tokens, saved)
    out = prefill(model, cache, tokens[keep:], progress=progress, forward=forward)
    cached.extend(tokens[keep:])
    return len(tokens) - keep, out
