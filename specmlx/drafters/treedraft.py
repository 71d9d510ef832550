"""Drafting a tree: several candidates at the positions where the drafter is unsure.

What any drafter that can score more than one candidate shares (the draft model here; a
feature head can call the same function with its own step).
"""

from __future__ import annotations

import mlx.core as mx


def without_replacement(probs: mx.array, tried: mx.array) -> mx.array:
    """`probs` (V,) with the tokens `tried` (k,) zeroed and the rest renormalised: the
    distribution the next sibling is drawn from when siblings are drawn without
    replacement, and so the q the verify must judge it with (Recursive Speculative
    Decoding; verify.accept_tree_reject says why it stays exact)."""
    left = mx.where(mx.any(mx.arange(probs.shape[-1])[None] == tried[:, None], axis=0), 0.0, probs)
    return left / mx.sum(left)
