"""Where draft tokens come from: drafters by name.

A drafter implements the protocol in protocol.py (`start`, `propose`, `commit`) and is
registered here under a name: the name is what `--draft-mode` and the server's
`draft_mode` take, and what Stats counts its rounds under. The engine, the γ policy, the
CLI and the server read what a drafter needs from its registration and its attributes
(`free`: its drafts cost no model pass; `reads_hidden`: the target's last hidden states
come to it in each Verdict; `trees`: it drafts a tree when propose is given a `tree`
shape), never from its class or name. `generate(..., drafter=obj)`
runs any object that implements the protocol, registered or not.

This module stays light (no MLX import) so that option checks can read the names; each
built-in drafter's module is imported when one is made.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import SpecmlxError

if TYPE_CHECKING:
    from ..heads.head import Head
    from ..loading import Model
    from .protocol import Drafter

AUTO = "auto"  # every registered drafter that can run here, free ones tried first


@dataclass(frozen=True)
class Sources:
    """What a drafter may be made from."""

    draft: Model | None  # a draft model
    head: Head | None  # a head that drafts from the target's features
    width: int  # the vocabulary verify compares over


@dataclass(frozen=True)
class DrafterKind:
    name: str
    # Sources -> a drafter, or None where it cannot run (what it needs is not loaded)
    make: Callable[[Sources], Drafter | None]
    summary: str
    needs_model: bool = False  # runs a draft model, which must be loaded
    needs_head: bool = False  # runs a head (heads/), which must be loaded
    reads_hidden: bool = False  # drafts from the target's last hidden states
    free: bool = False  # its drafts cost no model pass: the policy prices them at 0
    rollback: str = "nothing to roll back"  # how it undoes a rejected draft
    idle: str = "it found nothing to propose"  # why it sat out a call, for the stats line


_KINDS: dict[str, DrafterKind] = {}


def register(kind: DrafterKind) -> DrafterKind:
    if kind.name == AUTO or kind.name in _KINDS:
        raise ValueError(f"a drafter named {kind.name!r} is already registered")
    _KINDS[kind.name] = kind
    return kind


def kinds() -> list[DrafterKind]:
    return list(_KINDS.values())


def kind(name: str) -> DrafterKind | None:
    return _KINDS.get(name)


def modes() -> list[str]:
    """What --draft-mode takes: each drafter's name, and auto."""
    return [*_KINDS, AUTO]


def check_mode(mode: str | None) -> str | None:
    if mode is not None and mode not in modes():
        raise SpecmlxError(f"draft mode must be one of {', '.join(modes())}, got {mode!r}")
    return mode


def default_mode(has_draft: bool) -> str:
    """With a draft model or a head, every drafter (a matched n-gram's drafts cost no
    draft pass, and both together beat the model alone: bench/results/draft-modes-*.json);
    without either, the model drafter, which has nothing to run: plain decoding, so
    --no-draft is the target alone."""
    return AUTO if has_draft else "model"


def uses_model(mode: str | None) -> bool:
    """Whether this mode can run the draft model (so a loaded one must roll back)."""
    chosen = kinds() if mode in (None, AUTO) else [k for k in kinds() if k.name == mode]
    return any(k.needs_model for k in chosen)


def select(mode: str, sources: Sources, made: dict[str, Drafter]) -> list:
    """The drafters `mode` runs here, free ones first; `made` keeps each across calls (a
    draft model's cache persists in a Session)."""
    chosen = kinds() if mode == AUTO else [_KINDS[mode]]
    out = []
    for k in sorted(chosen, key=lambda k: not k.free):
        if k.name not in made:
            made[k.name] = k.make(sources)
        if made[k.name] is not None:
            out.append(made[k.name])
    return out


def is_free(drafter: Any) -> bool:
    return bool(getattr(drafter, "free", False))


def grows_trees(drafter: Any) -> bool:
    """Whether it drafts trees when asked (propose's `tree`: a tree.Shape)."""
    return bool(getattr(drafter, "trees", False))


def reads_hidden(drafter: Any) -> bool:
    return bool(getattr(drafter, "reads_hidden", False))


def taps(drafter: Any) -> tuple[int, ...] | None:
    """The target layers whose outputs a drafter that reads hidden states takes (None:
    the last hidden states; Target.set_hidden)."""
    return getattr(drafter, "taps", None)


def _lazy(module: str, factory: str) -> Callable:
    def make(sources: Sources):
        return getattr(importlib.import_module(module, __name__), factory)(sources)

    return make


register(
    DrafterKind(
        "lookup",
        _lazy(".lookup", "make"),
        "prompt lookup: what followed the last n-gram's previous occurrence in the text",
        free=True,
        idle="no n-gram of the context matched",
    )
)
register(
    DrafterKind(
        "model",
        _lazy(".model", "make"),
        "a smaller model with the target's tokenizer, its head cut to frequent tokens",
        needs_model=True,
        rollback="its own cache, trimmed or rewound like the target's",
        idle="auto kept plain decoding",
    )
)

register(
    DrafterKind(
        "head",
        _lazy("..heads.drafter", "make"),
        "a feature head: one decoder layer over the target's own hidden states (EAGLE, MTP)",
        needs_head=True,
        reads_hidden=True,
        rollback="its own small cache, trimmed",
        idle="auto kept plain decoding",
    )
)


def check_exact(
    target: Model, draft: Model | None, mode: str | None, gamma: int | str, head: bool = False
) -> None:
    """Refuse at start-up, in one line, a setting that would speculate on a model whose
    cache a rejected draft cannot be rolled back from (caches.check_rollback). `draft`:
    the draft model, or a head (heads.is_head); `head`: a head is loaded too."""
    from ..heads import is_head

    if is_head(draft):
        draft, head = None, True
    mode = mode or default_mode(draft is not None or head)
    chosen = kinds() if mode == AUTO else [_KINDS[mode]]
    running = [
        k for k in chosen if (draft is not None or not k.needs_model) and (head or not k.needs_head)
    ]
    if gamma == 0 or not running:
        return
    from ..caches import check_rollback

    models = [draft] if draft is not None and any(k.needs_model for k in running) else []
    check_rollback(target, *models)
