"""A tokenizer read with `tokenizers` alone, for checkpoints where it is what transformers
would build: no transformers import (most of a cold start), nor mlx-lm's token map.

It gives what specmlx uses of mlx-lm's TokenizerWrapper: encode, decode, the EOS ids, the
chat template rendered as transformers renders it, the vocabulary and a streaming
detokenizer. `load_light` gives it, or says why a directory must go through transformers
instead (loading.read_tokenizer then uses mlx-lm's load_tokenizer): transformers v5 does
not always use tokenizer.json as it is. Its class for the model type may rebuild the
pipeline from the vocabulary and merges (Qwen2Tokenizer sets its own normalizer,
pre-tokenizer and decoder), and it adds the tokens tokenizer_config.json lists. Both are
followed here only where the outcome is known: the classes below, whose choice
tests/test_tokenizer.py checks against transformers' own tables.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

# transformers' named special tokens (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# The hub's generic classes: a tokenizer.json used as it is (TokenizersBackend).
GENERIC = {"PreTrainedTokenizer", "TokenizersBackend"}
# Per model type, what transformers v5 registers for it (TOKENIZER_MAPPING_NAMES) and
# whether it overrides a hub's class with that (MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS):
# the model types whose outcome is known. Others go to transformers.
TRANSFORMERS_CLASSES: dict[str, tuple[str | None, bool]] = {
    "llama": (None, False),
    "qwen2": ("Qwen2Tokenizer", True),
    "qwen3": ("Qwen2Tokenizer", False),
    "qwen3_moe": ("Qwen2Tokenizer", False),
    "qwen3_next": ("Qwen2Tokenizer", False),
    "phi3": ("TokenizersBackend", True),
    "olmo2": ("TokenizersBackend", False),
    "smollm3": (None, False),
    "gemma2": ("GemmaTokenizer", False),
    "gemma3": ("GemmaTokenizer", False),
    "gemma3_text": ("GemmaTokenizer", False),
    "gpt_oss": (None, False),
    "lfm2": (None, False),
    "granitemoehybrid": ("TokenizersBackend", False),
    "falcon_h1": (None, False),
}
# What Qwen2Tokenizer builds around tokenizer.json's vocabulary and merges
# (transformers/models/qwen2/tokenization_qwen2.py): a file with exactly these is
# unchanged by the rebuild.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Decoders whose output for a run of tokens does not depend on the tokens before it: the
# streaming detokenizer decodes windows. (SentencePiece's with a leading-space Strip, as
# Llama 2 has, comes with LlamaTokenizer, which goes to transformers anyway.)
SPM_DECODER = [
    {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
    {"type": "ByteFallback"},
    {"type": "Fuse"},
]
# mlx-lm's TokenizerWrapper passes enable_thinking=True to the chat template when the
# vocabulary has thinking tokens (tokenizer_utils._infer_thinking): these.
THINK_PAIRS = [
    ("<think>", "</think>"),
    ("<longcat_think>", "</longcat_think>"),
    ("<|think:start|>", "<|think:end|>"),
    ("<|channel>", "<channel|>"),
]
XTML_TOKENS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")


def _strip_fast(name: str) -> str:
    return name.removesuffix("Fast")


def transformers_class(model_type: str | None, hub_class: str | None) -> str | None:
    """The tokenizer class AutoTokenizer (v5) picks for a local directory without remote
    code, or None where the model type is not one whose outcome is known."""
    if model_type not in TRANSFORMERS_CLASSES:
        return None
    registered, overridden = TRANSFORMERS_CLASSES[model_type]
    if hub_class is None:
        return registered and _strip_fast(registered)
    if registered is not None and _strip_fast(registered) != _strip_fast(hub_class):
        if _strip_fast(registered) in GENERIC:
            return "TokenizersBackend"
        hub_class = registered if overridden else hub_class
    hub_class = _strip_fast(hub_class)
    return "TokenizersBackend" if hub_class in GENERIC else hub_class


def _state_of(component) -> dict | None:
    """A tokenizers pipeline component as its tokenizer.json entry (None when unset)."""
    return None if component is None else json.loads(component.__getstate__())


def _qwen2_pipeline(tokenizer: Tokenizer, add_prefix_space: bool) -> bool:
    """Whether tokenizer.json already has what Qwen2Tokenizer rebuilds around its
    vocabulary and merges (for ids: normalizer, pre-tokenizer, model; and the decoder)."""
    pre = _state_of(tokenizer.pre_tokenizer) or {}
    steps = pre.get("pretokenizers") or []
    model = tokenizer.model
    return (
        _state_of(tokenizer.normalizer) == {"type": "NFC"}
        and pre.get("type") == "Sequence"
        and len(steps) == 2
        and steps[0]
        == {
            "type": "Split",
            "pattern": {"Regex": QWEN2_SPLIT},
            "behavior": "Isolated",
            "invert": False,
        }
        and steps[1].get("type") == "ByteLevel"
        and steps[1].get("add_prefix_space") == add_prefix_space
        and steps[1].get("use_regex") is False
        and (_state_of(tokenizer.decoder) or {}).get("type") == "ByteLevel"
        and type(model).__name__ == "BPE"
        and model.dropout is None
        and model.unk_token is None
        and model.continuing_subword_prefix in (None, "")
        and model.end_of_word_suffix in (None, "")
        and not model.fuse_unk
        and not model.byte_fallback
        and not model.ignore_merges
    )


def _local_decoder(decoder: dict | None) -> bool:
    if decoder is None:
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return decoder.get("type") == "Sequence" and decoder.get("decoders") == SPM_DECODER


def chat_template_of(path: Path, config: dict) -> Any:
    """The chat template as transformers reads it: chat_template.jinja over the config's
    entry; a list of named templates becomes a dict. (chat_template.json is a
    processor's file, which the tokenizer does not read.)"""
    file = path / "chat_template.jinja"
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template}
    return template


