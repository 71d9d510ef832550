"""A forward pass over a tree's rows: each row attends to the cached context and its own
ancestors, at the position of its depth.

Nothing of the model is rewritten: for the length of the pass each cache layer's
`make_mask` is replaced by a tree mask and each attention layer's RoPE by one that
places every row at its own position (tree_pass). The Target verifies a whole tree in
one pass (tree_mask); a drafter grows one pass at a time over a tree whose earlier
nodes are already in its cache (grown_mask).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import RotatingKVCache

from .caches import EXACT_TRIM, layers
from .cpu.attention import tree_masks

MakeMask = Callable[..., mx.array]


def rope_owners(module: nn.Module) -> list[nn.Module]:
    """The modules (attention layers) that hold a `rope`: where a tree's positions go."""
    return [m for _, m in module.named_modules() if isinstance(m, nn.Module) and "rope" in m]


@contextmanager
def tree_pass(
    cache: list, owners: list[nn.Module], masks: list[MakeMask], at: list[int]
) -> Iterator:
    """Within the block, a pass over rows whose positions are the cache's offset plus
    `at` (one per row) and whose masks are `masks` (one make_mask per layer of
    caches.layers(cache))."""
    every = layers(cache)
    for c, mask in zip(every, masks, strict=True):
        c.make_mask = mask
    for owner in owners:
        owner["rope"] = TreeRoPE(owner["rope"], at)
    try:
        with tree_masks():
            yield
    finally:
        for c in every:
            del c.make_mask
        for owner in owners:
            owner["rope"] = owner["rope"].inner


class TreeRoPE(nn.Module):
    """A layer's RoPE at each row's own position (offset + its `at`), in runs of rows
    whose positions follow one another (a chain's rows are one run)."""

    def __init__(self, inner: nn.Module, at: list[int]):
        super().__init__()
        self.inner = inner
        self.runs = []  # (first row, rows, position of the first less the offset)
        for row, depth in enumerate(at):
            if self.runs and at[row - 1] + 1 == depth:
                first, count, start = self.runs[-1]
                self.runs[-1] = (first, count + 1, start)
            else:
                self.runs.append((row, 1, depth))

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        parts = [
            self.inner(x[..., first : first + count, :], offset=offset + at)
            for first, count, at in self.runs
        ]
        return mx.concatenate(parts, axis=-2)


def tree_mask(c, depths: list[int], ancestry: mx.array, dtype: mx.Dtype) -> MakeMask:
    """A cache layer's make_mask for a pass over a whole tree: each row sees the cached
    positions a chain row at its depth would see (windows included), and its own
    ancestors. A sliding window's mask is additive, in the model's dtype: a boolean one
    of its shape is read by the native attention op as a plain window, which a tree's
    rows are not."""
    own = type(c).make_mask
    window = isinstance(c, RotatingKVCache)
    depth = mx.array(depths)

    def make_mask(n: int, return_array: bool = False, window_size: int | None = None):
        base = own(c, n, return_array=True, window_size=window_size)[depth]
        start = base.shape[1] - n if window else c.offset  # where the pass's own rows are
        near = ancestry
        if window_size is not None:  # an ancestor further back than the window is out
            near = near & (depth[:, None] - depth[None, :] < window_size)
        base[:, start : start + n] = near
        if not window:
            return base
        return mx.where(base, mx.array(0, dtype), mx.array(-mx.inf, dtype))

    return make_mask


def grows_trees(cache: list) -> bool:
    """Whether a tree can grow in `cache` pass by pass (grown_mask): every layer keeps
    every position in order, so a node's entry stays where it was written."""
    return all(isinstance(c, EXACT_TRIM) for c in layers(cache))


def grown_mask(start: int, positions: list[int], seen: mx.array, dtype: mx.Dtype) -> MakeMask:
    """make_mask for a pass over new nodes of a tree whose earlier nodes are cached (a
    layer that grows_trees): the cache holds the context in its first `start` entries,
    then the tree's nodes in the order they were run; `positions` are those nodes' and
    the new rows' positions (the new rows last), `seen` (new rows, every node) whether a
    row sees a node: its ancestors and itself. Every row sees the whole context (within
    a window, where the model asks for one: the mask is then additive, as tree_mask's)."""
    rows = seen.shape[0]

    def make_mask(n: int, return_array: bool = False, window_size: int | None = None):
        mask = mx.concatenate([mx.ones((n, start), mx.bool_), seen], axis=1)
        if window_size is None:
            return mask
        cols = mx.concatenate([mx.arange(start), mx.array(positions)])
        near = mx.array(positions[-rows:])[:, None] - cols[None, :] < window_size
        return mx.where(mx.logical_and(mask, near), mx.array(0, dtype), mx.array(-mx.inf, dtype))

    return make_mask
