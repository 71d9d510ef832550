"""Coupled sampling: every output position's randomness keyed by (seed, position), a
draft passing where it equals the target's own draw there. A seed then gives one text,
whatever rounds the drafts fell into, and it is the target alone's text at that seed: so
the output is the target's distribution exactly, as plain sampling's is."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import pytest

import specmlx
from specmlx.proposal import Proposal
from specmlx.sampling import KEYS_PER_BLOCK, position_keys

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n"
N = 32


def run(target, **kwargs):
    kwargs = {"max_tokens": N, "temperature": 1.0, "sampling": "coupled", **kwargs}
    return specmlx.generate(target, PROMPT, **kwargs).run()


@pytest.fixture(scope="module")
def pair(tiny_pair):
    target, draft = tiny_pair("qwen2")
    return specmlx.load(target), specmlx.load(draft)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_any_rounds_give_the_target_alones_text_at_that_seed(pair, seed):
    target, draft = pair
    alone = run(target, num_draft=0, seed=seed).tokens
    for rounds in (dict(num_draft=1), dict(num_draft=4), dict(num_draft="auto")):
        assert run(target, draft=draft, seed=seed, **rounds).tokens == alone
    assert run(target, draft_mode="lookup", num_draft=3, seed=seed).tokens == alone


def test_drafts_pass_where_the_draft_draws_what_the_target_draws(pair):
    # a close draft drawing from the same uniforms agrees with the target often
    target, draft = pair
    gen = run(target, draft=draft, num_draft=2, seed=0)
    assert gen.stats.sampling == "coupled" and 0 < gen.stats.accepted < gen.stats.drafted


def test_a_tree_at_temperature_one_is_judged_whole(pair):
    target, _ = pair
    alone = run(target, num_draft=0, seed=5).tokens

    class TwoBranches:
        name = "two-branches"

        def start(self, context):
            self.at = 0

        def propose(self, g, keys, draw, go_on=None):
            right = (alone[self.at : self.at + 2] + [0, 0])[:2]
            if g < 4:  # room for one chain only
                return Proposal(mx.array(right[:g], mx.uint32))
            wrong = [(t + 1) % 50 for t in right]
            return Proposal(mx.array(wrong + right, mx.uint32), parents=[-1, 0, -1, 2])

        def commit(self, proposal, verdict):
            self.at += len(verdict.emitted)
            return 0

    gen = run(target, drafter=TwoBranches(), num_draft=4, seed=5)
    assert gen.tokens == alone
    assert gen.stats.trees_as_chains == 0 and gen.stats.accepted > 0


def test_a_positions_key_does_not_depend_on_how_many_were_asked():
    keys = position_keys(7)
    whole = keys(KEYS_PER_BLOCK - 3, 6)  # across a block boundary
    assert mx.array_equal(whole[4], keys(KEYS_PER_BLOCK + 1, 1)[0])
    assert mx.array_equal(keys(0, 10)[5], position_keys(7)(5, 1)[0])
    assert not mx.array_equal(keys(0, 1)[0], position_keys(8)(0, 1)[0])


def test_rejection_sampling_keeps_its_own_randomness(pair):
    # the default judges drafts by rejection sampling, whose draws are split round by
    # round: not the coupled text, and still one text per seed at a fixed γ
    target, draft = pair
    first = run(target, draft=draft, num_draft=3, seed=4, sampling="rejection")
    again = run(target, draft=draft, num_draft=3, seed=4, sampling="rejection")
    assert first.stats.sampling == "rejection" and first.tokens == again.tokens


def test_an_unknown_sampling_is_refused_in_one_line(pair):
    target, _ = pair
    with pytest.raises(specmlx.SpecmlxError, match="sampling must be one of") as error:
        run(target, sampling="gumbel")
    assert "\n" not in str(error.value)


def test_generate_with_a_seed_prints_one_reply_run_after_run(tmp_path):
    # auto's rounds follow measured timings and the cost cache each run updates, and a
    # fixed γ drafts other rounds again: the reply follows none of them, and it is the
    # reply --no-draft prints at that seed
    env = {**os.environ, "SPECMLX_HOME": str(tmp_path)}
    args = [sys.executable, "-m", "specmlx", "generate", "--model", "tiny", "-p", "hi"]
    args += ["-n", "24", "-t", "1", "--seed", "3", "--quiet"]

    def reply(*extra: str) -> str:
        run = subprocess.run([*args, *extra], capture_output=True, text=True, env=env)
        assert run.returncode == 0, run.stderr
        return run.stdout

    replies = {reply() for _ in range(3)} | {reply("-g", "1"), reply("-g", "3")}  # these draft
    assert len(replies) == 1 and replies == {reply("--no-draft")}
