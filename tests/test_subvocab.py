"""A draft head cut to a sub-vocabulary (drafters.subvocab) keeps speculation exact.

The tiny models' 300-token vocabulary is cut to N = 150 tokens (the three special tokens
and ids 0-146), so about half of what the target emits lies outside: drafts are rejected
for it, and the residual is drawn where q is zero.
"""

from __future__ import annotations

import dataclasses
import json
from itertools import islice

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from stats_util import ALPHA, chi_square_pvalue, exact_joint

import specmlx
from specmlx.cpu.quantized import patch_model
from specmlx.drafters import subvocab
from specmlx.drafters.model import ModelDrafter, model_drafter
from specmlx.drafters.protocol import cost_id
from specmlx.drafters.subvocab import (
    ENV,
    SubHead,
    always_in,
    draft_size,
    sub_head,
    sub_vocab,
    token_order,
    tokenizer_key,
)
from specmlx.errors import SpecmlxError
from specmlx.sampling import SamplingParams
from specmlx.tiny import build_tiny_model
from specmlx.verify import make_sampler

N = 150
PROMPT = [5, 17, 42, 99]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """One-layer qwen2 target and a perturbed draft, their EOS taken away (runs end at
    max_tokens), and a tied-head gemma3_text model."""
    root = tmp_path_factory.mktemp("subvocab")
    target = build_tiny_model(root / "target", seed=0, layers=1)
    draft = build_tiny_model(root / "draft", seed=1, layers=1, perturb_from=target, noise=0.1)
    models = {"target": specmlx.load(target), "draft": specmlx.load(draft)}
    for m in models.values():
        m.tokenizer.eos_token_ids = set()
    models["gemma"] = specmlx.load(build_tiny_model(root / "gemma", arch="gemma3_text", seed=3))
    return models


def cut(draft: specmlx.Model, size: int = N) -> ModelDrafter:
    return ModelDrafter(
        draft, draft.vocab_size, sub_head(draft, sub_vocab(draft, size), draft.vocab_size)
    )


def session(target, draft, monkeypatch, size: int = N) -> specmlx.Session:
    monkeypatch.setenv(ENV, str(size))
    s = specmlx.Session(target, draft)
    assert (
        isinstance(s.drafters("model")[0].head, SubHead)
        and s.drafters("model")[0].head.ids.size == size
    )
    return s


@pytest.mark.parametrize("gamma", [1, 3, 5, "auto"])
def test_greedy_speculation_with_a_sub_vocab_draft_equals_the_target(pair, monkeypatch, gamma):
    target, draft = pair["target"], pair["draft"]
    alone = specmlx.generate(target, PROMPT, max_tokens=48, num_draft=0).run().tokens
    s = session(target, draft, monkeypatch)
    gen = specmlx.generate(target, PROMPT, draft, max_tokens=48, num_draft=gamma, session=s).run()
    assert gen.tokens == alone
    assert any(
        t not in set(s.drafters("model")[0].head.ids.tolist()) for t in alone
    )  # some lie outside


def test_greedy_speculation_with_a_tied_sub_vocab_head_equals_the_target(pair, monkeypatch):
    gemma = pair["gemma"]  # its own draft; a tied head, rotating caches rewound
    alone = specmlx.generate(gemma, PROMPT, max_tokens=32, num_draft=0).run().tokens
    s = session(gemma, gemma, monkeypatch)
    gen = specmlx.generate(gemma, PROMPT, gemma, max_tokens=32, num_draft=4, session=s).run()
    assert gen.tokens == alone


