"""The head drafter (specmlx/heads/): drafts from the target's own features, and keeps
every promise a draft model keeps: greedy output equal to the target alone's on plain,
sliding-window and hybrid targets, the target's distribution at T = 1, its own cache
aligned with the text across a Session's calls, a head for another target refused.

Heads here are random (head.new_head): acceptance is low but not zero, which is what
exactness needs tested (both the accepted and the rejected paths run); a trained head's
acceptance is tests/test_head_train.py's."""

from __future__ import annotations

import subprocess
import sys
from itertools import islice

import numpy as np
import pytest
from stats_util import ALPHA, chi_square_pvalue, exact_joint

import specmlx
from specmlx.errors import SpecmlxError
from specmlx.heads import what_is
from specmlx.heads.feature import new_head
from specmlx.heads.store import load_head, save_head
from specmlx.tiny import build_tiny_model

PROMPT = "def fibonacci(n):\n    if n < 2:"
N = 40


@pytest.fixture(scope="module")
def heads(tiny_pair, tmp_path_factory):
    """arch -> (target, its head loaded from a written head directory)."""
    root = tmp_path_factory.mktemp("heads")
    made = {}

    def make(arch: str):
        if arch not in made:
            target = specmlx.load(tiny_pair(arch)[0])
            save_head(new_head(target, seed=1), target, root / arch, {"steps": 0})
            made[arch] = target, load_head(root / arch, target)
        return made[arch]

    return make


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text", "qwen3_next"])
@pytest.mark.parametrize("gamma", [3, "auto"])
def test_greedy_with_a_head_equals_the_target_alone(heads, arch, gamma):
    target, head = heads(arch)
    plain = specmlx.generate(target, PROMPT, max_tokens=N, num_draft=0).run()
    gen = specmlx.generate(target, PROMPT, head, max_tokens=N, num_draft=gamma, draft_mode="head")
    assert gen.run().tokens == plain.tokens
    assert gamma == "auto" or gen.stats.rounds_by_source.get("head", 0) > N // 4


def test_the_heads_drafts_are_sometimes_accepted_and_sometimes_not(heads):
    # Both paths of each round (kept drafts, a rejected draft's rows trimmed) are run; a
    # random head's greedy drafts all fail, its samples at T = 1 pass now and then.
    target, head = heads("qwen2")
    kw = dict(temperature=1.0, sampling="rejection", seed=2)
    gen = specmlx.generate(target, PROMPT, head, max_tokens=N, num_draft=2, draft_mode="head", **kw)
    stats = gen.run().stats
    assert 0 < stats.accepted < stats.drafted


def test_a_sessions_later_calls_stay_exact_as_the_conversation_grows(heads):
    # The head keeps its rows across calls: a second call reuses them up to the common
    # prefix, takes the target's features for the rest, and drafts exactly again.
    target, head = heads("llama")
    session = specmlx.Session(target, head)
    first = specmlx.generate(target, PROMPT, max_tokens=12, num_draft=3, session=session)
    grown = [*target.tokenizer.encode(PROMPT), *first.run().tokens, 7, 9]
    again = specmlx.generate(target, grown, max_tokens=N, num_draft=3, session=session).run()
    alone = specmlx.generate(target, grown, max_tokens=N, num_draft=0).run()
    assert again.tokens == alone.tokens
    assert again.stats.prefill_tokens < len(grown)  # the target's prefix was reused


def test_a_session_that_decoded_without_the_head_gives_it_the_features_it_missed(heads):
    target, head = heads("qwen2")
    session = specmlx.Session(target, head)
    specmlx.generate(target, PROMPT, max_tokens=8, num_draft=0, session=session).run()
    gen = specmlx.generate(target, PROMPT + " return", max_tokens=N, num_draft=3, session=session)
    alone = specmlx.generate(target, PROMPT + " return", max_tokens=N, num_draft=0)
    assert gen.run().tokens == alone.run().tokens


def test_coupled_sampling_with_a_head_gives_the_target_alones_text_for_a_seed(heads):
    target, head = heads("gemma3_text")
    kw = dict(max_tokens=N, temperature=1.0, seed=5, sampling="coupled")
    alone = specmlx.generate(target, PROMPT, num_draft=0, **kw).run()
    gen = specmlx.generate(target, PROMPT, head, num_draft=3, draft_mode="head", **kw).run()
    assert gen.tokens == alone.tokens


def test_a_head_made_for_another_target_is_refused_in_one_line(heads, tmp_path):
    _, head = heads("qwen2")
    other = specmlx.load(build_tiny_model(tmp_path / "other", arch="qwen2", seed=9))
    with pytest.raises(SpecmlxError, match="trained for .* not other") as error:
        load_head(head.path, other)
    assert "\n" not in str(error.value)


