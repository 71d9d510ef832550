"""Tree drafting: the draft model grows a tree EAGLE-2 style, prompt lookup proposes a
matched n-gram's several continuations; greedy output stays the target's own, on every
architecture, with branches that pass and fail."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import specmlx
from specmlx import tree
from specmlx.caches import prefill
from specmlx.drafters.lookup import LookupDrafter
from specmlx.drafters.model import ModelDrafter
from specmlx.drafters.treedraft import grow, pass_widths, without_replacement
from specmlx.errors import SpecmlxError
from specmlx.sampling import SamplingParams
from specmlx.tree import Shape
from specmlx.verify import make_sampler

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n"
N = 40
SHAPE = Shape((-1, -1, -1, 0, 0, 3, 5, 6))  # 3 under the root, 2 under its first, ...


def greedy(model, ids, n=N):
    return specmlx.generate(model, ids, max_tokens=n, num_draft=0).run().tokens


def walks(monkeypatch, cls):
    """Record tree.walk of every tree round a drafter of `cls` commits."""
    seen = []
    commit = cls.commit

    def recording(self, proposal, verdict):
        if proposal is not None and not proposal.is_chain:
            seen.append(tree.walk(proposal.parents, verdict.path))
        return commit(self, proposal, verdict)

    monkeypatch.setattr(cls, "commit", recording)
    return seen


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_draft_model_trees_decode_the_targets_greedy_text(tiny_pair, arch, monkeypatch):
    target_dir, draft_dir = tiny_pair(arch)
    target, draft = specmlx.load(target_dir), specmlx.load(draft_dir)
    ids = target.tokenizer.encode(PROMPT)
    plain = greedy(target, ids)
    seen = walks(monkeypatch, ModelDrafter)
    gen = specmlx.generate(
        target, ids, draft=draft, max_tokens=N, num_draft=4, tree=8, draft_mode="model"
    )
    assert gen.run().tokens == plain
    assert gen.stats.tree_rounds > 0 and gen.stats.trees_as_chains == 0
    taken = {rank for walk in seen for _, rank in walk}
    # drafts passed on the first branch and on a later one, and failed on every branch
    assert {0, 1, -1} <= taken


def repeating_prompt(model) -> list[int]:
    """A text whose last two tokens followed earlier by three different continuations."""
    rng = np.random.default_rng(0)
    a, b = 7, 11
    body = []
    for _ in range(3):
        body += [a, b, *rng.integers(20, 200, 5).tolist()]
    return [*rng.integers(20, 200, 6).tolist(), *body, a, b]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3_text"])
def test_prompt_lookup_trees_decode_the_targets_greedy_text(tiny_pair, arch, monkeypatch):
    target = specmlx.load(tiny_pair(arch)[0])
    ids = repeating_prompt(target)
    plain = greedy(target, ids, n=24)
    seen = walks(monkeypatch, LookupDrafter)
    gen = specmlx.generate(
        target, ids, max_tokens=24, num_draft=4, tree=8, draft_mode="lookup", draft=None
    )
    assert gen.run().tokens == plain
    assert gen.stats.tree_rounds > 0 and gen.stats.trees_as_chains == 0
    assert any(children > 1 for walk in seen for children, _ in walk)  # branches


def test_lookup_merges_continuations_into_branches_most_recent_first():
    drafter = LookupDrafter()
    drafter.start([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3, 5, 7, 1, 2, 3])
    tokens, parents = drafter.branches(Shape((-1, 0, 1, -1, 3)))  # 5 nodes, 3 deep, 2 wide
    # after [1, 2, 3]: 5 7 1 (latest), 5 6 1, 4 9 1; then after [2, 3] the same ones
    assert tokens == [5, 7, 1, 6, 1] and parents == [-1, 0, 1, 0, 3]
    assert drafter.find(3) == [5, 7, 1]  # the chain: the latest occurrence alone


def test_lookup_keeps_within_the_width_asked():
    drafter = LookupDrafter()
    drafter.start([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 6, 1, 2, 3])
    tokens, parents = drafter.branches(Shape((-1, -1, 0)))  # 2 wide, 2 deep
    assert tokens == [6, 1, 5] and parents == [-1, 0, -1]  # no room for 4


class Table:
    """A drafter's distributions from a table: the next token's logits depend on the
    last token alone; a step records what it was run over."""

    def __init__(self, vocab: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.logits = mx.array(rng.normal(size=(vocab, vocab)).astype(np.float32) * 2)
        self.runs: list[list[int]] = []

    def step(self, feed, tokens, parents):
        self.runs.append(list(feed))
        return self.logits[mx.array([tokens[j] for j in feed])]


def test_a_grown_tree_keeps_within_its_shape_and_runs_a_pass_per_level():
    table = Table(50)
    draw = make_sampler(SamplingParams(), 50)
    keys = mx.random.split(mx.random.key(0), 8)
    proposal = grow(table.logits[3:4], table.step, SHAPE, keys, draw, 50)
    grown = Shape(tuple(proposal.parents))
    assert grown.at_depth == SHAPE.at_depth and grown.width <= SHAPE.width
    assert [len(run) for run in table.runs] == pass_widths(SHAPE.at_depth)[1:]


def test_at_temperature_0_a_nodes_children_are_its_top_tokens_in_order():
    table = Table(50)
    draw = make_sampler(SamplingParams(), 50)
    proposal = grow(
        table.logits[3:4], table.step, Shape((-1, -1, -1)), mx.zeros((1, 2), mx.uint32), draw, 50
    )
    top = np.argsort(-np.array(table.logits[3]), kind="stable")[:3].tolist()
    assert proposal.tokens.tolist() == top and proposal.q is None


def test_the_most_probable_paths_get_the_children():
    table = Table(50)
    draw = make_sampler(SamplingParams(), 50)
    keys = mx.zeros((4, 2), mx.uint32)
    proposal = grow(table.logits[3:4], table.step, Shape((-1, -1, 0, 1)), keys, draw, 50)
    probs = np.array(mx.softmax(table.logits, axis=-1))
    first = proposal.tokens.tolist()[:2]
    # depth 2 holds two nodes: the two best of (first child's top, second child's top...)
    values = sorted((probs[3, a] * p, a) for a in first for p in np.sort(probs[a])[::-1][:2])[::-1][
        :2
    ]
    children = proposal.tokens.tolist()[2:]
    parents = [first[proposal.parents[j]] for j in (2, 3)]
    got = sorted((probs[3, a] * probs[a, t], a) for a, t in zip(parents, children, strict=True))
    np.testing.assert_allclose([v for v, _ in got[::-1]], [v for v, _ in values], rtol=1e-5)


def test_sampled_siblings_are_drawn_without_replacement_and_judged_by_what_they_were_drawn_from():
    table = Table(20, seed=1)
    draw = make_sampler(SamplingParams(temperature=1.0), 20)
    for seed in range(20):
        keys = mx.random.split(mx.random.key(seed), 2)
        proposal = grow(table.logits[3:4], table.step, Shape((-1, -1, -1)), keys, draw, 20)
        tokens = proposal.tokens.tolist()
        assert len(set(tokens)) == 3
        probs = mx.softmax(table.logits[3], axis=-1)
        expected = [without_replacement(probs, mx.array(tokens[:r], mx.uint32)) for r in (1, 2)]
        np.testing.assert_allclose(np.array(proposal.q[0]), np.array(probs), rtol=1e-5)
        for r in (1, 2):
            np.testing.assert_allclose(
                np.array(proposal.q[r]), np.array(expected[r - 1]), atol=1e-7
            )


def test_after_a_tree_the_draft_cache_holds_exactly_the_accepted_path(tiny_pair):
    target_dir, draft_dir = tiny_pair("qwen2")
    target, draft = specmlx.load(target_dir), specmlx.load(draft_dir)
    ids = target.tokenizer.encode(PROMPT)
    session = specmlx.Session(target, draft)
    gen = specmlx.generate(
        target, ids, max_tokens=12, num_draft=3, tree=6, draft_mode="model", session=session
    )
    tokens = gen.run().tokens
    drafter = session.made["model"]
    assert gen.stats.tree_rounds > 0 and drafter.cached == (ids + tokens)[: len(drafter.cached)]
    fresh = make_prompt_cache(draft.module)
    prefill(draft, fresh, drafter.cached)
    x = mx.array([[drafter.pending[0]]], mx.uint32)
    np.testing.assert_allclose(
        np.array(draft.module(x, cache=drafter.cache)),
        np.array(draft.module(x, cache=fresh)),
        rtol=1e-4,
        atol=1e-5,
    )


@pytest.mark.parametrize("value", ["0", "1", "17", "wide", "-3"])
def test_a_bad_tree_setting_is_refused_in_one_line(tiny_pair, value):
    target = specmlx.load(tiny_pair("qwen2")[0])
    with pytest.raises(SpecmlxError, match="tree must be auto, off or a number") as error:
        specmlx.generate(target, [1, 2, 3], tree=value)
    assert "\n" not in str(error.value)
