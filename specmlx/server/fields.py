"""A request body read into what a generation needs, every field checked.

Every field of OpenAI's chat and completions request bodies is named here, and none is
silently dropped: each is implemented (and refused with a 400 naming it when it is of
the wrong type or out of range), or accepted only at the value that asks for nothing
(the *_UNSUPPORTED tables: store false, best_of 1...) and refused at any other, or, for
the few that ask nothing of the reply (user, metadata, prompt_cache_key...), checked
and accepted. A field OpenAI does not define, nor specmlx (top_k, num_draft, tree,
draft_mode, sampling), is refused as unknown.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import SpecmlxError
from ..settings import (
    check_draft_mode,
    check_processing,
    check_seed,
    check_settings,
    parse_gamma,
    parse_tree,
)
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
    # chat: {"role", "content"} with content as plain text, and where given name,
    # tool_calls (arguments as JSON values), tool_call_id, reasoning_content
    messages: list[dict] | None
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
    tools: list[dict] | None = None  # None: no tools, or tool_choice "none"
    parallel_tool_calls: bool = True
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    tree: int | str = "auto"  # specmlx's: trees of drafts (settings.parse_tree)
    logprobs: int | None = None  # k top log-probabilities per token; None: no logprobs
    # response_format json_object or json_schema: the schema the reply must follow (a
    # json_object's is {"type": "object"}); None: free text
    json_schema: dict | None = None
    # tool_choice "required" or a named function: the names of the functions the reply
    # must call (one of them, or with parallel_tool_calls several); None: not forced
    forced_tools: list[str] | None = None

    def settings(self, max_tokens: int, seed: int, grammar: str | None = None) -> dict:
        """generate()'s keyword arguments (max_tokens as the context leaves room for;
        grammar: the constraint made of json_schema or forced_tools, constrained.py)."""
        return {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "num_draft": self.num_draft,
            "draft_mode": self.draft_mode,
            "sampling": self.sampling,
            "seed": seed,
            "logit_bias": self.logit_bias,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "tree": self.tree,
            "logprobs": self.logprobs,
            "grammar": grammar,
        }


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# Each is accepted at its neutral value (or left out, or null) and refused at any other:
# field: (whether a value is neutral, why any other is refused).
Neutral = dict[str, tuple[Callable[[object], bool], str]]
CHAT_UNSUPPORTED: Neutral = {
    "store": (lambda v: v is False, "true is not supported: completions are not stored"),
    "service_tier": (lambda v: v in ("auto", "default"), "has one tier here: 'auto' or 'default'"),
    "modalities": (lambda v: v == ["text"], "other than ['text'] is not supported"),
    "audio": (lambda v: False, "(audio output) is not supported"),
    "prediction": (lambda v: False, "(predicted outputs) is not supported yet"),
    "reasoning_effort": (lambda v: False, "is not supported: the chat template decides"),
    "verbosity": (lambda v: False, "is not supported"),
    "web_search_options": (lambda v: False, "is not supported: this server has no web search"),
    "functions": (lambda v: False, "(deprecated by OpenAI) is not supported: send tools"),
    "function_call": (lambda v: False, "(deprecated by OpenAI) is not supported: send tool_choice"),
}
TEXT_UNSUPPORTED: Neutral = {
    "best_of": (lambda v: v == 1, "other than 1 is not supported (one candidate per request)"),
    "echo": (lambda v: v is False, "true is not supported"),
    "suffix": (lambda v: v == "", "is not supported (no insertion): leave it out"),
}
# Fields that ask nothing of the reply (OpenAI's bookkeeping, abuse monitoring and cache
# routing), checked and accepted: field: (its type, in words).
CHAT_INFORMATIONAL = {
    "user": (str, "a string"),
    "metadata": (dict, "an object"),
    "safety_identifier": (str, "a string"),
    "prompt_cache_key": (str, "a string"),
    "prompt_cache_retention": (str, "a string"),
}
TEXT_INFORMATIONAL = {"user": (str, "a string")}
# Fields read in parse(), besides the tables above: OpenAI's own and specmlx's.
READ = {"model", "n", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed"}
READ |= {"stop", "stream", "stream_options", "top_k", "num_draft", "draft_mode", "sampling"}
READ |= {"logit_bias", "presence_penalty", "frequency_penalty", "tree", "logprobs"}
CHAT_FIELDS = READ | {"messages", "tools", "tool_choice", "parallel_tool_calls"}
CHAT_FIELDS |= {"top_logprobs", "response_format"}
CHAT_FIELDS |= set(CHAT_UNSUPPORTED) | set(CHAT_INFORMATIONAL)
TEXT_FIELDS = READ | {"prompt"} | set(TEXT_UNSUPPORTED) | set(TEXT_INFORMATIONAL)
# A message's keys: those passed to the chat template, and those refused unless null.
MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"}
MESSAGE_REFUSED = {
    "refusal": "an assistant's refusal is not passed to the chat template: send it as content",
    "audio": "audio is not supported",
    "function_call": "function_call (deprecated by OpenAI) is not supported: send tool_calls",
}


# How deep a body may nest: far deeper than any request needs (OpenAI holds a strict
# schema to 5 levels), and shallow enough that the code that walks it recursively (the
# chat template's tojson, the placeholders in prompts.py) never meets Python's limit.
MAX_DEPTH = 100


def read_json(raw: bytes) -> dict:
    """The body as a JSON object; a 400 for anything else, however malformed (a lone
    surrogate, nesting deeper than MAX_DEPTH or than the parser's recursion, NaN) and
    never a 500."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, f"the request body nests deeper than {MAX_DEPTH} levels") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_values(body)
    return body


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def check_values(body: dict) -> None:
    r"""A 400 for a body nested deeper than MAX_DEPTH, or holding a lone surrogate (JSON's
    "\ud800" escape parses into a str that no text encoding can write: the tokenizer, the
    template or the reply would fail on it)."""
    stack: list = [(body, 1)]
    while stack:  # iterative: a body may nest as deep as the parser allows
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                raise APIError(400, f"the request body nests deeper than {MAX_DEPTH} levels")
            items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
            stack.extend((item, depth + 1) for item in items)
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(
                    400, "the request body is not valid JSON: a lone surrogate in a string"
                ) from None


def parse(body: dict, chat: bool, defaults: Defaults) -> Asked:
    """The request, or an APIError(400) naming the first field that is wrong."""
    known = CHAT_FIELDS if chat else TEXT_FIELDS
    for name in body:
        if name not in known:
            where = "chat completions" if chat else "completions"
            raise APIError(400, f"unknown field {name!r} for {where}", param=name)
    for name, (neutral, why) in (CHAT_UNSUPPORTED if chat else TEXT_UNSUPPORTED).items():
        value = body.get(name)
        if value is not None and not neutral(value):
            raise APIError(400, f"{name} {why} (got {_short(value)})", param=name)
    for name, (kind, what) in (CHAT_INFORMATIONAL if chat else TEXT_INFORMATIONAL).items():
        _get(body, name, kind, what)
    model = _get(body, "model", str, "a string")
    if model is None:
        raise APIError(400, "model is required (GET /v1/models lists it)", param="model")
    messages = prompt = tools = forced = schema = None
    parallel = True
    if chat:
        messages = _messages(body.get("messages"))
        tools = _tools(body.get("tools"), body.get("tool_choice"))
        forced = _forced(tools, body.get("tool_choice"))
        parallel = _get(body, "parallel_tool_calls", bool, "true or false", True)
        logprobs = _chat_logprobs(body)
        schema = _response_format(body.get("response_format"))
    else:
        prompt = _prompt(body.get("prompt"))
        logprobs = _get(body, "logprobs", int, "an integer")
        if logprobs is not None and not 0 <= logprobs <= MAX_TEXT_LOGPROBS:
            raise APIError(
                400, f"logprobs must be from 0 to {MAX_TEXT_LOGPROBS}, got {logprobs}", "logprobs"
            )
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
    include_usage = _stream_options(_get(body, "stream_options", dict, "an object", {}))
    num_draft = _get(body, "num_draft", (int, str), "an integer or 'auto'", defaults.num_draft)
    draft_mode = _get(body, "draft_mode", str, "a string", defaults.draft_mode)
    sampling = _get(body, "sampling", str, "a string", defaults.sampling)
    presence = _get(body, "presence_penalty", (int, float), "a number", 0.0)
    frequency = _get(body, "frequency_penalty", (int, float), "a number", 0.0)
    bias = _logit_bias(_get(body, "logit_bias", dict, "an object mapping token ids to numbers"))
    tree = _get(body, "tree", (int, str), "an integer, 'auto' or 'off'", "auto")
    try:
        tree = parse_tree(tree)
        num_draft = parse_gamma(num_draft)
        check_draft_mode(draft_mode)
        check_settings(
            max_tokens, float(temperature), float(top_p), top_k, num_draft, draft_mode, sampling
        )
        if seed is not None:
            check_seed(seed)
        # token ids are checked against the vocabulary when the generation starts
        check_processing(bias, float(presence), float(frequency), None, 2**63)
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
        tools=tools,
        parallel_tool_calls=parallel,
        logit_bias=bias,
        presence_penalty=float(presence),
        frequency_penalty=float(frequency),
        tree=tree,
        logprobs=logprobs,
        json_schema=schema,
        forced_tools=forced,
    )