def test_a_head_directory_is_told_apart_from_a_model(heads, tiny_pair):
    _, head = heads("qwen2")
    assert what_is(head.path) == "head"
    assert what_is(tiny_pair("qwen2")[0]) == "model"


def test_generate_says_the_draft_it_was_given_is_a_head(heads, tiny_pair):
    _, head = heads("qwen2")
    command = [sys.executable, "-m", "specmlx", "generate", "-m", str(tiny_pair("qwen2")[0])]
    command += ["-d", str(head.path), "-p", "def", "-n", "8", "-g", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"draft: {head.path} is a head" in done.stderr


S = 3000  # as tests/test_lossless.py: power > 0.99 against a total variation of ~0.1


@pytest.mark.parametrize("sampling", ["rejection", "coupled"])
def test_a_heads_drafts_keep_the_target_distribution_at_t1(tmp_path_factory, sampling):
    """The first two tokens of S seeded generations at T = 1 against the target's exact
    joint distribution (chi-square at ALPHA, small cells merged): one-layer target."""
    root = tmp_path_factory.mktemp("head-lossless")
    target = specmlx.load(build_tiny_model(root / "target", seed=0, layers=1))
    target.tokenizer.eos_token_ids = set()
    save_head(new_head(target, seed=3), target, root / "head", {"steps": 0})
    head = load_head(root / "head", target)
    prompt, settings = [5, 17, 42, 99], dict(temperature=1.0)
    counts = np.zeros((target.vocab_size, target.vocab_size))
    session = specmlx.Session(target, head)
    for seed in range(S):
        gen = specmlx.generate(
            target, prompt, head, num_draft=2, max_tokens=2, seed=seed, session=session,
            draft_mode="head", sampling=sampling, **settings,
        )  # fmt: skip
        a, b = (step.token for step in islice(gen, 2))
        gen.close()
        counts[a, b] += 1
    assert chi_square_pvalue(counts, exact_joint(target, settings, prompt)) > ALPHA


def test_a_server_with_a_head_answers_with_the_target_alones_greedy_text(heads):
    import openai
    from test_server import running, template_ids

    from specmlx.server import make_app

    target, head = heads("qwen2")
    ids = template_ids(target, "def fibonacci")
    alone = specmlx.generate(target, ids, max_tokens=16, num_draft=0).run()
    with running(make_app(target, head, model_id="tiny")) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "def fibonacci"}],
            temperature=0,
            max_tokens=16,
            extra_body={"num_draft": 3, "draft_mode": "head"},
        )
    assert reply.choices[0].message.content == alone.text
    assert reply.model_extra["specmlx"]["drafted"] > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text"])
def test_a_heads_trees_keep_greedy_output_the_target_alones(heads, arch):
    target, head = heads(arch)
    plain = specmlx.generate(target, PROMPT, max_tokens=N, num_draft=0).run()
    gen = specmlx.generate(
        target, PROMPT, head, max_tokens=N, num_draft=3, tree=6, draft_mode="head"
    ).run()
    assert gen.tokens == plain.tokens
    assert gen.stats.tree_rounds > N // 4  # the head grew trees, and they were judged whole


def test_a_heads_trees_keep_the_target_distribution_at_t1(tmp_path):
    """As the chain test above, with a 5-node tree of at most 2 levels each round and
    rejection sampling (siblings drawn without replacement): S runs, chi-square at ALPHA."""
    target = specmlx.load(build_tiny_model(tmp_path / "target", seed=0, layers=1))
    target.tokenizer.eos_token_ids = set()
    save_head(new_head(target, seed=3), target, tmp_path / "head", {"steps": 0})
    head = load_head(tmp_path / "head", target)
    prompt, settings = [5, 17, 42, 99], dict(temperature=1.0)
    counts, trees = np.zeros((target.vocab_size, target.vocab_size)), 0
    session = specmlx.Session(target, head)
    for seed in range(S):
        gen = specmlx.generate(
            target, prompt, head, num_draft=2, tree=5, max_tokens=8, seed=seed,
            session=session, draft_mode="head", sampling="rejection", **settings,
        )  # fmt: skip
        a, b = (step.token for step in islice(gen, 2))
        trees += gen.stats.tree_rounds
        gen.close()
        counts[a, b] += 1
    assert trees > S // 2  # the first round is a tree (3 children, then 2 under the best)
    assert chi_square_pvalue(counts, exact_joint(target, settings, prompt)) > ALPHA
