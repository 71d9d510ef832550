"""The speculative engine: greedy exactness, cache rollback, stops, seeds, pair checks."""

import dataclasses
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import specmlx
from specmlx.caches import prefill
from specmlx.errors import SpecmlxError

PROMPT = "def fibonacci(n):"


@pytest.fixture
def no_eos(models, monkeypatch):
    """Random tiny models may say EOS early; long-output tests switch it off."""
    for m in models.values():
        monkeypatch.setattr(m.tokenizer, "eos_token_ids", set())
    return models


def tokens(target, draft=None, **kw):
    return specmlx.generate(target, PROMPT, draft=draft, **kw).run().tokens


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("gamma", [1, 2, 4, 7])
def test_greedy_speculative_equals_greedy_target(no_eos, arch, gamma):
    target, draft = (
        (no_eos["target"], no_eos["perturbed"])
        if arch == "qwen2"
        else (no_eos["llama"], no_eos["llama_draft"])
    )
    baseline = tokens(target, max_tokens=120)
    assert len(baseline) == 120
    assert tokens(target, draft, num_draft=gamma, max_tokens=120) == baseline


@pytest.mark.parametrize("arch", ["target", "llama"])
def test_greedy_baseline_equals_mlx_lm_generate_step(no_eos, arch):
    model = no_eos[arch]
    ids = model.tokenizer.encode(PROMPT)
    reference = [t for t, _ in generate_step(mx.array(ids), model.module, max_tokens=100)]
    assert tokens(model, max_tokens=100) == reference


def test_greedy_with_an_unrelated_draft_is_still_exact(no_eos):
    baseline = tokens(no_eos["target"], max_tokens=100)
    assert tokens(no_eos["target"], no_eos["unrelated"], num_draft=4, max_tokens=100) == baseline


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_draft_equal_to_target_accepts_everything(no_eos, temperature):
    target = no_eos["target"]
    gen = specmlx.generate(
        target,
        PROMPT,
        draft=target,
        num_draft=4,
        max_tokens=60,
        temperature=temperature,
        draft_mode="model",  # the draft model's drafts alone: lookup's may miss
    ).run()
    assert gen.stats.acceptance >= 0.99  # 1.0 up to float error between 1- and 5-token passes
    assert gen.stats.tokens_per_pass > 4.5


class CountingModule:
    """A model module that records the width of every forward pass."""

    def __init__(self, module):
        self.module = module
        self.widths: list[int] = []

    def __call__(self, x, cache=None):
        self.widths.append(x.shape[1])
        return self.module(x, cache=cache)

    def __getattr__(self, name):
        return getattr(self.module, name)


def test_a_fully_accepted_drafts_last_token_rides_with_the_next_first_pass(no_eos):
    # The draft never fed its own last draft through itself: when the target accepts it,
    # the next round feeds it together with the bonus token, in one pass of width 2.
    target = no_eos["target"]
    counting = CountingModule(target.module)
    draft = dataclasses.replace(target, module=counting)
    gen = specmlx.generate(
        target, PROMPT, draft=draft, num_draft=4, max_tokens=25, draft_mode="model"
    ).run()
    assert gen.stats.acceptance == 1.0
    rounds = gen.stats.target_passes
    decode = counting.widths[-4 * rounds :]  # before them: the prompt's prefill
    assert len(counting.widths) == 4 * rounds + 1
    assert decode == [1, 1, 1, 1] + [2, 1, 1, 1] * (rounds - 1)


def test_caches_after_rejections_equal_a_fresh_prefill(no_eos):
    target, draft = no_eos["target"], no_eos["unrelated"]
    session = specmlx.Session(target, draft)
    gen = specmlx.generate(target, PROMPT, draft=draft, num_draft=4, max_tokens=40, session=session)
    gen.run()
    assert gen.stats.accepted < gen.stats.drafted  # rounds with rejections happened
    for model, cache, held in [
        (target, session.target.cache, session.target.cached),
        (draft, session.made["model"].cache, session.made["model"].cached),
    ]:
        fresh = make_prompt_cache(model.module)
        prefill(model, fresh, held)
        for c, f in zip(cache, fresh, strict=True):
            assert c.offset == f.offset == len(held)
            for a, b in zip(c.state, f.state, strict=True):
                np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-5)


