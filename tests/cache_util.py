"""What a native op that writes the KV cache in place must keep true, checked on a model:
shared by the cached-attention and fused-layer tests."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from specmlx.caches import make_cache


def buffer_address(a: mx.array) -> int:
    view = np.asarray(a)  # a view of a's buffer, dropped at once: it would hold the buffer
    return view.__array_interface__["data"][0]


def assert_decode_writes_the_cache_in_place(module) -> None:
    cache = make_cache(module)
    mx.eval(module(mx.array([[1, 2, 3]]), cache=cache))
    mx.eval(module(mx.array([[4]]), cache=cache))
    before = buffer_address(cache[0].keys)
    for token in (5, 6, 7):
        mx.eval(module(mx.array([[token]]), cache=cache))
    assert buffer_address(cache[0].keys) == before


def assert_a_held_cache_array_keeps_its_contents(module, which: str) -> None:
    """`which`: "keys" or "values", the array a caller holds (as one reading the cache's
    state would) while the next step runs."""
    cache = make_cache(module)
    mx.eval(module(mx.array([[1, 2, 3]]), cache=cache))
    held = getattr(cache[0], which)
    before = np.array(held)
    mx.eval(module(mx.array([[4]]), cache=cache))
    assert np.array_equal(np.array(held), before)
    assert not np.array_equal(np.array(getattr(cache[0], which))[..., 3, :], before[..., 3, :])
