"""Requests to token ids, so that a conversation's next turn matches the cache it built.

A client sends the whole conversation every turn, with the model's earlier replies as
text. Encoding that text afresh may split a reply into other tokens than the ones the
model generated (many token sequences decode to the same text), and the cache, which
holds the generated ones, would then match only up to the reply. So the chat texts
already decoded are remembered with their exact token ids, and a new prompt that
extends one encodes only what it adds (as `specmlx chat` does for its own turns).
"""

from __future__ import annotations

from collections import OrderedDict

from ..engine import encode_prompt
from ..errors import SpecmlxError
from ..loading import Model
from .errors import APIError

REMEMBERED = 64  # chat texts kept; each a prompt or a prompt and its reply


class Transcripts:
    """Chat texts the model has seen, each with the token ids it saw them as."""

    def __init__(self, limit: int = REMEMBERED):
        self.limit = limit
        self.known: OrderedDict[str, list[int]] = OrderedDict()

    def encode(self, tokenizer, text: str) -> list[int]:
        """`text` as token ids, those of the longest remembered text it starts with kept."""
        start = max((t for t in self.known if text.startswith(t)), key=len, default="")
        if not start:
            return tokenizer.encode(text, add_special_tokens=False)
        self.known.move_to_end(start)
        return self.known[start] + tokenizer.encode(text[len(start) :], add_special_tokens=False)

    def remember(self, text: str, ids: list[int]) -> None:
        self.known[text] = ids
        self.known.move_to_end(text)
        while len(self.known) > self.limit:
            self.known.popitem(last=False)


def chat_text(target: Model, messages: list[dict]) -> str:
    """The conversation rendered by the model's chat template, ready for its reply."""
    tokenizer = target.tokenizer
    if not getattr(tokenizer, "has_chat_template", False):
        raise APIError(
            400, f"{target.name} has no chat template; use /v1/completions", param="messages"
        )
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # the template's own checks (say, roles that must alternate)
        raise APIError(400, f"the chat template refused these messages: {e}", "messages") from e


def completion_ids(target: Model, prompt: str | list[int]) -> list[int]:
    """A completion prompt as `specmlx.generate` encodes it (ids are taken as they are)."""
    try:
        return encode_prompt(target, prompt)
    except SpecmlxError as e:
        raise APIError(400, str(e), param="prompt") from None


def check_context(target: Model, ids: list[int], param: str) -> int:
    """How many tokens the context leaves for the reply; a 400 naming the limit if none."""
    limit = target.config.get("max_position_embeddings")
    if not limit:
        return 2**31
    if len(ids) >= limit:
        raise APIError(
            400,
            f"the prompt is {len(ids)} tokens; {target.name} has a context of {limit} tokens "
            "(max_position_embeddings) for prompt and reply together",
            param=param,
            code="context_length_exceeded",
        )
    return limit - len(ids)