def test_continuing_after_rollback_gives_the_logits_of_a_fresh_run(no_eos):
    target, draft = no_eos["target"], no_eos["unrelated"]
    session = specmlx.Session(target, draft)
    specmlx.generate(target, PROMPT, draft=draft, max_tokens=30, session=session).run()
    cached = session.target.cached
    probe = mx.array([[cached[-1]]], mx.uint32)
    continued = target.module(probe, cache=session.target.cache)[0, -1]
    # the probe repeats the last cached token: compare with a fresh run over the same ids
    ids = cached + [cached[-1]]
    fresh = target.module(mx.array([ids], mx.uint32))[0, -1]
    np.testing.assert_allclose(np.array(continued), np.array(fresh), rtol=1e-4, atol=1e-4)


def test_eos_inside_an_accepted_block_ends_generation_there(models, monkeypatch):
    target = models["target"]
    monkeypatch.setattr(target.tokenizer, "eos_token_ids", set())
    baseline = tokens(target, max_tokens=30)
    stop = baseline[6]
    first = baseline.index(stop)
    monkeypatch.setattr(target.tokenizer, "eos_token_ids", {stop})
    gen = specmlx.generate(target, PROMPT, draft=target, num_draft=4, max_tokens=30).run()
    assert gen.tokens == baseline[:first]
    assert gen.stats.finish_reason == "eos"


@pytest.mark.parametrize("max_tokens", [1, 3, 7, 11])
def test_max_tokens_is_exact_even_mid_block(no_eos, max_tokens):
    target = no_eos["target"]
    baseline = tokens(target, max_tokens=20)
    gen = specmlx.generate(target, PROMPT, draft=target, num_draft=4, max_tokens=max_tokens).run()
    assert gen.tokens == baseline[:max_tokens]
    assert gen.stats.finish_reason == "length"


def test_same_seed_same_sample_other_seed_other_sample(no_eos):
    # With a fixed γ; auto γ follows measured timings, so only its distribution repeats.
    target, draft = no_eos["target"], no_eos["perturbed"]
    kw = dict(draft=draft, num_draft=3, max_tokens=40, temperature=1.0)
    assert tokens(target, seed=5, **kw) == tokens(target, seed=5, **kw)
    assert tokens(target, seed=5, **kw) != tokens(target, seed=6, **kw)


def test_text_is_the_decoded_tokens(no_eos):
    target = no_eos["target"]
    gen = specmlx.generate(target, PROMPT, draft=no_eos["perturbed"], max_tokens=50).run()
    assert gen.text == target.tokenizer.decode(gen.tokens)


def test_stats_add_up(no_eos):
    gen = specmlx.generate(
        no_eos["target"], PROMPT, draft=no_eos["perturbed"], num_draft=3, max_tokens=50
    ).run()
    s = gen.stats
    assert s.tokens == 50 == len(gen.tokens)
    assert s.accepted == sum(s.accepted_by_position)
    assert s.tokens == s.accepted + s.target_passes  # each pass adds one token of its own
    assert s.tokens_per_pass == pytest.approx(50 / s.target_passes)
    assert s.prompt_tokens == s.prefill_tokens + 1  # the last prompt token opens round one


def test_a_session_prefills_only_the_new_tokens(no_eos):
    target, draft = no_eos["target"], no_eos["perturbed"]
    session = specmlx.Session(target, draft)
    ids = target.tokenizer.encode(PROMPT)
    first = specmlx.generate(target, ids, draft=draft, max_tokens=10, session=session).run()
    turn2 = ids + first.tokens + target.tokenizer.encode(" and then")
    second = specmlx.generate(target, turn2, draft=draft, max_tokens=10, session=session).run()
    assert second.stats.prefill_tokens <= len(turn2) - len(ids) - len(first.tokens) + 1
    assert second.tokens == specmlx.generate(target, turn2, max_tokens=10).run().tokens


def test_a_draft_with_another_embedding_padding_is_compared_on_the_shared_vocab(
    model_dirs, tmp_path
):
    padded = specmlx.tiny.build_tiny_model(tmp_path / "padded", seed=9, pad_vocab_to=128)
    target, draft = specmlx.load(model_dirs["target"]), specmlx.load(padded)
    assert target.config["vocab_size"] != draft.config["vocab_size"]
    target.tokenizer.eos_token_ids = set()
    baseline = tokens(target, max_tokens=40)
    assert tokens(target, draft, max_tokens=40) == baseline


