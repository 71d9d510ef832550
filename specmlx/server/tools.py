"""Tool calls in a reply: found between the markers of the model's own tool-call format
and parsed by mlx-lm's parser for it (mlx_lm.tool_parsers: Hermes/Qwen JSON, Mistral,
pythonic, Qwen3-Coder and more), chosen as mlx-lm chooses it for a chat template.

The reply's text streams through a CallSplitter, which holds back what may be the start
of a marker until the next piece settles it; each call's text, once its end marker has
come (or the reply has ended inside it), becomes an OpenAI tool call. A call that does
not parse stays in the content, markers and all, so nothing the model said is lost.
"""

from __future__ import annotations

import importlib
import json
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from .. import constrained
from ..loading import Model
from .errors import APIError


@dataclass(frozen=True)
class ToolFormat:
    """A model's tool-call syntax: its markers, and mlx-lm's parser for what is between."""

    parse: Callable  # (text, tools) -> {"name", "arguments"} or a list of them
    start: str
    end: str  # "" where a call runs to the end of the reply (Mistral's [TOOL_CALLS])


class ToolFormats:
    """The target's ToolFormat (None: its template has none mlx-lm can parse), found once.

    mlx-lm's TokenizerWrapper chose it at load; for specmlx's own tokenizer it is chosen
    here as mlx-lm's load_tokenizer would (tokenizer_config.json's tool_parser_type, else
    inferred from the chat template and vocabulary), on the first request with tools:
    that imports mlx_lm.tokenizer_utils, and with it transformers, which a server that is
    never sent tools should not pay for at start."""

    def __init__(self, target: Model):
        self.target = target
        self._form: ToolFormat | None = None
        self._looked = False
        self._lock = threading.Lock()

    def get(self) -> ToolFormat | None:
        with self._lock:
            if not self._looked:
                self._form, self._looked = tool_format(self.target), True
            return self._form


def tool_format(target: Model) -> ToolFormat | None:
    tokenizer = target.tokenizer
    if hasattr(type(tokenizer), "has_tool_calling"):  # mlx-lm's wrapper
        if not tokenizer.has_tool_calling:
            return None
        return ToolFormat(tokenizer.tool_parser, tokenizer.tool_call_start, tokenizer.tool_call_end)
    from mlx_lm.tokenizer_utils import _infer_tool_parser

    config_file = target.path / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    name = config.get("tool_parser_type") or _infer_tool_parser(tokenizer)
    if name is None:
        return None
    module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    return ToolFormat(module.parse_tool_call, module.tool_call_start, module.tool_call_end)


def forced_call_grammar(
    target: Model, form: ToolFormat, functions: list[dict], several: bool
) -> str:
    """The grammar of a reply that is only calls of `functions` (OpenAI's function
    objects) in the model's own format, arguments following each one's parameters: for
    tool_choice "required" or a named function. Built for formats whose calls are JSON
    between markers (mlx-lm's json_tools: Hermes, Qwen2.5); others are refused by name."""
    if form.parse.__module__.rsplit(".", 1)[-1] != "json_tools":
        raise APIError(
            400,
            f"tool_choice cannot force a call for {target.name}: its tool-call format "
            f"({form.parse.__module__}) is not JSON between markers; send 'auto'",
            param="tool_choice",
        )
    return constrained.tool_call_grammar(target, functions, form.start, form.end, several)


class CallSplitter:
    """A reply's text, piece by piece, split into content and the text of each call."""

    def __init__(self, start: str, end: str):
        self.start, self.end = start, end
        self.held = ""  # text that may begin the marker looked for next
        self.in_call = False
        self.call = ""  # the call being read

    def add(self, text: str) -> tuple[str, list[str]]:
        """The content settled by `text`, and the text of each call it closed."""
        self.held += text
        content, calls = "", []
        while True:
            if self.in_call and not self.end:  # the call runs to the end of the reply
                self.call += self.held
                self.held = ""
                return content, calls
            marker = self.end if self.in_call else self.start
            at = self.held.find(marker)
            if at < 0:
                keep = _partial_marker(self.held, marker)
                settled, self.held = (
                    self.held[: len(self.held) - keep],
                    self.held[len(self.held) - keep :],
                )
                if self.in_call:
                    self.call += settled
                else:
                    content += settled
                return content, calls
            before, self.held = self.held[:at], self.held[at + len(marker) :]
            if self.in_call:
                calls.append(self.call + before)
                self.call = ""
            else:
                content += before
            self.in_call = not self.in_call

    def finish(self) -> tuple[str, str | None]:
        """At the reply's end: the content still held, and the text of a call the reply
        ended inside (None if it ended outside one)."""
        held, self.held = self.held, ""
        if self.in_call:
            call, self.call = self.call + held, ""
            return "", call
        return held, None


def _partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolReply:
    """A reply's content and OpenAI tool calls, as its text streams (without a format,
    everything is content)."""

    def __init__(self, form: ToolFormat | None, tools: list[dict] | None):
        self.form, self.tools = form, tools
        self.splitter = CallSplitter(form.start, form.end) if form else None
        self.calls = 0  # made so far: each call's index in a stream

    def add(self, text: str) -> tuple[str, list[dict]]:
        if self.splitter is None:
            return text, []
        content, texts = self.splitter.add(text)
        return self._calls(content, texts)

    def finish(self) -> tuple[str, list[dict]]:
        if self.splitter is None:
            return "", []
        content, call = self.splitter.finish()
        return self._calls(content, [] if call is None else [call], closed=False)

    def _calls(self, content: str, texts: list[str], closed: bool = True) -> tuple[str, list]:
        calls = []
        for text in texts:
            parsed = self._parse(text)
            if parsed is None:  # not a call after all: the model's text, as it wrote it
                end = self.form.end if closed else ""
                content += self.form.start + text + end
            else:
                calls += parsed
        return content, calls

    def _parse(self, text: str) -> list[dict] | None:
        try:
            parsed = self.form.parse(text, self.tools)
        except Exception:  # each parser raises its own (JSON, regex, ast) on a malformed call
            return None
        parsed = parsed if isinstance(parsed, list) else [parsed]
        if not parsed or not all(
            isinstance(p, dict) and isinstance(p.get("name"), str) for p in parsed
        ):
            return None
        calls = []
        for p in parsed:
            arguments = p.get("arguments", {})
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            calls.append(
                {
                    "index": self.calls,
                    "id": p.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": p["name"], "arguments": arguments},
                }
            )
            self.calls += 1
        return calls