def config_refusal(path: Path, config: dict, model_config: dict) -> tuple[str, str | None]:
    """(why the light tokenizer would not be transformers' for `path`, judged from the
    configs: '' when it would; the class transformers picks)."""
    for key in ("auto_map", "chat_template_type", "fast_tokenizer_files"):
        if key in config:
            return f"tokenizer_config.json sets {key}", None
    if config.get("split_special_tokens"):
        return "tokenizer_config.json sets split_special_tokens", None
    if (path / "additional_chat_templates").is_dir():
        return "named chat templates in additional_chat_templates/", None
    template = chat_template_of(path, config)
    if isinstance(template, dict) and "default" not in template:
        return "named chat templates without a default", None
    if isinstance(config.get("extra_special_tokens"), dict):
        return "model-specific special tokens (extra_special_tokens)", None
    custom = [
        key
        for key, value in config.items()
        # (as transformers tells them: text values; add_bos_token is a flag)
        if key.endswith("_token")
        and key not in SPECIAL_TOKEN_NAMES
        and isinstance(value, (str, dict))
    ]
    if custom:
        return f"model-specific special tokens ({', '.join(sorted(custom))})", None
    model_type = model_config.get("model_type")
    hub = config.get("tokenizer_class")
    picked = transformers_class(model_type, hub)
    if picked not in ("TokenizersBackend", "Qwen2Tokenizer"):
        return f"tokenizer class {picked or hub} for model type {model_type}", picked
    return "", picked


def pipeline_refusal(tokenizer: Tokenizer, config: dict, picked: str) -> str:
    """Why the loaded tokenizer.json is not what transformers' `picked` class uses ('')."""
    if picked == "Qwen2Tokenizer":
        if not _qwen2_pipeline(tokenizer, bool(config.get("add_prefix_space"))):
            return "Qwen2Tokenizer rebuilds a pipeline other than tokenizer.json's"
        # It keeps tokenizer.json's vocabulary and merges but none of its added tokens:
        # it has only those tokenizer_config.json lists.
        in_file = {i: _state(t) for i, t in tokenizer.get_added_tokens_decoder().items()}
        in_config = {
            int(i): _state(_added_token(e))
            for i, e in (config.get("added_tokens_decoder") or {}).items()
        }
        if in_file != in_config:
            return "tokenizer.json's added tokens differ from tokenizer_config.json's"
        # ...added in id order: each takes its vocabulary id, or else the next free one.
        next_id = tokenizer.get_vocab_size(with_added_tokens=False)
        for i, state in sorted(in_config.items()):
            in_vocab = tokenizer.model.token_to_id(state["content"])
            if i != (next_id if in_vocab is None else in_vocab):
                return "tokenizer_config.json's added tokens are not where Qwen2Tokenizer puts them"
            next_id += in_vocab is None
    if not _local_decoder(_state_of(tokenizer.decoder)):
        return "a decoder the streaming detokenizer does not follow"
    if config.get("clean_up_tokenization_spaces") and (
        type(tokenizer.model).__name__ != "BPE"
        or config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
    ):
        return "tokenizer_config.json sets clean_up_tokenization_spaces"
    return ""