def test_a_draft_with_another_tokenizer_is_refused(model_dirs, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(model_dirs["target"], other)
    tok = specmlx.tiny.train_tokenizer(vocab_size=280)
    tok.save(str(other / "tokenizer.json"))
    with pytest.raises(SpecmlxError, match="different tokenizer"):
        specmlx.generate(
            specmlx.load(model_dirs["target"]), PROMPT, draft=specmlx.load(other), max_tokens=2
        )


def test_models_loaded_apart_from_one_tokenizer_file_are_paired_without_reading_vocabularies(
    model_dirs, monkeypatch
):
    # Comparing two 152k-token vocabularies took ~0.5 s at every Session made.
    target, draft = specmlx.load(model_dirs["target"]), specmlx.load(model_dirs["perturbed"])
    assert target.tokenizer is not draft.tokenizer
    inner = type(target.tokenizer._tokenizer)  # what mlx-lm's wrapper hands get_vocab to
    monkeypatch.setattr(inner, "get_vocab", lambda self: pytest.fail("a vocabulary was read"))
    specmlx.Session(target, draft)


def test_prompt_as_token_ids_equals_prompt_as_text(no_eos):
    target = no_eos["target"]
    ids = target.tokenizer.encode(PROMPT)
    assert specmlx.generate(target, ids, max_tokens=20).run().tokens == tokens(
        target, max_tokens=20
    )


@pytest.mark.parametrize(
    "kwargs",
    [dict(num_draft=-1), dict(temperature=-1.0), dict(top_p=0.0), dict(max_tokens=0)],
)
def test_bad_arguments_raise_a_user_error(models, kwargs):
    with pytest.raises(SpecmlxError):
        specmlx.generate(models["target"], PROMPT, draft=models["perturbed"], **kwargs)


@pytest.mark.parametrize("mode", ["lookup", "auto"])
@pytest.mark.parametrize("gamma", [3, "auto"])
def test_greedy_with_prompt_lookup_equals_greedy_target(no_eos, mode, gamma):
    target = no_eos["target"]
    prompt = "for i in range(10): print(i)\n" * 3 + "for i in"
    baseline = specmlx.generate(target, prompt, max_tokens=60).run().tokens
    gen = specmlx.generate(
        target, prompt, draft=no_eos["perturbed"], draft_mode=mode, num_draft=gamma, max_tokens=60
    ).run()
    assert gen.tokens == baseline


def test_greedy_with_auto_gamma_equals_greedy_target(no_eos):
    baseline = tokens(no_eos["target"], max_tokens=80)
    gen = specmlx.generate(no_eos["target"], PROMPT, draft=no_eos["perturbed"], max_tokens=80)
    assert gen.run().tokens == baseline
    assert sum(gen.stats.rounds_by_gamma.values()) == gen.stats.target_passes


def told(emitted: list[int], accepted: int = 0):
    """The Verdict of a round that emitted `emitted`, its first `accepted` drafts."""
    from specmlx.drafters.protocol import Verdict

    return Verdict(accepted, emitted[-1], drafts=emitted[:-1])


def test_lookup_proposes_what_followed_the_last_match():
    from specmlx.drafters.lookup import LookupDrafter

    drafter = LookupDrafter()
    drafter.start([1, 2, 3, 4, 5, 9, 2, 3])
    assert drafter.find(2) == [4, 5]  # the 2-gram [2, 3] was followed by 4, 5
    drafter.commit(None, told([4]))  # the text moved on: [3, 4] was followed by 5
    assert drafter.find(4) == [5, 9, 2, 3]
    drafter.start([1, 2, 3])
    assert drafter.find(4) == []
    drafter.start([7, 1, 2, 8, 2])  # only "2" recurs: one token is no match
    assert drafter.find(2) == []
    drafter.start([7, 8, 9, 7, 8])  # as long as the last text: nothing of it is kept
    assert drafter.find(2) == [9, 7]


def scanned(history: list[int], g: int, longest: int = 3, shortest: int = 2) -> list[int]:
    """What followed the most recent earlier match of the longest suffix, by scanning."""
    for n in range(min(longest, len(history) - 1), shortest - 1, -1):
        tail = history[-n:]
        for s in range(len(history) - n - 1, -1, -1):
            if history[s : s + n] == tail:
                return history[s + n : s + n + g]
    return []


def test_lookups_index_finds_what_a_scan_of_the_whole_text_finds():
    # The n-gram index is kept as the text grows; a scan reads the text afresh.
    import random

    from specmlx.drafters.lookup import LookupDrafter

    rng = random.Random(0)
    for _ in range(200):
        drafter = LookupDrafter()
        text = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        drafter.start(text)
        for _ in range(5):
            g = rng.randrange(1, 6)
            assert drafter.find(g) == scanned(text, g)
            emitted = [rng.randrange(4) for _ in range(rng.randrange(1, 4))]
            drafter.commit(None, told(emitted))
            text += emitted


def test_a_sessions_first_draft_proposal_is_not_taken_as_the_drafts_cost(no_eos):
    # In a fresh process it pays the draft model's one-time work (4x a pass on this CPU):
    # taken as the draft's cost, auto priced drafting out and never drafted again.
    from specmlx.policy import AutoGamma, Plan, RoundSummary

    session = specmlx.Session(no_eos["target"], no_eos["perturbed"])
    drafters = session.drafters("model")
    drafter = drafters[0]
    policy = AutoGamma(drafters, session.schedulers(drafters), False)
    policy.scheduler = session.schedulers(drafters)["model"]
    drafter.start([1, 2, 3, 4])
    greedy = lambda logits, key: (None, logits.argmax(-1))  # noqa: E731
    for expected in (None, 3):
        proposal = drafter.propose(3, mx.random.split(mx.random.key(0), 3), greedy)
        assert proposal.fed == 0  # no backlog: a clean figure but for being the first
        summary = RoundSummary(
            Plan(drafter, 3), "model", 3, 3, 1, 0.0, 0.0, fed=proposal.fed, first=proposal.first
        )
        assert policy._passes(summary, 3) == expected
        drafts = proposal.tokens.tolist()
        drafter.commit(proposal, told(drafts[:2], accepted=1))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_auto_calibrates_on_the_targets_confidence_at_each_judged_draft(
    no_eos, monkeypatch, tmp_path, temperature
):
    # The γ policy learns how the target's top probability forecasts acceptance from the
    # verify pass itself: one top per draft the target ruled on, each the top of the
    # distribution it judged with (processed at T > 0; the plain softmax greedy).
    from specmlx.policy.choice import Scheduler

    monkeypatch.setenv("SPECMLX_HOME", str(tmp_path))  # no costs yet: the first rounds draft
    seen = []
    calibrate = Scheduler.calibrate
    monkeypatch.setattr(
        Scheduler,
        "calibrate",
        lambda s, tops, n, whose="": (
            (whose or seen.append((tops, n))) or calibrate(s, tops, n, whose)
        ),
    )
    gen = specmlx.generate(
        no_eos["target"], PROMPT, no_eos["perturbed"], max_tokens=24, temperature=temperature
    )
    gen.run()
    assert gen.stats.rounds_by_source.get("model", 0) == len(seen) > 0
    for tops, n in seen:
        assert 1 <= len(tops) <= 8 and n <= len(tops)
        assert all(0 < top <= 1 for top in tops)


def test_timing_a_draft_pass_leaves_its_cache_as_it_was(no_eos):
    session = specmlx.Session(no_eos["target"], no_eos["perturbed"])
    drafter = session.drafters("model")[0]
    drafter.start([1, 2, 3, 4, 5])
    drafter._feed(4)
    offset = drafter.cache[0].offset
    drafter.time_pass()
    assert drafter.cache[0].offset == offset
    fresh = specmlx.Session(no_eos["target"], no_eos["perturbed"]).drafters("model")[0]
    fresh.start([1, 2, 3, 4, 5])
    fresh._feed(4)
    x = mx.array([[5]], mx.uint32)
    after = drafter.model.module(x, cache=drafter.cache)
    assert mx.allclose(after, fresh.model.module(x, cache=fresh.cache), atol=1e-5)


def test_the_drafts_backlog_counts_the_prompt_until_it_has_taken_it(no_eos):
    # The policy prices what the draft must take before it drafts: a call's prompt too,
    # which a draft that never drafts never pays for.
    drafter = specmlx.Session(no_eos["target"], no_eos["perturbed"]).drafters("model")[0]
    drafter.start([1, 2, 3, 4, 5])
    assert drafter.behind == 4
    greedy = lambda logits, key: (None, logits.argmax(-1))  # noqa: E731
    proposal = drafter.propose(2, mx.random.split(mx.random.key(0), 2), greedy)
    drafter.commit(proposal, told([7]))  # its first draft rejected: the target's token
    assert drafter.behind == 0
    drafter.commit(None, told([8]))  # two plain rounds it sat out
    drafter.commit(None, told([9]))
    assert drafter.behind == 2


def test_a_plain_rounds_confidence_is_read_after_the_next_pass_is_set_running(no_eos, monkeypatch):
    # The read is a numpy pass over the vocabulary: done between a plain round's token and
    # the next pass's start, it held that pass back every plain round.
    from specmlx.policy.choice import Choice, Scheduler

    log = []
    sync, launch = mx.eval, mx.async_eval
    monkeypatch.setattr(mx, "eval", lambda *a: log.append("sync") or sync(*a))
    monkeypatch.setattr(mx, "async_eval", lambda *a: log.append("launch") or launch(*a))
    monkeypatch.setattr(Scheduler, "choose", lambda *a, **k: Choice(0))
    monkeypatch.setattr(Scheduler, "observe_confidence", lambda s, top: log.append("read"))
    gen = specmlx.generate(
        no_eos["target"], PROMPT, no_eos["perturbed"], max_tokens=12, draft_mode="model"
    )
    gen.run()
    reads = [i for i, event in enumerate(log) if event == "read"]
    assert len(reads) == gen.stats.tokens - 1  # not the reply's first round
    for i in reads[:-1]:  # the last round sets no pass running
        assert next(e for e in reversed(log[:i]) if e != "read") == "launch"


def hopeless_draft(no_eos, monkeypatch, tmp_path):
    """A Session whose costs say T(1) is settled, verifying is nearly flat, and a draft
    pass costs fifty target steps: drafting is hopeless. Returns (session, its costs)."""
    monkeypatch.setenv("SPECMLX_HOME", str(tmp_path))
    session = specmlx.Session(no_eos["target"], no_eos["perturbed"])
    costs = session.schedulers(session.drafters("model"))["model"].costs
    costs.plain = [0.01] * 8
    for k in range(2, 10):
        costs.target[k] = [1.0 + 0.1 * (k - 1)] * 3
    costs.draft = [50.0] * 3
    return session, costs


def test_a_cost_probe_retimes_the_draft_so_one_bad_figure_cannot_keep_it_out(
    no_eos, monkeypatch, tmp_path
):
    # Seen: draft figures timed in a burst of load priced drafting out, and the cost
    # probes that followed never ran the draft, so nothing could correct them.
    session, costs = hopeless_draft(no_eos, monkeypatch, tmp_path)
    gen = specmlx.generate(
        no_eos["target"],
        PROMPT,
        no_eos["perturbed"],
        max_tokens=40,
        session=session,
        draft_mode="model",
    )
    gen.run()
    assert gen.stats.rounds_by_source.get("probe", 0) >= 1
    assert len(costs.draft) > 3 and costs.draft[-1] < 50.0


def test_auto_ends_a_round_where_the_draft_turns_unsure_and_stays_exact(
    no_eos, monkeypatch, tmp_path
):
    # The stop reads the draft's side only: greedy output is still the target's own.
    from specmlx.policy.choice import Scheduler

    monkeypatch.setenv("SPECMLX_HOME", str(tmp_path))  # no costs yet: the first rounds draft
    monkeypatch.setattr(Scheduler, "keep_drafting", lambda s, draft_tops: False)
    target, draft = no_eos["target"], no_eos["perturbed"]
    gen = specmlx.generate(target, PROMPT, draft, max_tokens=24, draft_mode="model")
    gen.run()
    rounds = gen.stats.rounds_by_source.get("model", 0)
    assert rounds > 0 and gen.stats.drafted == rounds  # one draft each, whatever γ was chosen
    assert 0 < gen.stats.cut_short <= rounds  # the first rounds ask for 3: shown as cut
    assert gen.tokens == tokens(target, max_tokens=24)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_auto_shows_the_stop_rule_and_the_calibration_the_drafts_own_confidence(
    no_eos, monkeypatch, tmp_path, temperature
):
    # After each draft the stop rule sees the draft's top probability at every draft so
    # far; the calibration then learns from those the target judged.
    from specmlx.policy.choice import Scheduler

    monkeypatch.setenv("SPECMLX_HOME", str(tmp_path))
    asked, recorded = [], []
    record = Scheduler.record

    def spy(s, g, n, verify_s, draft_s, passes, tops=None, draft_tops=None, rewind_s=0.0):
        if g > 0 and draft_s is not None:  # a model round (not a cost probe)
            recorded.append((g, n, draft_tops))
        return record(s, g, n, verify_s, draft_s, passes, tops, draft_tops, rewind_s)

    monkeypatch.setattr(
        Scheduler, "keep_drafting", lambda s, tops: asked.append(list(tops)) or True
    )
    monkeypatch.setattr(Scheduler, "record", spy)
    gen = specmlx.generate(
        no_eos["target"],
        PROMPT,
        no_eos["perturbed"],
        max_tokens=24,
        temperature=temperature,
        draft_mode="model",
    )
    gen.run()
    assert asked and all(0 < top <= 1 for tops in asked for top in tops)
    assert [len(tops) for tops in asked[:3]] == [1, 2, 3]  # one more each pass of a round
    assert recorded and all(len(tops) == min(n + 1, g) for g, n, tops in recorded)


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5])
def test_a_seed_out_of_range_is_refused_by_the_api_too(no_eos, seed):
    with pytest.raises(specmlx.SpecmlxError, match="seed must be an integer >= 0"):
        specmlx.generate(no_eos["target"], PROMPT, seed=seed)


