"""Constrained decoding (specmlx/constrained.py): a grammar's mask is one more processor,
so the text follows the grammar, speculation keeps the masked target's text exactly, a
draft the grammar forbids is rejected, and drafts are drawn under the mask."""

from __future__ import annotations

import json

import llguidance
import mlx.core as mx
import pytest

import specmlx
from specmlx import constrained
from specmlx.drafters.protocol import Proposal, Verdict
from specmlx.errors import SpecmlxError

# Tiny random models cannot write JSON: every token here is forced or a small choice.
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no", "maybe"]},
        "sure": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["answer", "sure", "n"],
    "additionalProperties": False,
}
PROMPT = "hello there"


@pytest.fixture(scope="module")
def pair(models):
    return models["target"], models["perturbed"]


def test_the_text_follows_the_schema(pair):
    target, _ = pair
    gen = specmlx.generate(target, PROMPT, max_tokens=60, grammar=constrained.json_grammar(SCHEMA))
    reply = json.loads(gen.run().text)
    assert reply["answer"] in SCHEMA["properties"]["answer"]["enum"] and 0 <= reply["n"] <= 99
    assert gen.stats.finish_reason == "eos"


def test_greedy_speculation_under_the_mask_is_the_masked_target_alone(pair):
    target, draft = pair
    grammar = constrained.json_grammar(SCHEMA)
    alone = specmlx.generate(target, PROMPT, max_tokens=60, num_draft=0, grammar=grammar).run()
    for gamma in (2, 5):
        spec = specmlx.generate(
            target, PROMPT, draft=draft, max_tokens=60, num_draft=gamma, grammar=grammar
        ).run()
        assert spec.tokens == alone.tokens and spec.stats.accepted > 0


class Forbidden:
    """A drafter whose every draft is a token the grammar never allows (a letter where
    JSON of SCHEMA has none of its own), offered as a guess."""

    name = "forbidden"

    def __init__(self, token: int):
        self.token = token

    def start(self, context: list[int]) -> None:
        pass

    def propose(self, g, keys, draw, go_on=None) -> Proposal:
        return Proposal(mx.array([self.token] * g, mx.uint32))

    def commit(self, proposal, verdict: Verdict) -> int:
        return 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_the_grammar_forbids_is_never_accepted(pair, temperature):
    target, _ = pair
    grammar = constrained.json_grammar(SCHEMA)
    (x,) = target.tokenizer.encode("X", add_special_tokens=False)
    settings = dict(max_tokens=60, temperature=temperature, seed=1, grammar=grammar)
    spec = specmlx.generate(target, PROMPT, drafter=Forbidden(x), num_draft=3, **settings).run()
    alone = specmlx.generate(target, PROMPT, num_draft=0, **settings).run()
    assert spec.stats.drafted > 0 and spec.stats.accepted == 0
    assert spec.tokens == alone.tokens
    json.loads(spec.text)


class FromFlatLogits:
    """A drafter that draws each draft from equal logits with the draw it is handed, and
    checks, against a matcher of its own, that each proposal follows the grammar."""

    name = "flat"

    def __init__(self, target, grammar: str):
        self.vocab = target.vocab_size
        self.matcher = llguidance.LLMatcher(constrained.grammar_tokenizer(target), grammar)
        self.text: list[int] = []
        self.followed: list[bool] = []

    def start(self, context: list[int]) -> None:
        pass

    def propose(self, g, keys, draw, go_on=None) -> Proposal:
        drafts = [draw(mx.zeros((1, self.vocab)), keys[i])[1] for i in range(g)]
        tokens = mx.concatenate(drafts)
        whole = self.text + tokens.tolist()
        self.followed.append(self.matcher.validate_tokens(whole) == len(whole))
        return Proposal(tokens)

    def commit(self, proposal, verdict: Verdict) -> int:
        self.text += verdict.emitted
        return 0


def test_drafts_are_drawn_under_the_mask(pair):
    target, _ = pair
    grammar = constrained.json_grammar(SCHEMA)
    drafter = FromFlatLogits(target, grammar)
    gen = specmlx.generate(
        target, PROMPT, drafter=drafter, num_draft=3, max_tokens=40, grammar=grammar
    ).run()
    assert drafter.followed and all(drafter.followed)
    assert gen.stats.accepted > 0


def test_a_schema_llguidance_cannot_compile_is_refused_in_one_line(pair):
    target, _ = pair
    with pytest.raises(SpecmlxError, match="schema cannot be used"):
        specmlx.generate(target, PROMPT, grammar=constrained.json_grammar({"type": "objekt"}))
