"""A bounded pool of Sessions: requests reuse the caches that already hold their prefix.

Each Session is a target cache (and a draft cache) holding one token sequence. A request
takes the Session that shares the longest prefix with its prompt, so a conversation's
next turn, or a prompt repeating a long system prompt, prefills only what is new. After
each request the least recently used Sessions are dropped until the caches fit the
memory budget. Only the decode worker's thread touches the pool.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten

from ..caches import common_prefix_len, layers
from ..engine import Session
from ..loading import Model

# A prompt that shares little with every Session gets a new one, up to this many; past it,
# the closest (or the least recently used) is taken over. Empty Sessions cost little.
MAX_SESSIONS = 16


class SessionPool:
    def __init__(self, target: Model, draft: Model | None, budget_bytes: int):
        self.target, self.draft = target, draft
        self.budget_bytes = budget_bytes
        self.idle: list[Session] = []  # least recently used first
        self.cache_bytes = 0  # of the idle Sessions, after the last request

    def take(self, ids: list[int], mirror=None) -> Session:
        """The Session whose cached tokens share the longest prefix with `ids`, unless
        taking it over would throw away another conversation for a small gain: a prompt
        that extends a Session's whole history (a chat's next turn) takes it; one that
        shares less than half of itself with the best gets a new Session while there is
        room, so that interleaved conversations keep a cache each. `mirror` (worker.Mirror):
        where the target is split over ranks, rank 0's choice is every rank's."""
        choice = self.choose(ids)
        if mirror is not None:
            choice = mirror.numbers([choice])[0]
        if choice < 0:
            return Session(self.target, self.draft)
        return self.idle.pop(choice)

    def choose(self, ids: list[int]) -> int:
        """take's choice: the index of an idle Session, or -1 for a new one."""
        # The most recently used wins a tie: it is the likeliest to be asked again.
        best = max(
            reversed(self.idle), key=lambda s: common_prefix_len(s.target.cached, ids), default=None
        )
        shared = common_prefix_len(best.target.cached, ids) if best is not None else 0
        room = len(self.idle) < MAX_SESSIONS
        extends = best is not None and 0 < shared == len(best.target.cached)
        if best is None or (room and not extends and (shared == 0 or shared < len(ids) // 2)):
            return -1
        return self.idle.index(best) if shared > 0 else 0  # no room: the least recently used

    def give_back(self, session: Session, mirror=None) -> None:
        """Return a Session after its request; drop the oldest until the budget holds.
        `mirror`: where the target is split over ranks, rank 0's measure decides on every
        rank (a rank's caches hold its part of the target's; only rank 0's drafters run)."""
        self.idle.append(session)
        sizes = [session_bytes(s) for s in self.idle]
        drop = 0
        while sum(sizes[drop:]) > self.budget_bytes and len(self.idle) - drop > 1:
            drop += 1
        reset = sum(sizes[drop:]) > self.budget_bytes  # the one just used, alone over it
        if mirror is not None:
            drop, reset = mirror.numbers([drop, int(reset)])
        del self.idle[:drop], sizes[:drop]
        if reset:
            session.reset()
            sizes = [0]
        self.cache_bytes = sum(sizes)


def session_bytes(session: Session) -> int:
    """What a Session's caches hold: every array of the target's and its drafters' layers."""
    caches = [session.target.cache] + session.drafter_caches()
    return sum(
        value.nbytes
        for cache in caches
        for layer in layers(cache)
        for _, value in tree_flatten(vars(layer))
        if isinstance(value, mx.array)
    )
