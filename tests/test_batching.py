"""Continuous batching (specmlx.batch, policy/batched.py, the server's worker): sequences
that share each round's target pass get what each gets alone.

Exactness per client: greedy replies decoded four at a time equal each request alone,
plain, with a draft model at a fixed γ, with prompt lookup and with auto γ; on this
backend a row of the shared pass has the bits of its own pass, so even a sampled reply
equals the same request (same seed) alone. The distribution check: S = 1,200 two-token
generations at T = 1, drawn four at a time in one batch with distinct seeds, against the
target's exact joint distribution (chi-square at 0.001, small cells merged, as in
test_lossless.py). Power: with 1,200 samples it rejects a sampler off by a total variation
of ~0.15 on the main cells with probability > 0.99; the control shows the same check,
on 400, rejects a batch that hands each row its neighbour's logits.

The batch policy is tested on injected costs, never on wall clocks.
"""

from __future__ import annotations

import asyncio
import time

import mlx.core as mx
import numpy as np
import pytest
import stats_util
from stats_util import ALPHA, chi_square_pvalue

import specmlx
from specmlx import batch as batching
from specmlx.caches import PREFILL_STEP, make_cache
from specmlx.engine import Session, generate
from specmlx.policy.batched import FAIRNESS, BatchCosts, Want, choose_gammas
from specmlx.policy.costs import Costs
from specmlx.server.pool import SessionPool
from specmlx.server.worker import Worker
from specmlx.tiny import build_tiny_model

PROMPTS = ["def fib(n):", "class Stack:\n    def push", "hello world, this is a", "import os\n"]
S = 1200
S_CONTROL = 400  # the control's deviation is far larger
PROMPT = [5, 17, 42, 99]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("batching")
    target = build_tiny_model(root / "target", seed=0)
    draft = build_tiny_model(root / "draft", seed=1, perturb_from=target, noise=0.05)
    # Read now, on this thread: MLX evaluates an array on the streams of the thread that
    # made it, and seats run on threads of their own (where mx.load leaves weights lazy).
    return specmlx.load(target, lazy=False), specmlx.load(draft, lazy=False)


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    """One-layer models with no EOS (the sampler is what is tested; depth costs time)."""
    root = tmp_path_factory.mktemp("batching-chi2")
    target = build_tiny_model(root / "target", seed=0, layers=1)
    draft = build_tiny_model(root / "draft", seed=1, layers=1, perturb_from=target, noise=0.1)
    models = specmlx.load(target, lazy=False), specmlx.load(draft, lazy=False)
    for m in models:
        m.tokenizer.eos_token_ids = set()
    return models


def together(target, draft, requests: list[dict], sessions=None) -> list:
    """Each request (generate's keyword arguments, a prompt among them) decoded as one seat
    of a batch; their Generations, run to the end."""
    out = [None] * len(requests)
    sessions = sessions or [Session(target, draft) for _ in requests]

    def seat_for(i: int, request: dict):
        def work(seat: batching.Seat) -> None:
            sessions[i].target.batch = seat
            try:
                gen = generate(target, draft=draft, session=sessions[i], **request)
                out[i] = gen
                gen.run()
            finally:
                sessions[i].target.batch = None

        return work

    batching.run_together(target, [seat_for(i, r) for i, r in enumerate(requests)])
    return out


def alone(target, draft, request: dict):
    return generate(target, draft=draft, session=Session(target, draft), **request).run()


