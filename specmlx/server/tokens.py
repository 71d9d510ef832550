"""What a reply says of its tokens: OpenAI's `logprobs` (chat's and text completions'
shapes) and specmlx's own per-token record of where each came from, from the engine's
Steps (engine.Step: the processed target's log-probabilities, the drafter whose draft
was accepted)."""

from __future__ import annotations

from collections.abc import Callable

from ..engine import Step
from .worker import Finished


def kept(steps: list[Step], done: Finished) -> list[Step]:
    """The Steps behind the reply's text: all of them, or where a stop string cut it
    short, those that begin before it ends."""
    if not done.cut:
        return steps
    out, at = [], 0
    for step in steps:
        if at >= len(done.text):
            break
        out.append(step)
        at += len(step.text)
    return out


class TokenText:
    """Each token id's own text, as OpenAI's logprobs show it (decoded alone: a token that
    holds part of a character shows U+FFFD, and its `bytes` say so), remembered."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.known: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        if token not in self.known:
            self.known[token] = self.decode([token])
        return self.known[token]


def chat_logprobs(steps: list[Step], text: TokenText) -> dict:
    """choice.logprobs of a chat completion (or of one chunk of its stream)."""

    def entry(token: int, logprob: float) -> dict:
        shown = text(token)
        return {"token": shown, "logprob": logprob, "bytes": list(shown.encode("utf-8"))}

    content = [
        {**entry(s.token, s.logprob), "top_logprobs": [entry(t, lp) for t, lp in s.top_logprobs]}
        for s in steps
    ]
    return {"content": content, "refusal": None}


def text_logprobs(steps: list[Step], text: TokenText, offset: int) -> dict:
    """choice.logprobs of a text completion (or of one chunk of its stream), its first
    token `offset` characters into the completion."""
    offsets = []
    for s in steps:
        offsets.append(offset)
        offset += len(s.text)
    return {
        "tokens": [text(s.token) for s in steps],
        "token_logprobs": [s.logprob for s in steps],
        "top_logprobs": [{text(t): lp for t, lp in s.top_logprobs} for s in steps],
        "text_offset": offsets,
    }


def sources(steps: list[Step]) -> list[dict]:
    """specmlx's record of each token, for a client that shows speculation at work (the
    chat page): its text, the drafter whose accepted draft it was (None: the target's own
    sample) and how many drafts its round proposed."""
    return [{"text": s.text, "drafter": s.drafter, "round_drafts": s.round_drafts} for s in steps]
