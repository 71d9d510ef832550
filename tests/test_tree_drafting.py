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
SHAPE = Shape((-1, -1, -1, 0, 0, 3, 5, 6))  # 3+2+1+1+1: 3 under the root, 2 under its first, ...


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


def test_a_sampled_tree_keeps_within_its_shape_and_runs_a_pass_per_level():
    table = Table(50)
    draw = make_sampler(SamplingParams(temperature=1.0), 50)
    keys = mx.random.split(mx.random.key(0), 8)
    proposal, kept = grow(table.logits[3:4], table.step, SHAPE, keys, draw, 50)
    grown = Shape(tuple(proposal.parents))
    assert grown.at_depth == SHAPE.at_depth and grown.width <= SHAPE.width
    assert [len(run) for run in table.runs] == pass_widths(SHAPE.at_depth)[1:]
    assert kept == list(range(SHAPE.nodes))


def test_at_temperature_0_a_nodes_children_are_its_top_tokens_in_order():
    table = Table(50)
    draw = make_sampler(SamplingParams(), 50)
    proposal, _ = grow(
        table.logits[3:4], table.step, Shape((-1, -1, -1)), mx.zeros((1, 2), mx.uint32), draw, 50
    )
    top = np.argsort(-np.array(table.logits[3]), kind="stable")[:3].tolist()
    assert proposal.tokens.tolist() == top and proposal.q is None


def path_values(proposal, probs, first: int) -> list[float]:
    """The drafter's probability of each node's whole path, the root's token `first`."""
    tokens, out = proposal.tokens.tolist(), []
    for j, parent in enumerate(proposal.parents):
        above, before = (1.0, first) if parent < 0 else (out[parent], tokens[parent])
        out.append(above * probs[before, tokens[j]])
    return out


def test_at_temperature_0_the_tree_keeps_the_most_probable_paths_of_all_offered():
    # 2 wide, 2 levels: the root's top 2 are run, each offers its top 2: of the 6 paths
    # offered, the shape's 4 nodes are the 4 most probable, wherever they hang
    for seed in range(8):
        table = Table(50, seed)
        probs = np.array(mx.softmax(table.logits, axis=-1))
        draw = make_sampler(SamplingParams(), 50)
        keys = mx.zeros((4, 2), mx.uint32)
        shape = Shape((-1, -1, 0, 1))
        proposal, _ = grow(table.logits[3:4], table.step, shape, keys, draw, 50)
        offered = []
        for a in np.argsort(-probs[3], kind="stable")[:2]:
            offered.append(probs[3, a])
            offered += [probs[3, a] * p for p in np.sort(probs[a])[::-1][:2]]
        got = sorted(path_values(proposal, probs, 3), reverse=True)
        np.testing.assert_allclose(got, sorted(offered, reverse=True)[:4], rtol=1e-5)


def test_at_temperature_0_a_sure_drafter_grows_a_chain_as_deep_as_the_shape_runs():
    table = sure_table()
    draw = make_sampler(SamplingParams(), 50)
    proposal, _ = grow(table.logits[3:4], table.step, SHAPE, mx.zeros((8, 2), mx.uint32), draw, 50)
    path = tree.first_path(proposal.parents)
    assert proposal.tokens[mx.array(path)].tolist() == [4, 5, 6, 7, 8]  # the shape runs 5 levels
    assert proposal.tokens.size == SHAPE.nodes


def test_sampled_siblings_are_drawn_without_replacement_and_judged_by_what_they_were_drawn_from():
    table = Table(20, seed=1)
    draw = make_sampler(SamplingParams(temperature=1.0), 20)
    for seed in range(20):
        keys = mx.random.split(mx.random.key(seed), 2)
        proposal, _ = grow(table.logits[3:4], table.step, Shape((-1, -1, -1)), keys, draw, 20)
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


def sure_table() -> Table:
    """A drafter sure of every next token: each token is followed by the next."""
    table = Table(50)
    sure = np.full((50, 50), -9.0, np.float32)
    sure[np.arange(50), (np.arange(50) + 1) % 50] = 9.0
    table.logits = mx.array(sure)
    return table


def test_at_temperature_0_a_tree_may_run_as_deep_as_its_shape_allows():
    table = sure_table()
    draw = make_sampler(SamplingParams(), 50)
    shape = Shape(SHAPE.parents, depth=8)
    proposal, _ = grow(table.logits[3:4], table.step, shape, mx.zeros((8, 2), mx.uint32), draw, 50)
    assert proposal.is_chain and proposal.tokens.tolist() == list(range(4, 12))  # 8 levels


def test_a_sampled_tree_keeps_its_shapes_levels_whatever_depth_it_allows():
    table = sure_table()
    draw = make_sampler(SamplingParams(temperature=1.0), 50)
    keys = mx.random.split(mx.random.key(0), 8)
    shape = Shape(SHAPE.parents, depth=8)
    proposal, _ = grow(table.logits[3:4], table.step, shape, keys, draw, 50)
    assert Shape(tuple(proposal.parents)).at_depth == SHAPE.at_depth
