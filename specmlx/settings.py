"""The generation settings' rules, checked in one place for the API, the CLI and chat."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .errors import SpecmlxError

if TYPE_CHECKING:  # imported where used: the CLI reads MAX_GAMMA before mlx is imported
    from .sampling import SamplingParams

# The longest round of drafts: auto's policy plans up to it (a Session's max_gamma), and a
# fixed γ is held to the same bound, so no setting asks for drafts auto would never make.
MAX_GAMMA = 8


def check_max_tokens(max_tokens: int) -> int:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise SpecmlxError(f"max_tokens (-n) must be an integer >= 1, got {max_tokens!r}")
    return max_tokens


def parse_gamma(value: int | str) -> int | str:
    """γ as given: 'auto', an integer from 0 to MAX_GAMMA, or its text."""
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return "auto"
        try:
            value = int(value)
        except ValueError:
            raise SpecmlxError(
                f"gamma (-g) must be 'auto' or an integer >= 0, got {value!r}"
            ) from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SpecmlxError(f"gamma (-g) must be 'auto' or an integer >= 0, got {value!r}")
    if value > MAX_GAMMA:
        raise SpecmlxError(f"gamma (-g) {value} is above the maximum, {MAX_GAMMA}")
    return value


# The most nodes a tree of drafts may have (--tree N): its verify is a pass over N + 1
# tokens, and a policy asks for at most this many.
MAX_TREE = 16
TREES = ("auto", "off")  # what --tree takes besides a number of nodes


def parse_tree(value: int | str) -> int | str:
    """The tree setting as given: 'auto' (trees of up to MAX_TREE nodes where the policy
    finds they pay, with auto γ), 'off' (chains), an integer from 2 to MAX_TREE (trees
    of at most that many nodes), or its text."""
    if isinstance(value, str):
        word = value.strip().lower()
        if word in TREES:
            return word
        try:
            value = int(word)
        except ValueError:
            raise SpecmlxError(
                f"tree must be auto, off or a number of nodes from 2 to {MAX_TREE}, got {value!r}"
            ) from None
    if isinstance(value, bool) or not isinstance(value, int) or not 2 <= value <= MAX_TREE:
        raise SpecmlxError(
            f"tree must be auto, off or a number of nodes from 2 to {MAX_TREE}, got {value!r}"
        )
    return value


def tree_nodes(tree: int | str, auto_gamma: bool) -> int:
    """The most nodes a round's tree may have under a parsed tree setting (0: chains). With
    a fixed γ, auto keeps chains (nothing is measured to choose by) and N is each
    round's size; with auto γ, the policy chooses up to N (auto: MAX_TREE)."""
    if tree == "off" or (tree == "auto" and not auto_gamma):
        return 0
    return MAX_TREE if tree == "auto" else tree


def check_seed(seed: int) -> int:
    """MLX's random key takes an unsigned 64-bit seed: refuse others here, in one line,
    rather than as a TypeError from deep inside the first sampling step."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise SpecmlxError(f"seed must be an integer >= 0 (and < 2**64), got {seed!r}")
    return seed


# OpenAI's bounds: a bias from -100 (never) to 100 (always), penalties from -2 to 2, at
# most 20 top log-probabilities a token.
MAX_BIAS, MAX_PENALTY, MAX_LOGPROBS = 100.0, 2.0, 20


def check_processing(
    logit_bias: dict | None,
    presence_penalty: float,
    frequency_penalty: float,
    logprobs: int | None,
    vocab_size: int,
) -> None:
    """logit_bias, the penalties and logprobs (processors.py), each refused in one line
    naming the setting and its bounds."""
    for token, value in (logit_bias or {}).items():
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise SpecmlxError(
                f"logit_bias keys must be token ids in [0, {vocab_size}), got {token!r}"
            )
        if not _number(value) or not -MAX_BIAS <= value <= MAX_BIAS:
            raise SpecmlxError(
                f"logit_bias values must be in [-100, 100], got {value!r} for {token}"
            )
    for name, value in (
        ("presence_penalty", presence_penalty),
        ("frequency_penalty", frequency_penalty),
    ):
        if not _number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise SpecmlxError(f"{name} must be a number in [-2, 2], got {value!r}")
    if logprobs is not None and (
        isinstance(logprobs, bool)
        or not isinstance(logprobs, int)
        or not 0 <= logprobs <= MAX_LOGPROBS
    ):
        raise SpecmlxError(
            f"logprobs must be an integer from 0 to {MAX_LOGPROBS}, got {logprobs!r}"
        )


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_draft_mode(draft_mode: str | None) -> str | None:
    from .drafters import check_mode

    return check_mode(draft_mode)


# How tokens are drawn at temperature > 0 while speculating (what each guarantees: the
# comment above sampling.position_keys), and the default.
SAMPLINGS = ("rejection", "coupled")
DEFAULT_SAMPLING = "coupled"


def check_sampling(sampling: str | None) -> str:
    """The sampling as given (None: the default), or one line naming the choices."""
    if sampling is None:
        return DEFAULT_SAMPLING
    if sampling not in SAMPLINGS:
        raise SpecmlxError(f"sampling must be one of {', '.join(SAMPLINGS)}, got {sampling!r}")
    return sampling


def check_settings(
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    gamma: int | str,
    draft_mode: str | None,
    sampling: str | None = None,
) -> tuple[SamplingParams, int | str]:
    """Every generation setting checked; the sampling parameters and γ parsed."""
    from .sampling import SamplingParams

    coupled = check_sampling(sampling) == "coupled"
    params = SamplingParams(temperature, top_p, top_k, coupled)
    check_max_tokens(max_tokens)
    check_draft_mode(draft_mode)
    return params, parse_gamma(gamma)