def test_q_is_zero_outside_the_sub_vocab_and_sums_to_one(pair):
    draft = pair["draft"]
    drafter = cut(draft)
    drafter.start(PROMPT)
    draw = make_sampler(SamplingParams(temperature=1.0), draft.vocab_size)
    proposal = drafter.propose(6, mx.random.split(mx.random.key(0), 6), draw)
    q = np.array(proposal.q)
    outside = np.setdiff1d(np.arange(draft.vocab_size), np.array(drafter.head.ids))
    assert q.shape == (6, draft.vocab_size)
    assert (q[:, outside] == 0).all()
    np.testing.assert_allclose(q.sum(axis=1), 1.0, atol=1e-5)
    tokens = proposal.tokens.tolist()
    assert all(q[i, t] > 0 for i, t in enumerate(tokens))  # drawn from the q it reports


# Sampled exactness, as in test_lossless.py: the first two tokens of 4-token generations
# (γ = 3) over S seeds against the target's exact joint distribution, chi-square at ALPHA
# with cells of expected count < 5 merged. Power: 3,000 samples reject a sampler off by a
# total variation of ~0.1 on the main cells with probability > 0.99.
S = 3000


def test_sampled_speculation_with_a_sub_vocab_draft_follows_the_target(pair, monkeypatch):
    target, draft = pair["target"], pair["draft"]
    counts = np.zeros((target.vocab_size, target.vocab_size))
    s = session(target, draft, monkeypatch)
    drafted = accepted = 0
    for seed in range(S):
        gen = specmlx.generate(
            target, PROMPT, draft, max_tokens=4, num_draft=3, temperature=1.0, seed=seed, session=s
        )
        a, b = (step.token for step in islice(gen, 2))
        gen.close()  # rounds after the second token tell the test nothing
        counts[a, b] += 1
        drafted, accepted = drafted + gen.stats.drafted, accepted + gen.stats.accepted
    assert 0.1 < accepted / drafted < 0.9
    assert chi_square_pvalue(counts, exact_joint(target, {"temperature": 1.0}, PROMPT)) > ALPHA


def test_every_sub_vocab_keeps_the_eos_and_special_tokens(models):
    draft = models["perturbed"]
    special = always_in(draft)
    assert set(draft.tokenizer.eos_token_ids) <= set(special)
    last_first = mx.array(np.arange(draft.vocab_size)[::-1].copy(), mx.uint32)
    for size, order in [(1, None), (N, None), (N, last_first)]:
        ids = sub_vocab(draft, size, order).tolist()
        assert set(special) <= set(ids) and ids == sorted(ids)
        assert len(ids) == max(size, len(special))


def test_a_draft_cut_to_the_special_tokens_proposes_its_eos_where_it_ranks_first(models):
    draft = models["perturbed"]
    eos = next(iter(draft.tokenizer.eos_token_ids))
    drafter = cut(draft, size=1)  # only what always_in keeps
    drafter.start(PROMPT)
    logits = draft.module(mx.array([PROMPT]))[0, -1]
    special = mx.array(always_in(draft))
    best = int(special[mx.argmax(logits[special])].item())
    draw = make_sampler(SamplingParams(), draft.vocab_size)
    proposal = drafter.propose(1, mx.random.split(mx.random.key(0), 1), draw)
    assert proposal.tokens.tolist() == [best]
    assert eos in always_in(draft)


def quantized(model: specmlx.Model) -> specmlx.Model:
    """The model with every linear layer and the head at 8 bits on the native kernel."""
    nn.quantize(model.module, group_size=64, bits=8)
    patch_model(model.module)
    return model