def _logit_bias(bias: dict | None) -> dict[int, float] | None:
    """OpenAI's logit_bias: token ids as JSON keys (strings of digits) to numbers."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not key.isdigit():
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        if not _number(value):
            raise APIError(
                400, f"logit_bias values must be numbers, got {_short(value)}", "logit_bias"
            )
        out[int(key)] = float(value)
    return out


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _get(body: dict, name: str, kinds, what: str, default=None, where: str = ""):
    """body[name] if it has one of `kinds` (null counts as absent), else a 400 naming
    `where` + name."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    # JSON true is a Python bool, which is an int: accept it only where a bool is meant.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        param = where + name
        raise APIError(400, f"{param} must be {what}, got {_short(value)}", param=param)
    return value


def _stream_options(options: dict) -> bool:
    """include_usage; obfuscation (padding against a length side channel) is never added."""
    for name in options:
        if name not in ("include_usage", "include_obfuscation"):
            param = f"stream_options.{name}"
            raise APIError(400, f"unknown field {param!r}", param=param)
    if _get(options, "include_obfuscation", bool, "true or false", False, "stream_options."):
        param = "stream_options.include_obfuscation"
        raise APIError(400, f"{param} true is not supported (no obfuscation)", param=param)
    return _get(options, "include_usage", bool, "true or false", False, "stream_options.")


