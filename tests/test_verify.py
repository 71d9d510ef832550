"""The rejection sampler alone is lossless: emitted tokens follow p exactly.

Each case draws N = 200,000 rounds (vectorised with mx.vmap) and compares the first
emitted token with p_1 by a chi-square test at significance 0.001 (cells with
expected count < 5 merged). With N = 200,000 over 8 cells the test detects a total
variation distance of ~0.01 with power > 0.99, so a wrong sampler cannot pass.
"""

import mlx.core as mx
import numpy as np
import pytest
from stats_util import ALPHA, chi_square_pvalue

from specmlx.sampling import SamplingParams, probabilities
from specmlx.verify import accept_greedy, accept_reject, top_probability

V, N = 8, 200_000


def run_rounds(p, q, n=N, seed=0, sampler=accept_reject):
    """N independent rounds: d ~ q_1, then accept/reject. Returns (first token, n accepted)."""
    g = q.shape[0]
    keys = mx.random.split(mx.random.key(seed), n)
    drafts = mx.stack(
        [
            mx.random.categorical(mx.log(q[i]), shape=(n,), key=mx.random.key(seed + 1 + i))
            for i in range(g)
        ],
        axis=1,
    ).astype(mx.uint32)
    accepted, token = mx.vmap(lambda d, k: sampler(p, q, d, k))(drafts, keys)
    first = mx.where(accepted > 0, drafts[:, 0], token)
    return np.array(first), np.array(accepted)


def dist(values):
    x = np.array(values, dtype=np.float64)
    return mx.array(x / x.sum(), dtype=mx.float32)


RNG = np.random.default_rng(7)
P_RANDOM = dist(RNG.random(V) ** 2)
CASES = {
    "random p and q": (P_RANDOM, dist(RNG.random(V))),
    "q one-hot": (P_RANDOM, dist([0, 0, 1, 0, 0, 0, 0, 0])),
    "disjoint supports": (dist([1, 2, 3, 4, 0, 0, 0, 0]), dist([0, 0, 0, 0, 1, 1, 1, 1])),
    "p equals q": (P_RANDOM, P_RANDOM),
    "q zero where p is not": (P_RANDOM, dist([1, 1, 1, 1, 0, 0, 0, 0])),
}


@pytest.mark.parametrize("case", CASES)
def test_first_emitted_token_follows_p(case):
    p1, q1 = CASES[case]
    p = mx.stack([p1, dist(np.ones(V))])
    first, _ = run_rounds(p, q1[None])
    assert chi_square_pvalue(np.bincount(first, minlength=V), np.array(p1)) > ALPHA


def test_bonus_token_follows_the_last_target_distribution():
    p2 = dist(np.arange(1, V + 1))
    p = mx.stack([P_RANDOM, p2])
    keys = mx.random.split(mx.random.key(3), N)
    drafts = mx.random.categorical(mx.log(P_RANDOM), shape=(N, 1), key=mx.random.key(4))
    accepted, token = mx.vmap(lambda d, k: accept_reject(p, P_RANDOM[None], d, k))(
        drafts.astype(mx.uint32), keys
    )
    assert np.array(accepted).min() == 1  # p == q: every draft is accepted
    assert chi_square_pvalue(np.bincount(np.array(token), minlength=V), np.array(p2)) > ALPHA


def test_acceptance_rate_is_the_overlap_of_p_and_q():
    p1, q1 = CASES["random p and q"]
    _, accepted = run_rounds(mx.stack([p1, p1]), q1[None])
    overlap = float(mx.sum(mx.minimum(p1, q1)))
    assert accepted.mean() == pytest.approx(overlap, abs=4 * np.sqrt(0.25 / N))


def test_later_positions_only_count_after_earlier_acceptances():
    # q_1 and p_1 disjoint: nothing is ever accepted, whatever happens at position 2.
    p = mx.stack([dist([1, 1, 0, 0, 0, 0, 0, 0]), P_RANDOM, P_RANDOM])
    q = mx.stack([dist([0, 0, 1, 1, 0, 0, 0, 0]), P_RANDOM])
    first, accepted = run_rounds(p, q, n=10_000)
    assert accepted.max() == 0 and set(np.unique(first)) <= {0, 1}


def test_the_chi_square_check_catches_a_wrong_sampler():
    """Control: a sampler that accepts every draft emits q, and the test must say so."""

    def always_accept(p, q, d, key):
        return mx.array(d.shape[0]), mx.array(0, mx.uint32)

    p1, q1 = CASES["random p and q"]
    first, _ = run_rounds(mx.stack([p1, p1]), q1[None], sampler=always_accept)
    assert chi_square_pvalue(np.bincount(first, minlength=V), np.array(p1)) < ALPHA


def test_greedy_limit_accepts_exactly_when_argmaxes_agree():
    one_hot = mx.eye(V)
    p = mx.stack([one_hot[3], one_hot[5], one_hot[1]])
    agree, _ = accept_reject(
        p, mx.stack([one_hot[3], one_hot[2]]), mx.array([3, 2]), mx.random.key(0)
    )
    n, token = accept_reject(
        p, mx.stack([one_hot[4], one_hot[5]]), mx.array([4, 5]), mx.random.key(0)
    )
    assert agree.item() == 1
    assert (n.item(), token.item()) == (0, 3)


@pytest.mark.parametrize("g", [1, 3, 6])
def test_greedy_shortcut_equals_rejection_sampling_on_one_hot_distributions(g):
    # 300 rounds of random logits (with planted ties) and drafts that often agree.
    rng = np.random.default_rng(g)
    greedy = SamplingParams(0.0)
    for i in range(300):
        logits = mx.array(rng.integers(0, 4, size=(g + 1, V)).astype(np.float32))
        best = np.array(mx.argmax(logits, axis=-1))
        agree = rng.random(g) < 0.7
        drafts = mx.array(np.where(agree, best[:g], rng.integers(0, V, g)), mx.uint32)
        p = probabilities(logits, greedy)
        q = (mx.arange(V)[None] == drafts[:, None]).astype(mx.float32)
        n, token = accept_reject(p, q, drafts, mx.random.key(i))
        n_fast, token_fast = accept_greedy(logits, drafts)
        assert (n_fast.item(), token_fast.item()) == (n.item(), token.item())


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_top_probability_at_temperature_0_is_the_softmax_top_over_the_shared_vocabulary(dtype):
    # The last two logits are embedding padding beyond the tokenizer: never counted.
    logits = mx.array([[2.0, 1.0, 0.5, -1.0, 9.0, 9.0]], dtype)
    top = np.exp(2.0) / np.exp([2.0, 1.0, 0.5, -1.0]).sum()
    assert top_probability(logits, None, vocab_size=4) == pytest.approx(top, rel=1e-2)


def test_top_probability_when_sampling_is_the_top_of_the_distribution_sampled_from():
    params = SamplingParams(temperature=0.7, top_k=2)
    logits = mx.array([[2.0, 1.0, 0.5, -1.0]])
    probs = probabilities(logits, params)
    assert top_probability(logits, probs, vocab_size=4) == pytest.approx(mx.max(probs).item())
