"""What crosses between a drafter and the Target in one round: the drafter's Proposal (a
chain or a tree of drafts, with the distributions they were drawn from) and the Target's
Verdict on it. Both sides import this module; neither imports the other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from . import tree

# draw(logits, key) -> (probs, token): the call's compiled sampler (probs None when
# greedy). Where `draw.full_width` is set (coupled sampling) it wants logits over the full
# vocabulary, which a drafter over fewer tokens widens with -inf.
Draw = Callable[[mx.array, mx.array], tuple[mx.array | None, mx.array]]
# go_on(tops) -> bool: shown the drafter's own top probability at each draft made so far
# in this round (it reads its own confidence); False ends the proposal there.
GoOn = Callable[[list[float]], bool]


@dataclass
class Proposal:
    """What a drafter proposed for one round.

    `tokens` (g,) and `q` (g, V) may still be lazy. q None means: greedy (not needed), or,
    at temperature > 0, drafts that are guesses rather than samples (the target judges
    them as point masses). `parents` None is a chain; else node j hangs under node
    parents[j] (-1: the last emitted token), parents before children (specmlx.tree), and
    siblings in the order the verify tries them. In a tree, q[j] is the distribution node
    j was drawn from given everything drawn before it: for siblings drawn without
    replacement, the drafter's distribution with the earlier siblings removed and
    renormalised (verify.accept_tree_reject; drafters.treedraft does this).
    The other fields tell the γ policy how clean a figure of the draft's cost this is.
    """

    tokens: mx.array
    q: mx.array | None = None
    parents: list[int] | None = None
    # Tokens the draft model took with its first pass besides the one it drafted from
    # (what it missed while it sat out); 0 for drafters without a model.
    fed: int = 0
    # A Session's first proposal from a model: it pays one-time work (first use of the
    # weights, kernels built) and is no figure of a pass.
    first: bool = False
    # Seconds spent taking the call's prompt before drafting: prefill, not decode.
    prompt_s: float = 0.0
    # Seconds of a draft pass that a cost probe re-timed for the policy, or None.
    timed_draft_s: float | None = None
    # The drafter's own top probability at each draft, where it read them (go_on).
    tops: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.parents is not None:
            tree.check(self.parents)
            if len(self.parents) != self.tokens.shape[0]:
                raise ValueError("a tree proposal needs one parent per token")
            if tree.is_chain(self.parents):
                self.parents = None

    @property
    def is_chain(self) -> bool:
        return self.parents is None

    def along(self, path: list[int]) -> Proposal:
        """The chain of the nodes on `path`, with their q."""
        index = mx.array(path, mx.uint32)
        q = None if self.q is None else self.q[index]
        tops = [self.tops[j] for j in path if j < len(self.tops)]
        return Proposal(self.tokens[index], q, None, self.fed, self.first, self.prompt_s, tops=tops)


@dataclass
class Verdict:
    """The target's judgement of a round, shown to every drafter.

    `accepted` drafts of the proposal passed (the nodes on `path`, root's child first),
    then the target chose `token`; `emitted` is the text's growth. `hidden`: the target's
    last hidden states at [root, *accepted drafts] (one row each), where a drafter that
    reads them asked for them (None otherwise). `tops(k)` reads the target's top
    probability at the round's first k judged positions (the policy's forecast of
    acceptance; read only when asked, off the path from one pass to the next)."""

    accepted: int
    token: int
    path: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)  # the accepted drafts' tokens
    hidden: mx.array | None = None
    verify_s: float = 0.0
    rewind_s: float = 0.0  # rolling back a cache that cannot be trimmed, by running again
    rerun: int = 0  # tokens run again for that
    tree_as_chain: bool = False  # a tree this target could not verify whole: its first path
    tops: Callable[[int], list[float]] = lambda k: []
    # logprobs(k): per emitted token, (its log-probability, the k most likely (id, lp));
    # read only where a call asks for them (target.logprobs)
    logprobs: Callable[[int], list] = lambda k: []

    @property
    def emitted(self) -> list[int]:
        return [*self.drafts, self.token]


def point_mass(drafts: mx.array, vocab_size: int) -> mx.array:
    """The one-hot q of drafts that are guesses rather than samples (lookup, probes)."""
    return (mx.arange(vocab_size)[None] == drafts[:, None]).astype(mx.float32)
