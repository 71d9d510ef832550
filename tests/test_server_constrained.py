"""`specmlx serve` through the `openai` client: logprobs (the processed target's, in
OpenAI's shapes, streamed and not), response_format by constrained decoding, tool_choice
"required" or a named function forced into a call, and specmlx's per-token record of
where each streamed token came from.

The tiny random models cannot write JSON nor call a tool by themselves: every reply
here that parses does so because the grammar forced it."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import llguidance
import mlx.core as mx
import pytest
from test_constrained import SCHEMA
from test_server import GREEDY, HANG_S, MODEL, running, template_ids
from test_server_openai import USER, WEATHER, client_of, with_qwen_template

import specmlx
from specmlx import constrained
from specmlx.server import make_app

CHAT = "/v1/chat/completions"
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
# WEATHER's city is any string: a random model could write one forever.
SHORT_WEATHER = {
    "type": "function",
    "function": {
        **WEATHER["function"],
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}},
            "required": ["city"],
        },
    },
}
QWEN_DIR = Path.home() / ".cache/specmlx/models/qwen2.5-coder-1.5b-instruct-int4"


@pytest.fixture(scope="module")
def url(models):
    with running(make_app(models["target"], models["perturbed"], model_id=MODEL)) as base:
        yield base


@pytest.fixture(scope="module")
def tools_url(model_dirs, tmp_path_factory):
    qwen = with_qwen_template(model_dirs["target"], tmp_path_factory, "qwen-forced")
    with running(make_app(qwen, None, model_id=MODEL)) as base:
        yield base


def targets_own_logprobs(target, ids: list[int], reply: list[int]) -> list[float]:
    """The target's log-probability of each reply token, from one plain pass over it all
    (over its vocabulary: the embedding's padding rows are never sampled)."""
    logits = target.module(mx.array([ids + reply]))[0, len(ids) - 1 : -1, : target.vocab_size]
    logits = logits.astype(mx.float32)
    picked = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return [picked[i, t].item() for i, t in enumerate(reply)]


def test_chat_logprobs_at_t0_are_the_targets_own(url, models):
    target = models["target"]
    reply = client_of(url).chat.completions.create(
        model=MODEL, messages=USER, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = reply.choices[0].logprobs.content
    tokens = specmlx.generate(target, template_ids(target, "hi"), max_tokens=16).run().tokens
    own = targets_own_logprobs(target, template_ids(target, "hi"), tokens)
    assert [c.token for c in content] == [target.tokenizer.decode([t]) for t in tokens]
    assert [c.logprob for c in content] == pytest.approx(own, abs=1e-4)
    for c in content:  # greedy: the chosen token is the most likely, and shown first
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        assert c.bytes == list(c.token.encode())


def test_streamed_logprobs_are_the_whole_replys(url):
    client = client_of(url)
    settings = dict(model=MODEL, messages=USER, logprobs=True, top_logprobs=2, **GREEDY)
    whole = client.chat.completions.create(**settings).choices[0].logprobs.content
    chunks = client.chat.completions.create(stream=True, **settings)
    streamed = [c for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]  # fmt: skip
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in whole]


def test_completion_logprobs_have_openais_shape(url):
    reply = client_of(url).completions.create(model=MODEL, prompt="hello", logprobs=2, **GREEDY)
    choice = reply.choices[0]
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(lp.tokens)
    assert lp.text_offset[0] == 0 and all(len(top) <= 2 for top in lp.top_logprobs)


def test_a_json_schema_reply_parses_and_validates(url, models):
    target = models["target"]
    reply = client_of(url).chat.completions.create(
        model=MODEL, messages=USER, response_format=JSON_SCHEMA, temperature=0, max_tokens=60
    )
    content = reply.choices[0].message.content
    answer = json.loads(content)
    assert set(answer) == set(SCHEMA["required"]) and answer["answer"] in ("yes", "no", "maybe")
    assert isinstance(answer["sure"], bool) and 0 <= answer["n"] <= 99
    alone = specmlx.generate(
        target, template_ids(target, "hi"), max_tokens=60, num_draft=0,
        grammar=constrained.json_grammar(SCHEMA),
    ).run()  # fmt: skip
    assert content == alone.text and reply.choices[0].finish_reason == "stop"


def test_a_json_object_reply_is_an_object(url):
    reply = client_of(url).chat.completions.create(
        model=MODEL, messages=USER, response_format={"type": "json_object"}, seed=3, max_tokens=40
    )
    if reply.choices[0].finish_reason == "stop":  # else max_tokens cut the object short
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    assert reply.choices[0].message.content.startswith("{")


@pytest.mark.parametrize(
    "response_format, param",
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
         "response_format"),
        ({"type": "json_schema", "json_schema": {"schema": SCHEMA}},
         "response_format.json_schema.name"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_object", "schema": SCHEMA}, "response_format"),
    ],
)  # fmt: skip
def test_a_response_format_that_cannot_be_followed_is_a_400_naming_it(url, response_format, param):
    body = {"model": MODEL, "messages": USER, "response_format": response_format}
    response = httpx.post(f"{url}{CHAT}", json=body, timeout=HANG_S)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_tool_choice_required_makes_the_reply_a_call(tools_url):
    reply = client_of(tools_url).chat.completions.create(
        model=MODEL, messages=USER, tools=[SHORT_WEATHER, CLOCK], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=150,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.message.tool_calls, choice.message.content
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    arguments = json.loads(call.function.arguments)
    assert (call.function.name, set(arguments)) in (
        ("get_weather", {"city"}),
        ("get_time", {"zone"}),
    )


def test_a_named_tool_choice_calls_that_function(tools_url):
    reply = client_of(tools_url).chat.completions.create(
        model=MODEL, messages=USER, tools=[SHORT_WEATHER, CLOCK], temperature=0, max_tokens=150,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )  # fmt: skip
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")


def test_a_tool_choice_naming_no_tool_is_a_400(tools_url):
    body = {
        "model": MODEL,
        "messages": USER,
        "tools": [CLOCK],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    response = httpx.post(f"{tools_url}{CHAT}", json=body, timeout=HANG_S)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tool_choice.function.name"


@pytest.mark.skipif(not QWEN_DIR.is_dir(), reason=f"needs the offline target at {QWEN_DIR}")
def test_qwens_call_markers_are_matched_as_its_own_tokens():
    target = specmlx.load(QWEN_DIR)
    grammar = constrained.tool_call_grammar(
        target, [WEATHER["function"]], "<tool_call>", "</tool_call>", several=False
    )
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ids = target.tokenizer.encode(call, add_special_tokens=False)
    matcher = llguidance.LLMatcher(constrained.grammar_tokenizer(target), grammar)
    assert ids[0] == target.tokenizer.encode("<tool_call>", add_special_tokens=False)[0]
    assert matcher.consume_tokens(ids) and matcher.is_accepting()


def test_streamed_chunks_say_where_each_token_came_from(url):
    chunks = httpx_stream(url)
    tokens = [t for chunk in chunks for t in chunk.get("specmlx", {}).get("tokens", [])]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert "".join(t["text"] for t in tokens) == text
    assert any(t["drafter"] == "model" for t in tokens) and any(
        t["drafter"] is None for t in tokens
    )
    assert all(1 <= t["round_drafts"] <= 3 for t in tokens if t["drafter"] is not None)


def httpx_stream(url: str) -> list[dict]:
    """A stream's chunks as JSON (the openai client drops fields it does not know)."""
    body = {"model": MODEL, "messages": USER, "stream": True, "num_draft": 3, **GREEDY}
    with httpx.stream("POST", f"{url}{CHAT}", json=body, timeout=HANG_S) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    return [json.loads(line[len("data: ") :]) for line in lines]
