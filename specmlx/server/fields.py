"""A request body read into what a generation needs, every field checked.

Fields this server does not implement (logit_bias, penalties, tools...) are ignored, as
OpenAI clients send some of them by default; those it implements are refused with a 400
that names the field when they are of the wrong type or out of range.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import SpecmlxError
from ..settings import check_draft_mode, check_seed, check_settings, parse_gamma
from .errors import APIError


@dataclass(frozen=True)
class Defaults:
    """What a request gets for a field it leaves out (num_draft, draft_mode: the server's;
    draft_mode None: auto with a draft model, else plain, as generate() decides)."""

    max_tokens: int = 256
    num_draft: int | str = "auto"
    draft_mode: str | None = None
    sampling: str | None = None  # None: settings.DEFAULT_SAMPLING


@dataclass(frozen=True)
class Asked:
    """One completion request, checked."""

    model: str
    messages: list[dict] | None  # chat: [{"role", "content"}], content as plain text
    prompt: str | list[int] | None  # completions: text, or token ids as they are
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stops: list[str]
    stream: bool
    include_usage: bool
    num_draft: int | str
    draft_mode: str | None
    sampling: str | None = None

    def settings(self, max_tokens: int, seed: int) -> dict:
        """generate()'s keyword arguments (max_tokens as the context leaves room for)."""
        return {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "num_draft": self.num_draft,
            "draft_mode": self.draft_mode,
            "sampling": self.sampling,
            "seed": seed,
        }


def read_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def parse(body: dict, chat: bool, defaults: Defaults) -> Asked:
    """The request, or an APIError(400) naming the first field that is wrong."""
    model = _get(body, "model", str, "a string")
    if model is None:
        raise APIError(400, "model is required (GET /v1/models lists it)", param="model")
    messages = prompt = None
    if chat:
        messages = _messages(body.get("messages"))
    else:
        prompt = _prompt(body.get("prompt"))
    n = _get(body, "n", int, "an integer", 1)
    if n != 1:
        raise APIError(400, f"n must be 1 (one choice per request), got {n}", param="n")
    max_tokens = _get(body, "max_completion_tokens", int, "an integer")
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int, "an integer", defaults.max_tokens)
    temperature = _get(body, "temperature", (int, float), "a number", 1.0)
    top_p = _get(body, "top_p", (int, float), "a number", 1.0)
    top_k = _get(body, "top_k", int, "an integer", 0)
    seed = _get(body, "seed", int, "an integer")
    stream = _get(body, "stream", bool, "true or false", False)
    options = _get(body, "stream_options", dict, "an object", {})
    include_usage = _get(options, "include_usage", bool, "true or false", False)
    num_draft = _get(body, "num_draft", (int, str), "an integer or 'auto'", defaults.num_draft)
    draft_mode = _get(body, "draft_mode", str, "a string", defaults.draft_mode)
    sampling = _get(body, "sampling", str, "a string", defaults.sampling)
    try:
        num_draft = parse_gamma(num_draft)
        check_draft_mode(draft_mode)
        check_settings(
            max_tokens, float(temperature), float(top_p), top_k, num_draft, draft_mode, sampling
        )
        if seed is not None:
            check_seed(seed)
    except SpecmlxError as e:
        raise APIError(400, str(e)) from None
    return Asked(
        model=model,
        messages=messages,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        seed=seed,
        stops=_stops(body.get("stop")),
        stream=stream,
        include_usage=include_usage,
        num_draft=num_draft,
        draft_mode=draft_mode,
        sampling=sampling,
    )


def _get(body: dict, name: str, kinds, what: str, default=None):
    """body[name] if it has one of `kinds` (null counts as absent), else a 400."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    # JSON true is a Python bool, which is an int: accept it only where a bool is meant.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise APIError(400, f"{name} must be {what}, got {json.dumps(value)}", param=name)
    return value


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of messages", param="messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise APIError(400, f"{where} must be an object with a role", param=where)
        out.append({"role": message["role"], "content": _content(message.get("content"), where)})
    return out


def _content(content, where: str) -> str:
    """A message's text: a string, or the text parts of a list of parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) == len(content) and all(isinstance(p.get("text"), str) for p in parts):
            return "".join(p["text"] for p in parts)
    raise APIError(
        400, f"{where}.content must be a string or a list of text parts", param=f"{where}.content"
    )


def _prompt(prompt) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return prompt
    raise APIError(
        400, "prompt must be a string or a non-empty list of token ids (one prompt)", "prompt"
    )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _stops(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise APIError(400, "stop must be a non-empty string or a list of them", param="stop")
    return stops