def load_light(
    path: Path, model_config: dict, eos_token_ids: int | list[int] | None = None
) -> tuple[LightTokenizer | None, str]:
    """(the light tokenizer, '') where it is exactly what transformers would build for
    `path`, else (None, why not). Each file is parsed once, by tokenizers."""
    if not (path / "tokenizer.json").is_file():
        return None, "no tokenizer.json"
    if not (path / "tokenizer_config.json").is_file():
        return None, "no tokenizer_config.json"
    config = json.loads((path / "tokenizer_config.json").read_bytes())
    if not isinstance(config, dict):
        return None, "tokenizer_config.json is not an object"
    why, picked = config_refusal(path, config, model_config)
    if why:
        return None, why
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    why = pipeline_refusal(tokenizer, config, picked)
    if why:
        return None, why
    return LightTokenizer(tokenizer, config, path, eos_token_ids, picked == "Qwen2Tokenizer"), ""


def _added_token(entry: dict | str, special: bool | None = None) -> AddedToken:
    if isinstance(entry, str):
        return AddedToken(entry, special=bool(special))
    fields = {k: v for k, v in entry.items() if k not in ("__type", "id")}
    return AddedToken(**fields)


def _state(token: AddedToken) -> dict:
    return token.__getstate__()


def _special_tokens(config: dict) -> dict[str, Any]:
    """The named special tokens, each the config's AddedToken where its added tokens list
    the same text (as transformers maps them)."""
    added = {
        entry["content"]: _added_token(entry)
        for entry in (config.get("added_tokens_decoder") or {}).values()
    }
    named = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = _added_token(value)
        if value is not None:
            value = added.get(str(value), value)
        if value is not None:
            named[name] = value
    return named


def _add_config_tokens(tokenizer: Tokenizer, config: dict, named: dict[str, Any]) -> None:
    """Add what transformers' TokenizersBackend adds after loading the file: every token
    of tokenizer_config.json's added_tokens_decoder (one already there, the same, is
    left alone; one with other flags takes the config's), then the named and extra special
    tokens that are in neither."""
    tokens = [
        _added_token(entry)
        for _, entry in sorted(
            (config.get("added_tokens_decoder") or {}).items(), key=lambda kv: int(kv[0])
        )
    ]
    known = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    known |= {t.content for t in tokens}
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    for value in [*named.values(), *extra]:
        token = _added_token(value, special=True) if not isinstance(value, AddedToken) else value
        if token.content not in known:
            if not token.special:
                token = AddedToken(**{**_state(token), "special": True})
            tokens.append(token)
            known.add(token.content)
    if tokens:
        tokenizer.add_tokens(tokens)