SETTINGS = {
    "plain": dict(num_draft=0),
    "draft model, fixed gamma": dict(num_draft=3),
    "prompt lookup": dict(num_draft=2, draft_mode="lookup"),
    "auto": dict(num_draft="auto"),
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_greedy_replies_decoded_together_equal_each_alone(pair, setting):
    target, draft = pair
    requests = [dict(prompt=p, max_tokens=32, **SETTINGS[setting]) for p in PROMPTS]
    batched = together(target, draft, requests)
    assert [g.tokens for g in batched] == [alone(target, draft, r).tokens for r in requests]


def test_every_round_is_one_pass_over_every_sequence(pair):
    target, draft = pair
    requests = [dict(prompt=p, max_tokens=12, num_draft=2) for p in PROMPTS]
    seats = []
    real_pass = batching.Batch._pass

    def spying(self, waiting):
        seats.append(len(waiting))
        real_pass(self, waiting)

    batching.Batch._pass = spying
    try:
        together(target, draft, requests)
    finally:
        batching.Batch._pass = real_pass
    assert max(seats) == 4
    assert seats.count(4) >= 4  # the four decode side by side, not one after another


@pytest.mark.parametrize("sampling", ["rejection", "coupled"])
def test_a_sampled_reply_decoded_together_equals_the_same_seed_alone(pair, sampling):
    """A row's logits are its own pass's bits here (the native and float32 CPU paths), so
    the same seed draws the same text."""
    target, draft = pair
    requests = [
        dict(prompt=p, max_tokens=24, num_draft=3, temperature=1.0, seed=7 + i, sampling=sampling)
        for i, p in enumerate(PROMPTS)
    ]
    batched = together(target, draft, requests)
    assert [g.tokens for g in batched] == [alone(target, draft, r).tokens for r in requests]


def test_sequences_of_different_lengths_leave_and_the_rest_stay_exact(pair):
    target, draft = pair
    requests = [dict(prompt=p, max_tokens=4 + 10 * i, num_draft=2) for i, p in enumerate(PROMPTS)]
    batched = together(target, draft, requests)
    assert [g.tokens for g in batched] == [alone(target, draft, r).tokens for r in requests]


def test_a_newcomers_prompt_is_taken_a_chunk_a_round_while_the_others_decode(pair):
    target, draft = pair
    events: list[str] = []
    batch = batching.Batch(target)

    def decoder(seat):
        session = Session(target, draft)
        session.target.batch = seat
        for _ in generate(target, "def f(x):", session=session, max_tokens=30, num_draft=0):
            events.append("token")

    def newcomer(seat):
        session = Session(target, draft)
        session.target.batch = seat

        def chunk(done, total):
            events.append("chunk")
            seat.prefilled(done, total)

        long_prompt = [3 + i % 250 for i in range(3 * PREFILL_STEP)]  # three chunks
        gen = generate(target, long_prompt, session=session, max_tokens=2, on_prefill=chunk)
        gen.run()
        assert gen.stats.prefill_tokens == len(long_prompt) - 1

    batch.add(decoder)
    batch.add(newcomer)
    while batch.seats:
        batch.round()
    chunks = [i for i, e in enumerate(events) if e == "chunk"]
    assert len(chunks) > 2
    between = events[chunks[1] : chunks[-1]]
    assert "token" in between  # the decoder's stream went on between the newcomer's chunks


def test_a_seat_alone_runs_the_engines_own_passes(pair):
    target, draft = pair
    passes = []
    real = batching.Batch._pass
    batching.Batch._pass = lambda self, waiting: passes.append(len(waiting)) or real(self, waiting)
    try:
        (gen,) = together(target, draft, [dict(prompt="def g():", max_tokens=16, num_draft=2)])
    finally:
        batching.Batch._pass = real
    assert passes == []
    assert gen.tokens == alone(target, draft, dict(prompt="def g():", max_tokens=16)).tokens


def pairs_sampled_in_batches(target, draft, settings: dict, samples: int = S) -> np.ndarray:
    counts = np.zeros((target.vocab_size, target.vocab_size))
    sessions = [Session(target, draft) for _ in range(4)]
    for first_seed in range(0, samples, 4):
        requests = [
            dict(prompt=PROMPT, max_tokens=2, num_draft=2, seed=first_seed + i, **settings)
            for i in range(4)
        ]
        for gen in together(target, draft, requests, sessions):
            a, b = gen.tokens[:2]
            counts[a, b] += 1
    return counts


def test_four_sequences_decoded_together_follow_the_target_distribution(one_layer):
    target, draft = one_layer
    settings = dict(temperature=1.0, sampling="rejection")
    counts = pairs_sampled_in_batches(target, draft, settings)
    exact = stats_util.exact_joint(target, dict(temperature=1.0), PROMPT)
    assert chi_square_pvalue(counts, exact) > ALPHA


def test_the_check_rejects_a_batch_that_hands_rows_their_neighbours_logits(one_layer, monkeypatch):
    target, draft = one_layer
    real = batching.batched_pass

    def shifted(model, rows):
        logits = real(model, rows)
        return logits[1:] + logits[:1]  # row b gets row b + 1's

    monkeypatch.setattr(batching, "batched_pass", shifted)
    settings = dict(temperature=1.0, sampling="rejection")
    counts = pairs_sampled_in_batches(target, draft, settings, S_CONTROL)
    exact = stats_util.exact_joint(target, dict(temperature=1.0), PROMPT)
    assert chi_square_pvalue(counts, exact) < ALPHA


# -- the batch policy, on injected costs -------------------------------------------------


def line(t1: float, slope: float):
    """A pass over k tokens costing t1 · (1 + slope · (k - 1))."""
    return lambda rows_width: t1 * (1 + slope * (rows_width - 1))


def test_cheap_wide_passes_and_free_drafts_make_the_batch_draft():
    price = line(0.05, 0.02)
    wants = [Want(4, (0.9, 0.8, 0.7, 0.6), 0.0)] * 4  # prompt lookup: drafts cost nothing
    assert choose_gammas(wants, lambda w: price(4 * w)) == [4, 4, 4, 4]


def test_draft_passes_that_cost_more_than_they_bring_keep_the_batch_plain():
    price = line(0.05, 0.02)
    wants = [Want(3, (0.5, 0.25, 0.1), 0.03)] * 4  # a draft pass at 60% of T(1)
    assert choose_gammas(wants, lambda w: price(4 * w)) == [0, 0, 0, 0]


def test_only_the_sequences_whose_drafts_pay_draft():
    price = line(0.05, 0.01)
    sure, unsure = Want(3, (0.95, 0.9, 0.85), 0.0), Want(3, (0.1, 0.01, 0.001), 0.0)
    gammas = choose_gammas([sure, unsure, unsure, unsure], lambda w: price(4 * w))
    assert gammas[0] == 3
    assert choose_gammas([unsure] * 4, lambda w: price(4 * w)) == [0, 0, 0, 0]


def test_no_sequence_falls_below_its_fair_share_of_a_plain_round():
    """One sequence whose drafts all pass would widen everyone's pass eightfold; the others
    (nothing to draft) must keep FAIRNESS of an all-plain round's rate."""
    price = line(0.05, 0.25)  # passes that grow fast with their width
    eager, idle = Want(8, (0.99,) * 8, 0.0), Want(0, (), 0.0)
    gammas = choose_gammas([eager, idle, idle, idle], lambda w: price(4 * w))
    width = max(gammas) + 1
    assert price(4 * width) <= price(4) / FAIRNESS
    unbounded_best = choose_gammas([eager], lambda w: price(w))  # alone it would draft 8
    assert unbounded_best == [8] and gammas[0] < 8


def test_a_round_nobody_can_price_stays_plain():
    wants = [Want(4, (0.9,) * 4, 0.0)] * 2
    assert choose_gammas(wants, lambda w: None) == [0, 0]


def test_measured_batch_passes_replace_the_line_once_seen_a_few_times():
    costs = BatchCosts()
    want = Want(2, (0.9, 0.8), 0.0, t1=0.05, ratio=lambda k: 1 + 0.1 * (k - 1))
    price = costs.pricer(4, [want])
    assert price(3) == pytest.approx(0.05 * (1 + 0.1 * 11))  # 4 rows of 3: 12 tokens' line
    for seconds in (0.2, 0.21, 0.19):
        costs.observe(4, 3, seconds)
    assert costs.pricer(4, [want])(3) == pytest.approx(0.2)


def test_alone_the_policy_is_the_engines_own(pair):
    """A seat alone plans exactly as the engine's auto does: the same plan object."""
    target, draft = pair
    made = []

    class Recording:
        scheduler = None
        drafters, helpers = [], []

        def plan(self, remaining, context=0):
            made.append(object())
            return made[-1]

    batch = batching.Batch(target)
    seat = batch.add(lambda s: None)
    wrapped = seat.wrap(Recording())
    assert wrapped.plan(10) is made[-1]


def test_shared_rounds_never_teach_a_sequence_its_own_pass_costs(pair, monkeypatch):
    """A shared pass's time is the batch's (BatchCosts), no figure of one sequence's
    T(k): sequences that decoded only together taught no pass cost; one alone did."""
    target, draft = pair
    taught = []
    real = Costs.observe_target
    monkeypatch.setattr(Costs, "observe_target", lambda c, k, s: taught.append(k) or real(c, k, s))
    requests = [dict(prompt=p, max_tokens=24, num_draft="auto") for p in PROMPTS]
    together(target, draft, requests)
    assert taught == []
    together(target, draft, requests[:1])
    assert taught


# -- the server's worker --------------------------------------------------------------------


def test_the_server_decodes_concurrent_requests_together_each_as_alone(pair):
    target, draft = pair
    settings = dict(max_tokens=24, num_draft="auto", temperature=0.0)
    ids = [target.tokenizer.encode(p) for p in PROMPTS]
    expected = [alone(target, draft, dict(prompt=i, **settings)).tokens for i in ids]

    async def serve():
        worker = Worker(SessionPool(target, draft, 1 << 30))
        worker.start()
        try:
            jobs = [worker.submit(i, dict(settings), [], time.perf_counter()) for i in ids]
            return await asyncio.gather(*(job.result() for job in jobs))
        finally:
            await asyncio.to_thread(worker.stop)

    finished = asyncio.run(serve())
    assert [f.tokens for f in finished] == expected
    assert any(f.stats.batch.get("rounds_by_size", {}).get(4) for f in finished)


def test_a_batch_row_attends_exactly_as_its_own_pass(pair):
    """The pass itself: rows of 1 and 3 tokens, each on its own cache, give the logits
    of their own passes."""
    target, _ = pair
    prompts = [[3, 9, 27, 81], [5, 6, 7]]
    news = [mx.array([11], mx.uint32), mx.array([12, 13, 14], mx.uint32)]
    own, together_logits, _, _ = own_and_batched(target, prompts, news)
    for a, b in zip(own, together_logits, strict=True):
        assert np.array_equal(np.array(a), np.array(b))


def own_and_batched(target, prompts, news):
    """Each row's own pass after its prompt, and the batched pass over all rows (each row
    on a cache of its own holding its prompt): (own logits, batched logits, own caches,
    batched caches)."""
    own, rows, caches = [], [], []
    for p, x in zip(prompts, news, strict=True):
        cache = make_cache(target.module)
        target.module(mx.array([p]), cache=cache)
        own.append(target.module(x[None], cache=cache)[0])
        caches.append(cache)
        cache = make_cache(target.module)
        target.module(mx.array([p]), cache=cache)
        rows.append((cache, x))
    return own, batching.batched_pass(target, rows), caches, [c for c, _ in rows]
