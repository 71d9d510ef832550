"""The Target and the drafter protocol: any drafter, chain or tree, decodes the target's
own greedy text; a tree's cache keeps exactly its accepted path."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import specmlx
from specmlx import drafters, tree
from specmlx.caches import prefill
from specmlx.cpu import argmax
from specmlx.drafters.protocol import Proposal, Verdict
from specmlx.errors import SpecmlxError
from specmlx.sampling import SamplingParams
from specmlx.target import Target
from specmlx.verify import accept_greedy, accept_tree

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n"
N = 24


def greedy(model, ids, n=N):
    return specmlx.generate(model, ids, max_tokens=n, num_draft=0).run().tokens


class Oracle:
    """A drafter from outside the package: proposes the target's own greedy text (known in
    advance), three deep, as a tree of two branches whose first is wrong every other round
    (so the accepted path is not the first nodes), or as a chain."""

    name = "oracle"

    def __init__(self, text: list[int], as_tree: bool = True):
        self.text, self.as_tree, self.rounds = text, as_tree, 0

    def start(self, context: list[int]) -> None:
        self.at = 0

    def propose(self, g, key, draw, go_on=None) -> Proposal:
        right = (self.text[self.at : self.at + 3] + [0, 0, 0])[:3]
        if not self.as_tree or g < 6:  # a proposal holds at most the g drafts asked
            return Proposal(mx.array(right[:g], mx.uint32))
        wrong = [(t + 1) % 50 for t in right]
        self.rounds += 1
        first, second = (wrong, right) if self.rounds % 2 else (right, wrong)
        return Proposal(mx.array(first + second, mx.uint32), parents=[-1, 0, 1, -1, 3, 4])

    def commit(self, proposal, verdict: Verdict) -> int:
        self.at += len(verdict.emitted)
        return 0


def test_a_drafter_written_outside_the_package_runs_through_generate(tiny_pair):
    target = specmlx.load(tiny_pair("qwen2")[0])
    ids = target.tokenizer.encode(PROMPT)
    plain = greedy(target, ids)
    gen = specmlx.generate(target, ids, max_tokens=N, drafter=Oracle(plain, as_tree=False))
    assert gen.run().tokens == plain
    assert gen.stats.rounds_by_source.get("oracle", 0) > 0 and gen.stats.accepted > 0


@pytest.mark.parametrize(
    "arch", ["llama", "qwen2", "qwen3", "gemma3_text", "gpt_oss", "qwen3_next", "mamba2"]
)
def test_a_tree_of_two_branches_three_deep_decodes_the_targets_greedy_text(tiny_pair, arch):
    target = specmlx.load(tiny_pair(arch)[0])
    ids = target.tokenizer.encode(PROMPT)
    plain = greedy(target, ids)
    gen = specmlx.generate(target, ids, max_tokens=N, num_draft=6, drafter=Oracle(plain))
    assert gen.run().tokens == plain
    rounds = gen.stats.rounds_by_source["oracle"]
    if Target(target).verifies_trees:  # KV caches and windows: the right branch passes
        assert gen.stats.trees_as_chains == 0 and gen.stats.accepted >= 3 * (rounds - 1)
    else:  # windows and recurrent states: its first path, as a chain, said in the stats
        assert gen.stats.trees_as_chains in (rounds - 1, rounds)  # the last may be a chain


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_after_a_tree_the_cache_holds_exactly_the_accepted_path(tiny_pair, arch):
    # The right branch second: its entries move up over the wrong one's. A sliding window
    # (gemma3_text's, short enough that the prompt wraps it) is cut like a full cache.
    model = specmlx.load(tiny_pair(arch)[0])
    ids = model.tokenizer.encode(PROMPT)
    plain = greedy(model, ids, n=4)
    target = Target(model)
    target.start(ids[:-1], SamplingParams(), model.vocab_size)
    wrong = [(t + 1) % 50 for t in plain[:3]]
    proposal = Proposal(mx.array(wrong + plain[:3], mx.uint32), parents=[-1, 0, 1, -1, 3, 4])
    verdict = target.verify(ids[-1], proposal, mx.random.key(0))
    assert verdict.path == [3, 4, 5] and verdict.emitted == plain[:4]
    assert target.cached == ids + plain[:3]
    fresh = make_prompt_cache(model.module)
    prefill(model, fresh, target.cached)
    x = mx.array([[plain[3]]], mx.uint32)
    after_tree = model.module(x, cache=target.cache)
    np.testing.assert_allclose(
        np.array(after_tree), np.array(model.module(x, cache=fresh)), rtol=1e-4, atol=1e-5
    )


def test_a_drafter_that_reads_hidden_states_gets_one_row_per_kept_position(tiny_pair):
    model = specmlx.load(tiny_pair("qwen2")[0])
    ids = model.tokenizer.encode(PROMPT)
    plain = greedy(model, ids)
    seen = []

    class Reader(Oracle):
        reads_hidden = True

        def start(self, context, features):
            seen.append((len(context) - 1, features.rows))
            super().start(context)

        def commit(self, proposal, verdict):
            seen.append((verdict.accepted, verdict.hidden.shape))
            return super().commit(proposal, verdict)

    gen = specmlx.generate(model, ids, max_tokens=N, num_draft=3, drafter=Reader(plain, False))
    assert gen.run().tokens == plain
    width = model.config["hidden_size"]
    assert seen[0] == (len(ids) - 1, len(ids) - 1)  # the prompt's features but the last's
    assert seen[1:] and all(shape == (n + 1, width) for n, shape in seen[1:])


def test_hidden_states_from_an_architecture_that_cannot_give_them_are_refused(tiny_pair):
    model = specmlx.load(tiny_pair("mamba2")[0])
    with pytest.raises(SpecmlxError, match="hidden states") as error:
        Target(model).set_hidden(True)
    assert "\n" not in str(error.value)


def test_the_tree_rule_on_a_chain_is_the_chain_rule():
    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = mx.array(rng.normal(size=(5, 11)).astype(np.float32))
        best = np.argmax(np.array(logits), axis=-1)
        drafts = best[:4].copy()
        wrong_from = rng.integers(0, 5)  # 4: every draft is the target's argmax
        drafts[wrong_from:] = (drafts[wrong_from:] + 1) % 11
        drafts = mx.array(drafts.astype(np.uint32))
        parents = tree.chain(4)
        ancestry = mx.array([row[1:] for row in tree.ancestry(parents)[1:]], mx.float32)
        depths = mx.array(tree.depths(parents), mx.int32)
        parent_rows = mx.array([p + 1 for p in parents], mx.uint32)
        n, token, row = accept_tree(argmax(logits), drafts, parent_rows, ancestry, depths)
        chain_n, chain_token = accept_greedy(logits, drafts)
        assert (n.item(), token.item(), row.item()) == (
            chain_n.item(),
            chain_token.item(),
            n.item(),
        )


def test_a_tree_is_described_by_its_parents():
    parents = [-1, 0, 1, -1, 3, 4]
    assert tree.depths(parents) == [1, 2, 3, 1, 2, 3]
    assert tree.path_to(parents, 5) == [3, 4, 5] and tree.path_to(parents, -1) == []
    assert tree.first_path(parents) == [0, 1, 2]
    assert tree.ancestry(parents)[6] == [True, False, False, False, True, True, True]
    assert tree.is_chain(tree.chain(3)) and not tree.is_chain(parents)
    with pytest.raises(ValueError, match="earlier node"):
        tree.check([-1, 2, 0])


def test_draft_modes_are_the_registered_drafters_and_auto():
    assert drafters.modes() == [k.name for k in drafters.kinds()] + ["auto"]
    assert {"lookup", "model"} <= set(drafters.modes())
    with pytest.raises(SpecmlxError, match="draft mode must be one of"):
        drafters.check_mode("medusa")


def test_a_registered_drafter_runs_by_name(tiny_pair):
    target = specmlx.load(tiny_pair("qwen2")[0])
    ids = target.tokenizer.encode(PROMPT)
    plain = greedy(target, ids)
    kind = drafters.DrafterKind("oracle", lambda sources: Oracle(plain), "test", free=True)
    drafters.register(kind)
    try:
        assert "oracle" in drafters.modes()
        gen = specmlx.generate(target, ids, max_tokens=N, num_draft=6, draft_mode="oracle")
        assert gen.run().tokens == plain and gen.stats.drafters == ["oracle"]
    finally:
        drafters._KINDS.pop("oracle")