def test_plain_decoding_to_an_eos_makes_one_token_per_pass(no_eos, monkeypatch):
    # The pass that samples the EOS produced a token too, though it is never emitted.
    target = no_eos["target"]
    first = specmlx.generate(target, PROMPT, max_tokens=16, num_draft=0).run().tokens
    stop = next(i for i, t in enumerate(first) if i > 0 and t not in first[:i])
    monkeypatch.setattr(target.tokenizer, "eos_token_ids", {first[stop]})
    gen = specmlx.generate(target, PROMPT, max_tokens=16, num_draft=0).run()
    assert gen.tokens == first[:stop] and gen.stats.finish_reason == "eos"
    assert gen.stats.target_passes == stop + 1 and gen.stats.tokens_per_pass == 1.0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_target_alone_pipelined_gives_the_round_loops_tokens(no_eos, monkeypatch, temperature):
    # Plain rounds queue each next pass before reading their token (as mlx-lm does); with
    # the same seed they must emit what unpipelined rounds emit, and leave the Session's
    # cache as a continuation expects.
    from specmlx.target import Target

    target = no_eos["target"]
    run = dict(max_tokens=30, num_draft=0, temperature=temperature, seed=3)
    pipelined = specmlx.generate(target, PROMPT, **run).run().tokens
    monkeypatch.setattr(Target, "pipelines", property(lambda self: False))  # the round loop
    assert specmlx.generate(target, PROMPT, **run).run().tokens == pipelined
    monkeypatch.undo()
    session = specmlx.Session(target)
    first = specmlx.generate(target, PROMPT, session=session, **run).run().tokens
    ids = target.tokenizer.encode(PROMPT) + first
    again = specmlx.generate(target, ids, session=session, max_tokens=10, num_draft=0).run()
    assert again.stats.prefill_tokens == 0
    assert again.tokens == specmlx.generate(target, ids, max_tokens=10, num_draft=0).run().tokens


def test_stats_carry_the_measured_draft_cost_auto_kept_plain_for(no_eos, monkeypatch, tmp_path):
    # What the CLI says of an idle draft comes from Stats, not from the policy's insides.
    session, _ = hopeless_draft(no_eos, monkeypatch, tmp_path)
    gen = specmlx.generate(
        no_eos["target"],
        PROMPT,
        no_eos["perturbed"],
        max_tokens=10,
        session=session,
        draft_mode="model",
    ).run()
    assert gen.stats.drafted == 0 and gen.stats.draft_ratio == 50.0