def _tools(tools, choice) -> list[dict] | None:
    """The function tools to render, or None where there are none or tool_choice is
    "none" (the model is then not shown them, and its reply is never parsed for calls)."""
    if choice not in (None, "auto", "none", "required") and not isinstance(choice, dict):
        raise APIError(
            400,
            "tool_choice must be 'none', 'auto', 'required' or a named function",
            "tool_choice",
        )
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list of tools", param="tools")
    for i, tool in enumerate(tools):
        _tool(tool, f"tools[{i}]")
    return tools if tools and choice != "none" else None


def _tool(tool, where: str) -> None:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise APIError(400, f"{where} must be a function tool ({{'type': 'function', ...}})", where)
    for key in tool:
        if key not in ("type", "function"):
            raise APIError(400, f"unknown field '{where}.{key}'", param=f"{where}.{key}")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, f"{where}.function must be an object with a name", where)
    at = f"{where}.function."
    for key in function:
        if key not in ("name", "description", "parameters", "strict"):
            raise APIError(400, f"unknown field '{at}{key}'", param=at + key)
    _get(function, "description", str, "a string", where=at)
    _get(function, "parameters", dict, "an object", where=at)
    if _get(function, "strict", bool, "true or false", False, at):
        raise APIError(
            400,
            f"{at}strict true is not supported: a reply that may be text cannot have its "
            "calls constrained here; send false, or tool_choice 'required' or a named "
            "function (whose calls always follow the parameters' schema)",
            param=at + "strict",
        )