class LightTokenizer:
    """tokenizers.Tokenizer with tokenizer_config.json's special tokens and chat template,
    behaving as mlx-lm's TokenizerWrapper over transformers' tokenizer does."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        config: dict,
        path: Path,
        eos_token_ids: int | list[int] | None = None,
        qwen2: bool = False,
    ):
        self._tokenizer = tokenizer
        # transformers' encode never truncates or pads unless asked to.
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        named = _special_tokens(config)
        _add_config_tokens(self._tokenizer, config, named)
        if qwen2:  # Qwen2Tokenizer's own last step: every special token, as special
            extra = config.get("extra_special_tokens") or config.get("additional_special_tokens")
            every = dict.fromkeys([*map(str, named.values()), *map(str, extra or [])])
            self._tokenizer.add_tokens([AddedToken(t, special=True) for t in every])
        self.special_tokens_map = {name: str(value) for name, value in named.items()}
        self.bos_token = self.special_tokens_map.get("bos_token")
        self.eos_token = self.special_tokens_map.get("eos_token")
        self.eos_token_id = None if self.eos_token is None else self.token_to_id(self.eos_token)
        if isinstance(eos_token_ids, int):
            eos_token_ids = [eos_token_ids]
        self._eos_token_ids = set(eos_token_ids or [])
        if self.eos_token_id is not None:
            self._eos_token_ids.add(self.eos_token_id)
        self.chat_template = chat_template_of(path, config)
        if isinstance(self.chat_template, dict):
            self.chat_template = self.chat_template["default"]
        self.has_chat_template = self.chat_template is not None
        # (token by token: the whole vocabulary as a dict would be built, all of it, at
        # every load, to answer for a handful of tokens)
        known = {t: self.token_to_id(t) is not None for t in {*sum(THINK_PAIRS, ()), *XTML_TOKENS}}
        self.has_thinking = any(known[a] and known[b] for a, b in THINK_PAIRS) or all(
            known[t] for t in XTML_TOKENS
        )
        self._template = None

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: int | list[int], skip_special_tokens: bool = False) -> str:
        if isinstance(ids, int):
            ids = [ids]
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return self._tokenizer.get_added_tokens_decoder()

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> set[int]:
        return self._eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, value) -> None:
        self._eos_token_ids = set(value) if value is not None else set()

    @property
    def detokenizer(self) -> StreamingDetokenizer:
        """A fresh streaming detokenizer (one per generation)."""
        return StreamingDetokenizer(self._tokenizer)

    def apply_chat_template(
        self,
        messages: list[dict],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **kwargs,
    ) -> str | list[int]:
        """The conversation rendered by the chat template as transformers renders it (with
        mlx-lm's enable_thinking default); its token ids unless tokenize=False."""
        if self.chat_template is None:
            raise ValueError(f"{type(self).__name__} has no chat template")
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation.")
        kwargs.setdefault("enable_thinking", self.has_thinking)
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        text = self._template.render(
            messages=[_template_message(m) for m in messages],
            tools=kwargs.pop("tools", None),
            documents=kwargs.pop("documents", None),
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **kwargs},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


# Names a message's reasoning comes under; templates read the first (or, gpt-oss, thinking).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _template_message(message: dict) -> dict:
    """A message as transformers hands it to the template: keys whose value is None
    dropped, and reasoning given under each name templates read."""
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def compile_chat_template(source: str):
    """A jinja2 template in the environment transformers renders chat templates in: an
    immutable sandbox with trim_blocks, lstrip_blocks and loop controls, a tojson that
    does not escape HTML, raise_exception, strftime_now, a dict() and a namespace() that
    refuses underscore names, and the {% generation %} tag (rendered as its body)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        # transformers marks assistant text with it to build token masks; specmlx only
        # renders, so the body is all it gives.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes ({name!r})"
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=strftime_now,
        dict=TemplateDict(),
        namespace=TemplateNamespace,
    )
    return env.from_string(source)


class StreamingDetokenizer:
    """mlx-lm's StreamingDetokenizer interface (add_token, finalize, text, last_segment,
    tokens) whose text is always a prefix of decode(tokens), and all of it after finalize.

    Each new token decodes with the few tokens since the last emitted boundary, as
    tokenizers' DecodeStream does: the new text is what the window's decode adds to the
    decode of its first part. Text that ends in an incomplete UTF-8 character waits for
    the next token; finalize flushes it as decode would (U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self.reset()

    def reset(self) -> None:
        self.offset = 0
        self.text = ""
        self.tokens: list[int] = []
        self._start = 0  # the window: tokens[_start:]
        self._read = 0  # tokens[_start:_read] decoded as _prefix, already in text
        self._prefix = ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        window = self._decode(self.tokens[self._start :])
        if len(window) > len(self._prefix) and not window.endswith("\ufffd"):
            self.text += window[len(self._prefix) :]
            self._start, self._read = self._read, len(self.tokens)
            self._prefix = self._decode(self.tokens[self._start : self._read])

    def finalize(self) -> None:
        window = self._decode(self.tokens[self._start :])
        self.text += window[len(self._prefix) :]
        self._start = self._read = len(self.tokens)
        self._prefix = ""

    @property
    def last_segment(self) -> str:
        """The text added since the last time this was read."""
        segment = self.text[self.offset :]
        self.offset = len(self.text)
        return segment
