"""Constrained decoding: a grammar's token mask as a processor (processors.py), so that
the text can only be what the grammar allows: JSON that follows a schema (OpenAI's
response_format), or tool calls in the model's own format (tool_choice "required").

The grammars and their masks are llguidance's (bench/results/json_masks.md: it compiles a
schema in about a millisecond where outlines-core takes a second, and each mask costs
about 0.1 ms on a 152k vocabulary). The mask is one more processor: the Target applies it
to every position it judges, so the verify judges on the masked p and a draft the grammar
forbids has p = 0 there and is rejected, exactly; Target.draft_draw applies it to a
chain's drafts as they are drawn, so drafts stay acceptable.
"""

from __future__ import annotations

import json
import threading

import mlx.core as mx
import numpy as np

from .caches import common_prefix_len
from .errors import SpecmlxError
from .loading import Model
from .processors import Processor

# JSON as json.dumps writes it (and as chat templates write tool calls, with tojson): one
# space after ':' and ',', no other whitespace. A grammar that allows any whitespace
# lets a weak model spend its tokens on blank lines without ever closing the object.
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_tokenizers: dict[str, object] = {}
_lock = threading.Lock()


def _llguidance():
    import llguidance  # a core dependency, imported only where a grammar is asked for

    return llguidance


def grammar_tokenizer(model: Model):
    """llguidance's view of the model's vocabulary (each token's bytes, the EOS ids),
    built once per model: about a second for a 152k vocabulary."""
    key = str(model.path)
    with _lock:
        if key not in _tokenizers:
            _tokenizers[key] = _llguidance().LLTokenizer(
                _tokenizer_json(model), eos_token=sorted(model.tokenizer.eos_token_ids)
            )
        return _tokenizers[key]


def _tokenizer_json(model: Model) -> str:
    inner = getattr(model.tokenizer, "_tokenizer", None)
    for candidate in (inner, getattr(inner, "backend_tokenizer", None)):
        if hasattr(candidate, "to_str"):  # a tokenizers.Tokenizer, added tokens and all
            return candidate.to_str()
    path = model.path / "tokenizer.json"
    if not path.is_file():
        raise SpecmlxError(f"{model.name} has no tokenizer.json, which constrained decoding reads")
    return path.read_text()


def json_grammar(schema: dict | None) -> str:
    """The grammar of JSON that follows `schema` (None: any JSON object), written
    compactly unless the schema's own "x-guidance" options say otherwise."""
    schema = {"type": "object"} if schema is None else schema
    return _llguidance().LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT)


def tool_call_grammar(
    model: Model, functions: list[dict], start: str, end: str, several: bool
) -> str:
    """The grammar of a reply that is only tool calls in the JSON-between-markers format
    (Hermes, Qwen2.5: start {"name": ..., "arguments": {...}} end), one call or, with
    `several`, one or more on their own lines: `functions` are OpenAI's function objects,
    each call naming one of them with arguments that follow its parameters' schema."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                "arguments": f.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": COMPACT}
    body = f'{_literal(model, start)} "\\n" %json {json.dumps(schema)} "\\n" {_literal(model, end)}'
    rule = 'start: call ("\\n" call)*' if several else "start: call"
    return _llguidance().LLMatcher.grammar_from_lark(f"{rule}\ncall: {body}\n")


def _literal(model: Model, marker: str) -> str:
    """A marker in a Lark rule: the token itself where the vocabulary has it as one added
    token (llguidance matches those only by id, never by their text), else its text."""
    ids = model.tokenizer.encode(marker, add_special_tokens=False)
    if len(ids) == 1 and grammar_tokenizer(model).is_special_token(ids[0]):
        return f"<[{ids[0]}]>"
    return json.dumps(marker)


def check(model: Model, grammar: str) -> None:
    """Refuse, in one line, a grammar llguidance cannot compile (a schema it does not
    support, or malformed): before a request queues (mask() refuses it the same way)."""
    error = _llguidance().LLMatcher.validate_grammar(grammar, grammar_tokenizer(model))
    if error:
        raise _unusable(error)


def _unusable(error: str) -> SpecmlxError:
    return SpecmlxError(f"the schema cannot be used for constrained decoding: {error}")


def mask(model: Model, grammar: str) -> Processor:
    """A processor that leaves each row's logits only where the grammar allows the token
    after that row's history (-inf elsewhere). One matcher follows the histories it is
    shown: it is rolled back to what a row shares with the last one and takes the rest, so
    a chain's rows cost one token each."""
    tokenizer = grammar_tokenizer(model)
    matcher = _llguidance().LLMatcher(tokenizer, grammar)
    if matcher.is_error():
        raise _unusable(matcher.get_error())
    consumed: list[int] = []
    known = tokenizer.vocab_size

    def process(logits: mx.array, histories: list[list[int]]) -> mx.array:
        allowed = np.zeros((len(histories), max(known, logits.shape[-1])), bool)
        for r, history in enumerate(histories):
            shared = common_prefix_len(consumed, history)
            if shared < len(consumed):
                matcher.rollback(len(consumed) - shared)
                del consumed[shared:]
            took = matcher.try_consume_tokens(history[shared:])
            consumed.extend(history[shared : shared + took])
            if shared + took < len(history):
                # The row follows a draft the grammar forbids: that draft has p = 0 and is
                # rejected, so this row is never judged; any mask will do.
                allowed[r] = True
                continue
            bits = np.frombuffer(matcher.compute_bitmask(), np.uint8)
            allowed[r, :known] = np.unpackbits(bits, bitorder="little")[:known]
        keep = mx.array(allowed[:, : logits.shape[-1]])
        return mx.where(keep, logits, mx.array(-mx.inf, logits.dtype))

    process.reads_history = True
    return process