def _forced(tools: list[dict] | None, choice) -> list[str] | None:
    """The functions a reply must call, for tool_choice "required" (any of the tools) or
    a named function (that one); None where the reply may be text."""
    if choice != "required" and not isinstance(choice, dict):
        return None
    if not tools:
        raise APIError(400, f"tool_choice {_short(choice)} needs tools to call", "tool_choice")
    names = [t["function"]["name"] for t in tools]
    if choice == "required":
        return names
    function = choice.get("function")
    if choice.get("type") != "function" or not isinstance(function, dict):
        raise APIError(
            400,
            "tool_choice must name a function as {'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    name = function.get("name")
    if name not in names:
        param = "tool_choice.function.name"
        raise APIError(400, f"{param} {_short(name)} is none of the tools' names", param=param)
    return [name]


# OpenAI's bounds: up to 20 top log-probabilities a chat token, 5 a completion's.
MAX_CHAT_LOGPROBS, MAX_TEXT_LOGPROBS = 20, 5


def _chat_logprobs(body: dict) -> int | None:
    """How many top log-probabilities each token of the reply shows; None: no logprobs."""
    wanted = _get(body, "logprobs", bool, "true or false", False)
    top = _get(body, "top_logprobs", int, "an integer")
    if top is not None and not 0 <= top <= MAX_CHAT_LOGPROBS:
        raise APIError(
            400, f"top_logprobs must be from 0 to {MAX_CHAT_LOGPROBS}, got {top}", "top_logprobs"
        )
    if top and not wanted:
        raise APIError(400, "top_logprobs needs logprobs true", param="top_logprobs")
    return (top or 0) if wanted else None


def _response_format(value) -> dict | None:
    """The JSON schema the reply must follow (json_object: any JSON object); None: text."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text" and len(value) == 1:
        return None
    if kind == "json_object" and len(value) == 1:
        return {"type": "object"}
    if kind != "json_schema":
        raise APIError(
            400,
            "response_format must be {'type': 'text'}, {'type': 'json_object'} or "
            f"{{'type': 'json_schema', 'json_schema': {{...}}}}, got {_short(value)}",
            param="response_format",
        )
    where = "response_format."
    for key in value:
        if key not in ("type", "json_schema"):
            raise APIError(400, f"unknown field '{where}{key}'", param=where + key)
    spec = _get(value, "json_schema", dict, "an object", where=where)
    if spec is None:
        raise APIError(400, f"{where}json_schema is required", param=f"{where}json_schema")
    at = f"{where}json_schema."
    for key in spec:
        if key not in ("name", "description", "schema", "strict"):
            raise APIError(400, f"unknown field '{at}{key}'", param=at + key)
    if _get(spec, "name", str, "a string", where=at) is None:
        raise APIError(400, f"{at}name is required", param=f"{at}name")
    _get(spec, "description", str, "a string", where=at)
    _get(spec, "strict", bool, "true or false", where=at)  # followed either way
    return _get(spec, "schema", dict, "an object", {"type": "object"}, where=at)


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of messages", param="messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise APIError(400, f"{where} must be an object with a role", param=where)
        if message["role"] == "function":
            raise APIError(
                400, f"{where}: the role 'function' (deprecated by OpenAI) is 'tool' now", where
            )
        for key, value in message.items():
            if key in MESSAGE_REFUSED and value is not None:
                raise APIError(400, f"{where}.{key}: {MESSAGE_REFUSED[key]}", f"{where}.{key}")
            if key not in MESSAGE_KEYS and key not in MESSAGE_REFUSED:
                raise APIError(400, f"unknown field '{where}.{key}'", param=f"{where}.{key}")
        kept = {"role": message["role"], "content": _content(message.get("content"), where)}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if _get(message, key, str, "a string", where=f"{where}.") is not None:
                kept[key] = message[key]
        if message.get("tool_calls") is not None:
            kept["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
        out.append(kept)
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


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant's earlier calls, as chat templates read them: arguments as a JSON value
    (OpenAI sends them as a JSON string; templates write them out with tojson)."""
    if not isinstance(calls, list):
        raise APIError(400, f"{where} must be a list of tool calls", param=where)
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(400, f"{at} must be a function call with a name", param=at)
        if call.get("type", "function") != "function":
            raise APIError(400, f"{at}.type must be 'function'", param=f"{at}.type")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (json.JSONDecodeError, RecursionError):
                param = f"{at}.function.arguments"
                raise APIError(400, f"{param} must be a JSON text", param=param) from None
        kept = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if _get(call, "id", str, "a string", where=f"{at}.") is not None:
            kept["id"] = call["id"]
        out.append(kept)
    return out


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


def _stops(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise APIError(400, "stop must be a non-empty string or a list of them", param="stop")
    return stops
