"""Requests to token ids: the chat template rendered so that only its own markers are
control tokens, and a conversation's next turn matched to the cache it built.

A special token typed in a message (`<|im_end|><|im_start|>system ...`) must reach the
model as the text it is, not as the marker it spells, or a user can end their own turn
and write the system's. So every string a client sends (contents, names, tool
definitions and calls) has its special-token strings swapped for placeholders before the
template renders it; the rendered text is encoded with special tokens parsed, as
templates expect, and each placeholder as its string spelled out in plain text.

A client sends the whole conversation every turn, with the model's earlier replies as
text. Encoding that text afresh may split a reply into other tokens than the ones the
model generated (many token sequences decode to the same text), and the cache, which
holds the generated ones, would then match only up to the reply. So the chat texts
already decoded are remembered with their exact token ids, and a new prompt that
extends one encodes only what it adds (as `specmlx chat` does for its own turns).

These run on worker threads, never on the event loop: a long prompt takes a while to
render and encode.
"""

from __future__ import annotations

import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable

from tokenizers import Tokenizer

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
        self._lock = threading.Lock()  # requests are prepared on several threads at once

    def encode(self, text: str, encode: Callable[[str], list[int]]) -> list[int]:
        """`text` as token ids, those of the longest remembered text it starts with kept
        and the rest encoded by `encode`."""
        with self._lock:
            start = max((t for t in self.known if text.startswith(t)), key=len, default="")
            ids = self.known[start] if start else []
            if start:
                self.known.move_to_end(start)
        return ids + encode(text[len(start) :])

    def remember(self, text: str, ids: list[int]) -> None:
        with self._lock:
            self.known[text] = ids
            self.known.move_to_end(text)
            while len(self.known) > self.limit:
                self.known.popitem(last=False)


class ChatPrompts:
    """The target's chat template, rendered and encoded with the client's text as text."""

    def __init__(self, target: Model):
        self.target = target
        tokenizer = target.tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", {}).values()
        specials = sorted({t.content for t in added if t.special and t.content}, key=len)
        # Private-use characters around a nonce: text no template writes and no tokenizer
        # reads as a special token. (A client who typed one anyway would only get the
        # special token's string as text in its place: never a control token.)
        nonce = secrets.token_hex(4)
        self.placeholder = {s: f"\U000f0000{nonce}{i}\U000f0001" for i, s in enumerate(specials)}
        self.spelled = {p: s for s, p in self.placeholder.items()}
        # Longest first, so that a special token containing another is swapped whole.
        self._specials = _alternation(reversed(specials))
        self._placeholders = _alternation(self.spelled)
        self._plain: Callable[[str], list[int]] | None = None
        self._lock = threading.Lock()

    def render(self, messages: list[dict], tools: list[dict] | None) -> str:
        """The conversation rendered by the chat template, ready for the model's reply,
        with placeholders where the client's text spells a special token."""
        tokenizer = self.target.tokenizer
        if not getattr(tokenizer, "has_chat_template", False):
            raise APIError(
                400,
                f"{self.target.name} has no chat template; use /v1/completions",
                param="messages",
            )
        extra = {"tools": self._defang(tools)} if tools else {}
        try:
            return tokenizer.apply_chat_template(
                self._defang(messages), tokenize=False, add_generation_prompt=True, **extra
            )
        except Exception as e:  # the template's own checks (say, roles that must alternate)
            raise APIError(400, f"the chat template refused these messages: {e}", "messages") from e

    def encode(self, text: str) -> list[int]:
        """A rendered text's ids: special tokens parsed, placeholders spelled out as text."""
        encode = self.target.tokenizer.encode
        if self._placeholders is None:
            return encode(text, add_special_tokens=False)
        ids, at = [], 0
        for found in self._placeholders.finditer(text):
            if found.start() > at:
                ids += encode(text[at : found.start()], add_special_tokens=False)
            ids += self._plain_encoder()(self.spelled[found[0]])
            at = found.end()
        if at < len(text):
            ids += encode(text[at:], add_special_tokens=False)
        return ids

    def _defang(self, value):
        """`value` (a message, a tool, any JSON value) with every special-token string in
        its strings, keys too, swapped for its placeholder. (Depth is bounded: read_json
        refuses a body nested deeper than fields.MAX_DEPTH.)"""
        if self._specials is None:
            return value
        if isinstance(value, str):
            return self._specials.sub(lambda m: self.placeholder[m[0]], value)
        if isinstance(value, dict):
            return {self._defang(k): self._defang(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._defang(v) for v in value]
        return value

    def _plain_encoder(self) -> Callable[[str], list[int]]:
        """An encoder that reads no special token: a copy of the tokenizer's Rust pipeline
        with encode_special_tokens set, made on first need (a copy, since setting the flag
        on the shared one would race with encodes on other threads)."""
        with self._lock:
            if self._plain is None:
                self._plain = plain_encoder(self.target.tokenizer)
        return self._plain


def plain_encoder(tokenizer) -> Callable[[str], list[int]]:
    """`text` -> ids with special-token strings encoded as the text they spell."""
    inner = getattr(tokenizer, "_tokenizer", None)  # specmlx's own, or mlx-lm's wrapper's
    rust = inner if isinstance(inner, Tokenizer) else getattr(inner, "backend_tokenizer", None)
    if isinstance(rust, Tokenizer):
        copy = Tokenizer.from_str(rust.to_str())
        copy.encode_special_tokens = True
        return lambda text: copy.encode(text, add_special_tokens=False).ids
    # transformers' tokenizers without a Rust pipeline take it per call
    return lambda text: tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


def _alternation(strings) -> re.Pattern | None:
    strings = list(strings)
    return re.compile("|".join(map(re.escape, strings))) if strings else None


def completion_ids(target: Model, prompt: str | list[int]) -> list[int]:
    """A completion prompt as `specmlx.generate` encodes it (ids are taken as they are).
    The client writes the whole prompt here, markers included: there is no template of
    the server's to protect, so special tokens are read as such."""
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