@pytest.mark.parametrize("kind", ["dense", "int8", "tied"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_sub_vocab_covering_everything_equals_the_full_head_bitwise(
    model_dirs, pair, kind, temperature
):
    if kind == "tied":
        draft = pair["gemma"]
    else:
        draft = specmlx.load(model_dirs["perturbed"])
        if kind == "int8":
            draft = quantized(draft)
    full, whole = ModelDrafter(draft, draft.vocab_size), cut(draft, draft.vocab_size)
    assert whole.head.ids.tolist() == list(range(draft.vocab_size))
    draw = make_sampler(SamplingParams(temperature=temperature), draft.vocab_size)
    proposals = []
    for drafter in (full, whole):
        drafter.start(PROMPT)
        proposals.append(drafter.propose(5, mx.random.split(mx.random.key(7), 5), draw))
    a, b = proposals
    assert a.tokens.tolist() == b.tokens.tolist()
    if temperature:
        assert mx.array_equal(a.q, b.q).item()


def test_the_size_is_the_env_var_or_the_full_head_where_it_cannot_be_cut(models, monkeypatch):
    draft = models["perturbed"]
    monkeypatch.setenv(ENV, "100")
    assert draft_size(draft) == 100
    assert isinstance(model_drafter(draft, draft.vocab_size).head, SubHead)
    monkeypatch.setenv(ENV, "full")
    assert draft_size(draft) is None and model_drafter(draft, draft.vocab_size).head is None
    monkeypatch.setenv(ENV, str(draft.vocab_size))  # covers everything: nothing to cut
    assert draft_size(draft) is None
    monkeypatch.setenv(ENV, "100")
    other = dataclasses.replace(draft, config={**draft.config, "model_type": "mamba2"})
    assert draft_size(other) is None


def test_unset_the_size_is_the_default_where_the_vocabulary_is_larger(models, monkeypatch):
    draft = models["perturbed"]
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(subvocab, "DEFAULT_SIZE", 100)
    assert draft_size(draft) == 100
    monkeypatch.setattr(subvocab, "DEFAULT_SIZE", 65536)  # above the tiny 300 tokens
    assert draft_size(draft) is None


def test_a_counted_table_for_the_tokenizer_ranks_its_ids_first(models, monkeypatch, tmp_path):
    draft = models["perturbed"]
    table = tmp_path / "frequent_tokens.json"
    monkeypatch.setattr(subvocab, "TABLE", table)
    subvocab.counted_ids.cache_clear()
    assert token_order(draft).tolist() == list(range(draft.vocab_size))  # no table: id order
    key = tokenizer_key(draft.path / "tokenizer.json")
    table.write_text(json.dumps({key: {"source": "a test", "ids": [250, 7, 120]}}))
    subvocab.counted_ids.cache_clear()
    order = token_order(draft).tolist()
    rest = [t for t in range(draft.vocab_size) if t not in (250, 7, 120)]
    assert order == [250, 7, 120, *rest]
    assert sub_vocab(draft, 6).tolist() == sorted({*always_in(draft), 250, 7, 120})
    subvocab.counted_ids.cache_clear()


@pytest.mark.parametrize("value", ["lots", "0", "-5", "3.5"])
def test_a_bad_size_is_refused_in_one_line(models, monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(SpecmlxError, match=f"{ENV}=.*'full'") as error:
        draft_size(models["perturbed"])
    assert "\n" not in str(error.value)


def test_costs_measured_with_one_head_are_not_read_for_another(pair, monkeypatch):
    # A cut head makes the draft's pass cheaper: its cost figures must not blend with the
    # full head's in the cost cache.
    target, draft = pair["target"], pair["draft"]

    def key(s):
        return s.cost_key(cost_id(s.drafters("model")[0]))

    cut_key = key(session(target, draft, monkeypatch))
    monkeypatch.setenv(ENV, "full")
    full_key = key(specmlx.Session(target, draft))
    assert cut_key != full_key and f"head {N}" in cut_key


def test_sessions_of_one_draft_share_its_cut_head(pair, monkeypatch):
    # Every Session (a chat's /reset, each bench call, the server's pool) would otherwise
    # copy the head's rows again.
    target, draft = pair["target"], pair["draft"]
    first, again = session(target, draft, monkeypatch), session(target, draft, monkeypatch)
    assert again.drafters("model")[0].head is first.drafters("model")[0].head
    assert (
        session(target, draft, monkeypatch, N + 1).drafters("model")[0].head
        is not first.drafters("model")[0].head
    )
