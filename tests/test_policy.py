"""The γ policy: speculate only where measured costs and acceptance say it pays."""

import json
from itertools import product
from types import SimpleNamespace

import pytest

import specmlx
from specmlx import tree
from specmlx.cpu import native
from specmlx.drafters.protocol import cost_id
from specmlx.policy import FixedGamma
from specmlx.policy.acceptance import CONFIDENCE_WEIGHT, PRIOR_ALPHA, Acceptance
from specmlx.policy.choice import (
    COST_PROBE,
    DRAFT,
    EXPLORE,
    FIRST_BACKOFF,
    FIRST_PROBE,
    MARGIN,
    Scheduler,
)
from specmlx.policy.costs import (
    DRAFT_FIGURES,
    OWN_FIGURES,
    SETTLE,
    Costs,
    borrowed,
    load_costs,
    save_costs,
)
from specmlx.policy.trees import grow_shape, rank_chance

T1 = 0.3  # seconds per plain step; only ratios to it matter


def measured(curve, draft_ratio, max_k=9, t1=T1):
    """Costs after settling T(1) and three passes at every k of T(k)/T(1) = curve(k)."""
    costs = Costs()
    for _ in range(SETTLE + 1):
        costs.observe_target(1, t1)
    for k in range(2, max_k + 1):
        for _ in range(3):
            costs.observe_target(k, t1 * curve(k))
    for _ in range(DRAFT_FIGURES):
        costs.observe_draft(t1 * draft_ratio)
    return costs


def warmed(curve, draft_ratio, alpha, max_gamma=8, weight=40.0, free=False):
    """A scheduler, well into a call, that has seen acceptance alpha."""
    s = Scheduler(measured(curve, draft_ratio, max_gamma + 1), max_gamma, free)
    s.acceptance = Acceptance(alpha * weight, weight, seen=True)
    return s


# What this CPU measured for Qwen2.5-Coder 1.5B/0.5B INT4 on the native kernel.
THIS_CPU = dict(curve=lambda k: 1 + 0.29 * (k - 1), draft_ratio=0.45)


def test_compute_bound_verify_means_no_speculation():
    # MLX's INT4 CPU kernels: k new tokens cost k times one token.
    assert warmed(lambda k: k, draft_ratio=0.3, alpha=0.95).choose().gamma == 0


def test_flat_verify_with_good_drafts_means_speculation():
    # Memory-bound (GPU, or fp32 with a fast BLAS): verifying 9 tokens costs ~one.
    assert warmed(lambda k: 1 + 0.02 * (k - 1), draft_ratio=0.1, alpha=0.8).choose().gamma >= 3


def test_flat_verify_with_bad_drafts_means_no_speculation():
    assert warmed(lambda k: 1.0, draft_ratio=0.3, alpha=0.05).choose().gamma == 0


def test_better_acceptance_never_shortens_gamma():
    chosen = [
        warmed(lambda k: 1 + 0.1 * (k - 1), 0.1, alpha).choose().gamma
        for alpha in (0.3, 0.5, 0.7, 0.9, 0.97)
    ]
    assert chosen == sorted(chosen) and chosen[-1] > chosen[0]


def test_free_drafts_are_worth_trying_even_when_the_draft_model_is_not():
    model = warmed(lambda k: 1 + 0.05 * (k - 1), draft_ratio=1.7, alpha=0.6)
    lookup = warmed(lambda k: 1 + 0.05 * (k - 1), draft_ratio=1.7, alpha=0.6, free=True)
    assert model.choose().gamma == 0 and lookup.choose().gamma > 0


def test_cold_start_measures_plain_then_probes():
    s = Scheduler(Costs())
    for _ in range(SETTLE + 1):  # T(1), from more than the process's first step
        assert s.choose().gamma == 0
        s.record(0, 0, verify_s=T1, draft_s=None, passes=0)
    for _ in range(DRAFT_FIGURES):  # then T(g+1), the draft's cost, this text's α
        g = s.choose().gamma
        assert g == FIRST_PROBE
        s.record(g, 1, verify_s=T1 * (g + 1), draft_s=0.1 * g, passes=g)
    assert s.choose().gamma == 0  # linear verify: it stops speculating


def test_one_draft_pass_timed_in_a_burst_of_load_does_not_price_drafting_out():
    # Seen: the draft's one clean figure, timed while the machine was slow, read 0.93 of
    # T(1) (0.48 after); auto judged drafting hopeless and never timed the draft again.
    s = Scheduler(measured(THIS_CPU["curve"], draft_ratio=0.45))
    s.costs.draft.clear()
    s.costs.observe_draft(T1 * 0.93)
    s.start_call()
    s.choose()  # the opening round
    g = s.choose().gamma
    assert g > 0  # it times the draft again rather than settle on one figure
    s.record(g, 2, verify_s=T1 * 1.6, draft_s=0.45 * T1 * g, passes=g)
    s.record(g, 2, verify_s=T1 * 1.6, draft_s=0.45 * T1 * g, passes=g)
    assert s.costs.draft_ratio == pytest.approx(0.45)


def test_a_call_shown_nothing_of_its_text_looks_once_its_plain_rounds_can_afford_it():
    # Without the target's confidence (a caller that does not report it) only a look at
    # the draft tells this text's α; where it is forecast to lose, it waits its budget.
    s = warmed(lambda k: 1 + 0.02 * (k - 1), draft_ratio=0.8, alpha=0.3)
    s.start_call()
    waited = first_look(s) + 1  # the look itself is a round after that many plain ones
    g = s.probe_length(FIRST_PROBE)
    assert 1 < waited < 300
    assert s.probe_loss(g, waited) <= EXPLORE * waited
    assert s.probe_loss(g, waited - 1) > EXPLORE * (waited - 1)


def plain_steps(s, tops):
    """Plain rounds showing the target's top probabilities; the γ each then chooses."""
    chosen = []
    for top in tops:
        s.record(0, 0, verify_s=T1, draft_s=None, passes=None)
        s.observe_confidence(top)
        chosen.append(s.choose().gamma)
    return chosen


def opened(curve, draft_ratio):
    """A new call past its opening round, on settled costs."""
    s = Scheduler(measured(curve, draft_ratio))
    s.start_call()
    assert s.choose().gamma == 0  # the reply's first token is the target's
    return s


def test_a_text_the_target_is_sure_of_is_drafted_within_a_few_tokens_on_this_cpu():
    # Code: the target's top probability 0.99, drafts agree 0.98 (confidence_agreement.md).
    chosen = plain_steps(opened(**THIS_CPU), [0.99] * 8)
    assert chosen[0] == 0  # one sure step in prose is common: it does not decide alone
    assert 0 < chosen.index(next(g for g in chosen if g > 0)) < 6


def test_a_text_the_target_is_unsure_of_is_never_drafted_on_this_cpu():
    # Prose (top probability ~0.6): on the INT4 kernel no look would pay for itself.
    assert plain_steps(opened(**THIS_CPU), [0.6, 0.95, 0.4, 0.7, 0.3, 0.9] * 8) == [0] * 48


def test_the_same_unsure_text_is_drafted_where_verifying_more_tokens_is_cheap():
    fp32 = dict(curve=lambda k: 1 + 0.05 * (k - 1), draft_ratio=0.2)
    assert max(plain_steps(opened(**fp32), [0.6, 0.95, 0.4, 0.7, 0.3, 0.9] * 2)) > 0


def test_what_drafts_showed_fades_as_the_target_grows_sure_of_the_text():
    # Rejections in prose stop drafting; code later in the same reply starts it again.
    s = opened(**THIS_CPU)
    for _ in range(3):
        s.record(1, 0, verify_s=T1 * 1.29, draft_s=0.45 * T1, passes=1)
    assert s.choose().gamma == 0
    assert max(plain_steps(s, [0.99] * 24)) > 0


def test_a_calls_first_token_is_the_targets_own_even_with_drafts_that_always_pass():
    # The reply's first token is where drafts rarely pass (7 of 52 measured, 2 of 40 on code).
    s = warmed(lambda k: 1.0, draft_ratio=0.1, alpha=0.99)
    s.start_call()
    assert s.choose().gamma == 0
    assert plain_steps(s, [0.99]) == [s.choose().gamma] and s.choose().gamma > 0


def test_a_call_looks_right_after_its_first_token_where_the_look_is_forecast_to_pay():
    s = warmed(lambda k: 1 + 0.05 * (k - 1), draft_ratio=0.35, alpha=0.9)
    s.start_call()
    assert s.choose().gamma == 0
    choice = s.choose()
    assert choice.gamma == s.probe_length(FIRST_PROBE) > 0 and not choice.cost_probe


def test_a_look_drafts_one_token_where_verify_cost_rises_steeply():
    # At low α a rejection ends the judging early: on this CPU's INT4 kernel a longer
    # look costs more per draft judged; on a flat curve the look that pays best wins.
    steep = warmed(**THIS_CPU, alpha=0.5)
    flat = warmed(lambda k: 1 + 0.02 * (k - 1), draft_ratio=0.1, alpha=0.5)
    assert steep.probe_length(FIRST_PROBE) == 1
    paying_best = max(range(1, FIRST_PROBE + 1), key=flat.rate)
    assert flat.probe_length(FIRST_PROBE) == paying_best > 1


def test_no_call_probes_where_even_perfect_drafts_would_lose():
    # MLX CUDA 0.32.4: a multi-token pass at a new KV length costs ~8 plain steps.
    s = warmed(lambda k: 8.0, draft_ratio=0.3, alpha=0.95)
    s.start_call()
    assert s.choose().gamma == 0


def test_prompt_lookup_needs_no_probe_per_call():
    s = warmed(lambda k: k, draft_ratio=0.0, alpha=0.95, free=True)
    s.start_call()
    assert s.choose().gamma == 0


def auto_with_both(lookup_alpha):
    """AutoGamma with the draft model (sure text, this CPU's costs) and prompt lookup, whose
    guesses pass with lookup_alpha; the context has a two-token match."""
    from specmlx.drafters.lookup import LookupDrafter
    from specmlx.policy import AutoGamma

    costs = measured(THIS_CPU["curve"], THIS_CPU["draft_ratio"])
    model = Scheduler(costs, 8)
    lookup = Scheduler(costs, 8, free_drafts=True)
    draft_model = SimpleNamespace(name="model", behind=0)  # plan only hands it on
    lookup_drafter = LookupDrafter()
    auto = AutoGamma([lookup_drafter, draft_model], {"model": model, "lookup": lookup}, False)
    model.opening = False
    model.acceptance = Acceptance(0.95 * 40, 40.0, seen=True)
    lookup.acceptance = Acceptance(lookup_alpha * 40, 40.0, seen=True)
    lookup_drafter.start([4, 5, 1, 2, 3, 4, 5])  # "4 5" was followed by "1"
    return auto


def test_where_lookups_guesses_seldom_pass_the_draft_model_drafts_instead():
    plan = auto_with_both(lookup_alpha=0.02).plan(remaining=64)
    assert plan.gamma > 0 and plan.drafter is not None and plan.drafter.name == "model"


def test_where_lookups_guesses_pass_lookup_drafts():
    plan = auto_with_both(lookup_alpha=0.95).plan(remaining=64)
    assert plan.gamma > 0 and plan.drafter.name == "lookup"


def test_once_drafting_accepted_drafts_go_on_and_rejected_ones_stop():
    for accepted, goes_on in ((True, True), (False, False)):
        s = opened(**THIS_CPU)
        chosen = plain_steps(s, [0.95] * 24)
        g = next(g for g in chosen if g > 0)
        for _ in range(2):
            n = g if accepted else 0
            verify_s = T1 * THIS_CPU["curve"](g + 1)
            tops = [0.95] * min(n + 1, g)  # as sure at the drafts as before them
            s.record(g, n, verify_s, draft_s=0.45 * T1 * g, passes=g, tops=tops)
            g = s.choose().gamma
        assert (g > 0) == goes_on


def test_drafting_goes_on_through_a_forecast_near_even_but_does_not_start_on_one():
    s = warmed(**THIS_CPU, alpha=0.83)
    best = max(range(1, 9), key=s.rate)
    assert 1 / MARGIN < s.rate(best) / s.rate(0) < 1
    starting = s.choose()
    assert starting.predicted_tps == pytest.approx(s.tps(s.rate(0)))  # plain, or a look
    s = warmed(**THIS_CPU, alpha=0.83)
    s.drafting = 1  # the last round drafted (what it showed left out: the same α)
    going_on = s.choose()
    assert going_on.gamma == best  # the forecast's γ, below even but within the margin
    assert going_on.predicted_tps == pytest.approx(s.tps(s.rate(best)))


def test_prompt_lookup_stops_as_soon_as_its_forecast_falls_short_of_the_margin():
    # Nothing to catch up on: lookup keeps no hysteresis, where the draft model goes on.
    # Each α puts its drafter's best forecast just below even: (1 + 0.26) / T(2) = 0.98.
    for free, alpha, goes_on in ((False, 0.83, True), (True, 0.26, False)):
        s = warmed(**THIS_CPU, alpha=alpha, free=free)
        best = max(range(1, 9), key=s.rate)
        assert 1 / MARGIN < s.rate(best) / s.rate(0) < 1
        s.drafting = 1
        assert (s.choose().gamma > 0) == goes_on


def first_look(s, rounds=300):
    """Rounds of plain decoding before the scheduler drafts again (rounds if never)."""
    return next((i for i in range(rounds) if s.choose().gamma > 0), rounds)


def test_looking_again_costs_at_most_the_exploration_budget():
    s = warmed(lambda k: 1 + 0.3 * (k - 1), draft_ratio=0.1, alpha=0.2)
    gap = first_look(s) + 1
    g = s.probe_length(FIRST_PROBE)
    assert 1 < gap < 300
    assert s.probe_loss(g, gap) <= EXPLORE * gap
    assert s.probe_loss(g, gap - 1) > EXPLORE * (gap - 1)


def test_cheap_catch_up_looks_again_sooner_than_costly():
    # A fast BLAS (fp32) prices a pass over many tokens near one; this CPU's INT4 kernel
    # does not, so a draft that sat out costs several target passes to bring back.
    fp32 = warmed(lambda k: 1 + 0.065 * (k - 1), draft_ratio=0.36, alpha=0.4)
    int4 = warmed(THIS_CPU["curve"], THIS_CPU["draft_ratio"], alpha=0.4)
    assert first_look(fp32) < 60 and first_look(int4) == 300


def test_a_prompt_the_draft_has_not_taken_must_be_won_back_within_the_call():
    # The draft model takes a call's prompt with its first drafting round: on this CPU's
    # curve 700 prompt tokens cost it ~90 target steps, more than drafting a 64-token reply
    # can save, while a short prompt, or a long reply, repays them.
    def first_choice(remaining, behind):
        s = warmed(THIS_CPU["curve"], THIS_CPU["draft_ratio"], alpha=0.95)
        return s.choose(remaining, behind).gamma

    assert first_choice(remaining=64, behind=700) == 0
    assert first_choice(remaining=64, behind=20) > 0
    assert first_choice(remaining=4096, behind=700) > 0


def test_hopeless_costs_probe_without_the_draft_model_ever_more_rarely():
    # Even perfect acceptance loses: probes only re-measure the cost curve, for free.
    s = warmed(lambda k: k, draft_ratio=0.3, alpha=0.95)
    probes = [(i, c) for i, c in enumerate(s.choose() for _ in range(300)) if c.gamma > 0]
    assert all(c.cost_probe and c.gamma == COST_PROBE for _, c in probes)
    starts = [i for i, _ in probes]
    assert starts[0] >= FIRST_BACKOFF - 1 and starts[2] - starts[1] > starts[1] - starts[0]


def test_the_first_plain_step_is_left_out_of_t1():
    costs = Costs()
    costs.observe_target(1, 1.5)  # paid for reading weights and compiling shapes
    assert costs.t1 == 1.5 and not costs.settled
    for seconds in (0.9, 1.0, 0.8):
        costs.observe_target(1, seconds)
    assert costs.settled and costs.t1 == pytest.approx(0.9)


def another_process(data: dict) -> dict:
    return {**data, "plain": {**data["plain"], "pid": data["plain"]["pid"] + 1}}


def test_a_cached_t1_stands_in_until_this_process_has_its_own():
    cached = Costs.from_json(another_process(measured(lambda k: k, 0.3, t1=0.15).to_json()))
    assert cached.t1 == 0.15 and not cached.settled
    cached.observe_target(1, 0.45)  # the process's first step: one-time work
    assert cached.t1 == 0.15
    for _ in range(SETTLE):
        cached.observe_target(1, 0.2)
    assert cached.settled and cached.t1 == 0.2


def test_a_new_session_goes_on_from_this_process_t1():
    # The bench makes a Session per run: each would otherwise rest T(1) on a step or two.
    costs = measured(lambda k: k, 0.3, t1=0.15)
    for _ in range(SETTLE):
        costs.observe_target(1, 0.15)
    again = Costs.from_json(costs.to_json())
    assert again.settled and again.plain == costs.plain


def test_unmeasured_verify_lengths_lie_on_the_median_slope():
    costs = Costs()
    for _ in range(SETTLE + 1):
        costs.observe_target(1, 1.0)
    costs.observe_target(5, 3.0)  # slope 0.5 per extra token
    assert costs.ratio(3) == pytest.approx(2.0)
    assert costs.ratio(9) == pytest.approx(5.0)


def test_one_slow_pass_cannot_lock_a_draft_length_out():
    # A burst of load (or a first call at a new shape) made one 5-token pass 6x slower.
    s = warmed(lambda k: 1 + 0.05 * (k - 1), draft_ratio=0.1, alpha=0.8)
    s.costs.observe_target(5, T1 * 6)
    assert s.costs.ratio(5) == pytest.approx(1.2)
    assert s.choose().gamma >= 3


def test_load_that_slows_every_pass_alike_does_not_change_the_choice():
    quiet = warmed(THIS_CPU["curve"], THIS_CPU["draft_ratio"], alpha=0.93)
    busy = Scheduler(measured(**THIS_CPU, t1=3 * T1), acceptance=quiet.acceptance)
    assert quiet.choose().gamma == busy.choose().gamma > 0
    assert busy.choose().predicted_tps == pytest.approx(quiet.choose().predicted_tps / 3)


def test_expected_tokens_follow_the_acceptance():
    a = Acceptance(accepted=6.0, judged=8.0)
    assert a.alpha == 0.75
    assert a.expected_tokens(2) == pytest.approx(1 + 0.75 + 0.75**2)


def test_a_rejection_ends_what_the_target_judged():
    a = Acceptance(accepted=0.0, judged=0.0)
    a.observe(g=4, n=1)  # d1 accepted, d2 rejected, d3 and d4 never judged
    assert (a.accepted, a.judged) == (1, 2)


def spans(n_rounds: int, g: int = 4) -> Acceptance:
    """Rounds of g drafts that pass whole or fail at the first: copied spans."""
    a = Acceptance(accepted=0.0, judged=0.0)
    for i in range(n_rounds):
        a.observe(g, g if i % 2 else 0)
    return a


def test_each_later_draft_position_keeps_its_own_acceptance():
    # Half the rounds fail at the first draft, the rest pass whole: once a first draft
    # passes, the rest do (α_1+ ≈ 1), which one α pooled over positions cannot say.
    a = spans(40)
    first, *later = a.by_position(4)
    assert first == a.alpha and min(later) > 0.9 > a.alpha
    assert a.expected_tokens(4) > sum(a.alpha**i for i in range(5)) + 0.3


def test_a_position_seldom_seen_leans_on_the_pooled_acceptance():
    a = spans(40, g=2)  # nothing is known of positions 2 and 3
    assert a.by_position(4)[2:] == [a.alpha, a.alpha]
    fresh = Acceptance(accepted=8.0, judged=10.0)  # pooled evidence, no positions
    assert fresh.by_position(3) == [pytest.approx(0.8)] * 3


def test_copied_spans_are_proposed_longer_than_independent_drafts_of_equal_alpha():
    # Prompt lookup on this CPU: one pooled α, two shapes. Spans that pass whole are
    # worth a long proposal; drafts that pass independently are not.
    copied = warmed(**THIS_CPU, alpha=0.6, free=True)
    copied.acceptance = spans(40)
    independent = warmed(**THIS_CPU, alpha=copied.acceptance.alpha, free=True)
    assert copied.choose().gamma > independent.choose().gamma


def test_one_miss_at_a_calls_start_does_not_stop_prompt_lookup():
    # Lookup drafts come in bursts: the first match of a call may miss, the next copy.
    s = Scheduler(measured(THIS_CPU["curve"], 0.0), free_drafts=True)
    s.start_call()
    g = s.choose().gamma
    s.record(g, 0, verify_s=T1 * THIS_CPU["curve"](g + 1), draft_s=0.0, passes=g)
    assert g > 0 and s.choose().gamma > 0


def test_a_call_starts_from_a_guess_that_fades_before_the_targets_confidence():
    a = Acceptance()
    assert a.alpha == pytest.approx(PRIOR_ALPHA) and not a.seen
    a.observe_confidence(0.99)
    assert PRIOR_ALPHA < a.alpha < 0.94  # one step does not decide alone
    for _ in range(40):
        a.observe_confidence(0.99)
    assert a.alpha == pytest.approx(0.99, abs=0.01)


def test_a_sure_plain_step_counts_as_confidence_weight_accepted_drafts():
    w = CONFIDENCE_WEIGHT
    drafts, steps = Acceptance(accepted=w, judged=w), Acceptance(accepted=0.0, judged=0.0)
    steps.observe_confidence(1.0)
    for a in (drafts, steps):
        a.observe(1, 0)
    assert steps.alpha == pytest.approx(drafts.alpha)


def test_a_marginal_forecast_is_not_worth_starting_to_speculate():
    # γ = 1 forecast 2% faster than plain decoding: within timing noise, so stay plain.
    s = warmed(lambda k: 1 + 0.3 * (k - 1), draft_ratio=1 / 6, alpha=0.5)
    plain, one = s.rate(0), s.rate(1)
    assert 1.0 < one / plain < 1.05
    # plain decoding, or a look at this text's α: either way not the forecast's γ
    assert s.choose().predicted_tps == pytest.approx(s.tps(plain))


def same_costs(a: Costs, b: Costs) -> bool:
    """Equal but for T(1)'s history: the cache keeps T(1) as one figure."""
    return (a.t1, a.target, a.draft) == (b.t1, b.target, b.draft)


def test_costs_survive_a_round_trip_through_json():
    costs = measured(lambda k: 1 + 0.2 * k, draft_ratio=0.3)
    assert same_costs(Costs.from_json(costs.to_json()), costs)


def test_a_new_call_starts_from_the_guess_not_the_last_calls_alpha():
    # A question after code must not start drafting at the code's α (γ = 8 on prose, seen).
    s = warmed(**THIS_CPU, alpha=0.99)
    s.start_call()
    assert s.acceptance == Acceptance()


def test_costs_are_cached_per_pair(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMLX_HOME", str(tmp_path))
    costs = measured(lambda k: k, 0.3)
    save_costs("pair", costs)
    assert same_costs(load_costs("pair"), costs)
    assert load_costs("another pair") == Costs()


def test_a_pair_new_to_its_kernels_starts_from_the_same_models_costs_on_others(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("SPECMLX_HOME", str(tmp_path))
    save_costs("pair|cpu|old kernel", measured(lambda k: 1 + 0.25 * (k - 1), 0.4))
    save_costs("other pair|cpu|new kernel", measured(lambda k: k, 0.9))
    start = load_costs("pair|cpu|new kernel", kins=("pair|cpu|",))
    assert start.draft_ratio == pytest.approx(0.4) and start.ratio(4) == pytest.approx(1.75)
    assert not start.plain and start.t1 is None  # T(1) is this process's own
    # so its first call needs no probe rounds to price a choice
    assert Scheduler(start).rate(FIRST_PROBE) is not None
    assert Scheduler(load_costs("pair|cpu|new kernel")).rate(FIRST_PROBE) is None


def test_a_kins_figures_give_way_to_the_pairs_own_within_a_few_passes(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMLX_HOME", str(tmp_path))
    save_costs("pair|cpu|old kernel", measured(lambda k: k, 0.9))
    start = load_costs("pair|cpu|new kernel", kins=("pair|cpu|",))
    for _ in range(SETTLE + 1):
        start.observe_target(1, T1)
    for _ in range(DRAFT_FIGURES + 1):
        start.observe_draft(0.3 * T1)
    assert start.draft_ratio == pytest.approx(0.3)


def test_a_rebuilt_kernel_starts_from_the_old_builds_costs_and_replaces_them(tmp_path, monkeypatch):
    # the same kernels' description, another build: its figures are a kin's (a start that
    # the new build's own outweigh), and saving the new build's drops the old one's entry
    monkeypatch.setenv("SPECMLX_HOME", str(tmp_path))
    save_costs("pair|cpu|avx2; build a", measured(lambda k: 1 + 0.33 * (k - 1), 0.4))
    save_costs("pair|cpu|avx512; build a", measured(lambda k: k, 0.3))
    start = load_costs("pair|cpu|avx2; build b", kins=("pair|cpu|",))
    assert start.t1 is None and not start.plain  # borrowed, not this build's own
    save_costs("pair|cpu|avx2; build b", start, replacing="pair|cpu|avx2; build ")
    kept = json.loads((tmp_path / "costs.json").read_text())
    assert sorted(kept) == ["pair|cpu|avx2; build b", "pair|cpu|avx512; build a"]


def test_a_rebuilt_kernel_starts_from_its_old_build_before_other_kernels(tmp_path, monkeypatch):
    # AVX2's curve is no guess for AVX-512's, even when it was saved last
    monkeypatch.setenv("SPECMLX_HOME", str(tmp_path))
    save_costs("pair|cpu|avx512; build a", measured(lambda k: 1 + 0.1 * (k - 1), 0.3))
    save_costs("pair|cpu|avx2; build a", measured(lambda k: 1 + 0.5 * (k - 1), 0.4))
    start = load_costs("pair|cpu|avx512; build b", kins=("pair|cpu|avx512; build ", "pair|cpu|"))
    assert start.ratio(9) == pytest.approx(1.8)


def borrowing(kin_curve, own_curve) -> Costs:
    """Costs started from a kin's measured kin_curve, then settled, with three passes of
    the pair's own at k = 2 and 3 on own_curve."""
    costs = borrowed(measured(kin_curve, 0.3))
    for _ in range(SETTLE + 1):
        costs.observe_target(1, T1)
    for k in (2, 3):
        for _ in range(OWN_FIGURES):
            costs.observe_target(k, T1 * own_curve(k))
    return costs


def test_a_kins_figures_at_k_are_retired_by_the_pairs_own_there():
    costs = borrowing(lambda k: 1 + 0.5 * (k - 1), lambda k: 1 + 0.1 * (k - 1))
    assert costs.target[3] == pytest.approx([1.2] * OWN_FIGURES)
    assert 3 not in costs.borrowed and 9 in costs.borrowed


def test_a_kins_dear_figure_is_priced_at_most_on_the_pairs_own_line():
    # else it is never chosen, so never measured again: lookup kept short for good
    costs = borrowing(lambda k: 1 + 0.5 * (k - 1), lambda k: 1 + 0.1 * (k - 1))
    assert costs.ratio(9) == pytest.approx(1.8)
    lookup = Scheduler(costs, free_drafts=True)
    lookup.acceptance = Acceptance(0.99 * 40, 40.0, seen=True)
    assert lookup.choose().gamma == 8


def test_a_kins_cheap_figure_stands_until_measured():
    costs = borrowing(lambda k: 1 + 0.05 * (k - 1), lambda k: 1 + 0.1 * (k - 1))
    assert costs.ratio(9) == pytest.approx(1.4)


def test_the_pairs_own_figures_at_a_borrowed_k_end_its_optimism():
    costs = borrowing(lambda k: 1 + 0.5 * (k - 1), lambda k: 1 + 0.1 * (k - 1))
    for _ in range(OWN_FIGURES):
        costs.observe_target(9, T1 * 4.0)
    assert costs.ratio(9) == pytest.approx(4.0) and not costs.borrowed.get(9)


def test_which_figures_are_a_kins_survives_the_cache():
    costs = borrowing(lambda k: 1 + 0.5 * (k - 1), lambda k: 1 + 0.1 * (k - 1))
    again = Costs.from_json(costs.to_json())
    assert again.borrowed == costs.borrowed and again.ratio(9) == pytest.approx(1.8)


def test_a_format_3_entrys_figures_all_count_as_a_kins():
    # format 3 did not tell a kin's figures from the pair's own
    old = {**measured(lambda k: 1 + 0.5 * (k - 1), 0.3).to_json(), "format": 3}
    del old["borrowed"]
    assert sorted(Costs.from_json(old).borrowed) == list(range(2, 10))


def test_an_engines_cost_key_names_the_kernels_build(models):
    session = specmlx.Session(models["target"], models["perturbed"])
    which = cost_id(session.drafters("model")[0])
    assert session.cost_key(which).startswith(session.cost_kernels(which))
    assert session.cost_key(which).endswith(f"; build {native.build_id()}")
    assert native.build_id() == "" or len(native.build_id()) == 12


def test_a_cache_in_an_older_format_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMLX_HOME", str(tmp_path))
    (tmp_path / "costs.json").write_text('{"pair": {"target": {"1": 0.2}, "draft": 0.1}}')
    assert load_costs("pair") == Costs()


def test_a_cache_from_before_the_first_draft_pass_was_left_out_is_measured_afresh(
    tmp_path, monkeypatch
):
    # Its draft figure may be the draft model's first pass (one-time work): kept, auto
    # would price the draft at twice its cost and never draft to learn better.
    monkeypatch.setenv("SPECMLX_HOME", str(tmp_path))
    old = measured(lambda k: k, 0.9).to_json()
    del old["format"]
    (tmp_path / "costs.json").write_text(json.dumps({"pair": old}))
    assert load_costs("pair") == Costs()


def test_calibration_outlives_the_session_and_is_kept_per_sampling(tmp_path, monkeypatch):
    # The bench and `specmlx generate` start a Session per call: a calibration learnt in
    # one call must reach the next, or sampled code (pessimistic confidence) never drafts.
    monkeypatch.setenv("SPECMLX_HOME", str(tmp_path))
    s = warmed(**THIS_CPU, alpha=0.99)
    s.start_call(sampled=True)
    for _ in range(10):  # drafts pass every time where the target was 0.85 sure
        s.record(4, 4, verify_s=T1 * 2, draft_s=0.45 * T1 * 4, passes=4, tops=[0.85] * 4)
    learnt = s.forecast(0.85)
    assert learnt > 0.85 * 1.05
    save_costs("pair", s.costs)
    again = Scheduler(load_costs("pair"))
    again.start_call(sampled=True)
    assert again.forecast(0.85) == pytest.approx(learnt)
    again.start_call(sampled=False)
    assert again.forecast(0.85) == 0.85


def test_calibration_is_kept_per_band_of_confidence():
    # At T = 1 a close draft passes more often than the target is sure where it is unsure
    # (0.4 -> 0.57, bench/results/confidence_agreement.md) and a little less where it is
    # sure (0.97 -> 0.90): one factor for both would be wrong at both.
    s = Scheduler(Costs())
    s.start_call(sampled=True)
    for _ in range(40):
        s.calibrate([0.4, 0.4, 0.97, 0.97], n=2)  # the two unsure pass, the two sure not
    assert s.forecast(0.4) > 0.6 and s.forecast(0.97) < 0.5
    assert s.forecast(0.75) == 0.75  # a band nothing was seen in keeps its prior


def test_calibration_reads_the_confidence_at_the_drafts_not_before_the_round():
    # Rounds start where the plain steps' forecast happened to be high: calibrated
    # against that forecast, acceptance read low (0.99 learnt at T = 1). The verify pass
    # shows the target's top at each judged draft, which the round's start did not pick.
    s = Scheduler(Costs())
    s.start_call()
    for top in (0.9, 0.92, 0.95):  # plain steps: the target fairly sure
        s.observe_confidence(top)
    s.calibrate([0.995, 0.995, 0.6], n=2)  # sure drafts passed, the unsure one did not
    assert s.forecast(0.995) == pytest.approx(0.995, abs=0.002)  # as sure as it said
    assert s.forecast(0.6) < 0.6
    assert s.forecast(0.92) == 0.92  # the band of the plain steps learnt nothing


def test_a_round_goes_on_while_the_draft_is_sure_and_stops_where_it_is_not():
    # On this CPU's INT4 kernel one more draft costs a draft pass and a verified token,
    # 0.74 of a plain step: worth it only if the drafts so far are likely to pass.
    s = warmed(**THIS_CPU, alpha=0.95)
    assert s.choose().gamma >= 2
    assert s.keep_drafting([0.999]) and s.keep_drafting([0.999, 0.995])
    assert not s.keep_drafting([0.3])
    assert not s.keep_drafting([0.999, 0.3])


def test_where_verifying_is_nearly_free_an_unsure_draft_still_goes_on():
    s = warmed(lambda k: 1 + 0.02 * (k - 1), draft_ratio=0.1, alpha=0.95)
    assert s.choose().gamma >= 2
    assert s.keep_drafting([0.3])


def test_the_drafts_confidence_is_calibrated_apart_from_the_targets():
    # Greedy, where the draft is 0.4 sure its argmax is the target's 0.62 of the time
    # (bench/results/confidence_agreement.md): learnt from the drafts the target judged.
    s = warmed(**THIS_CPU, alpha=0.9)
    for _ in range(40):
        s.record(2, 1, T1 * 1.3, 0.45 * T1 * 2, passes=2, tops=[0.4, 0.4], draft_tops=[0.4, 0.4])
    assert s.forecast(0.4, DRAFT) == pytest.approx(0.5, abs=0.05)
    assert s.forecast(0.4) == pytest.approx(0.5, abs=0.05)
    s.record(2, 2, T1 * 1.3, 0.45 * T1 * 2, passes=2, tops=[0.4, 0.4], draft_tops=[0.95] * 2)
    assert s.forecast(0.95, DRAFT) > 0.95
    assert s.forecast(0.95) == 0.95  # the target's 0.95 band saw nothing


def test_a_rejection_that_must_be_rewound_is_priced_into_every_draft_length():
    # Caches that cannot be trimmed (sliding windows, recurrent state) run the kept tokens
    # again after a rejection: a cost each round pays with the chance that a draft fails.
    flat = warmed(lambda k: 1.0 + 0.1 * (k - 1), 0.2, alpha=0.7)
    before = {g: flat.rate(g) for g in range(4)}
    for _ in range(3):
        flat.costs.observe_rewind(T1 * 1.5)
    assert flat.costs.rewind_ratio == pytest.approx(1.5)
    assert flat.rate(0) == before[0]
    assert all(flat.rate(g) < before[g] for g in (1, 2, 3))


def test_caches_that_trim_cost_nothing_to_rewind():
    assert measured(lambda k: 1.0, 0.2).rewind_ratio == 0.0


def test_a_hopeless_drafts_cost_probes_back_off_across_calls():
    # The costs belong to the pair, not the text: a draft as costly as the target must not
    # pay a probe (and the draft's re-timing) in every reply, as a per-call back-off did.
    s = warmed(lambda k: k, draft_ratio=1.0, alpha=1.0)
    probes = 0
    for _ in range(8):  # eight 48-token replies
        s.start_call()
        probes += sum(s.choose().cost_probe for _ in range(48))
    assert probes <= 3  # after 32, 64, 128 plain rounds, not one per reply


def test_the_cost_probe_back_off_is_kept_with_the_costs(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMLX_HOME", str(tmp_path))
    costs = measured(lambda k: k, 1.0)
    costs.plain_since_cost_probe, costs.cost_backoff = 17, 256
    save_costs("pair", costs)
    again = load_costs("pair")
    assert (again.plain_since_cost_probe, again.cost_backoff) == (17, 256)


# Costs by the context's length: a pass over k tokens after L cached ones.


def test_context_bands_double_from_a_short_context():
    from specmlx.policy.costs import SHORT_CONTEXT, band_start, context_band

    assert [context_band(n) for n in (0, SHORT_CONTEXT - 1, SHORT_CONTEXT)] == [0, 0, 1]
    assert context_band(2 * SHORT_CONTEXT - 1) == 1 and context_band(2 * SHORT_CONTEXT) == 2
    assert context_band(10**9) == context_band(16 * SHORT_CONTEXT)  # the last band takes all
    assert all(context_band(band_start(b)) == b for b in range(5))


def test_a_longer_context_keeps_the_shorter_ones_draft_cost_but_not_its_curve():
    from specmlx.policy.costs import from_shorter

    short = measured(lambda k: 1 + 0.1 * (k - 1), draft_ratio=0.3)
    longer = from_shorter(short)
    assert longer.draft == short.draft and longer.calibration is short.calibration
    assert longer.target == {} and not longer.settled


def test_with_the_draft_known_and_the_curve_not_a_model_first_measures_with_free_guesses():
    # a longer context's first rounds: the draft's catch-up on a long prompt would cost
    # more than the measurement learns
    from specmlx.policy.costs import from_shorter

    costs = from_shorter(measured(THIS_CPU["curve"], THIS_CPU["draft_ratio"]))
    for _ in range(SETTLE + 1):
        costs.observe_target(1, T1)
    s = Scheduler(costs)
    choice = s.choose()
    assert choice.gamma > 0 and choice.cost_probe


def test_auto_prices_each_round_at_the_context_the_target_holds():
    # prompt lookup pays where a verify over a few tokens costs about one, and not at a
    # longer context where each token verified costs another whole pass
    from specmlx.drafters.lookup import LookupDrafter
    from specmlx.policy import AutoGamma

    cheap, dear = measured(lambda k: 1 + 0.05 * (k - 1), 0.0), measured(lambda k: k, 0.0)
    lookup = Scheduler(cheap, 8, free_drafts=True)
    drafter = LookupDrafter()
    auto = AutoGamma(
        [drafter],
        {"lookup": lookup},
        False,
        costs_at=lambda b: {"lookup": cheap if b < 2 else dear},
    )
    lookup.acceptance = Acceptance(0.6 * 40, 40.0, seen=True)
    drafter.start([4, 5, 1, 2, 3, 4, 5])  # "4 5" was followed by "1 2 3 4 5"
    assert auto.plan(remaining=64, context=500).gamma > 0
    assert auto.plan(remaining=64, context=3000).gamma == 0
    assert lookup.costs is dear


# Trees (policy/trees.py): chosen where the cost curve is flat, chains kept where it is not.
FLAT = lambda k: 1 + 0.02 * (k - 1)  # noqa: E731  (a GPU, or AVX-512 at small k)
STEEP = lambda k: 1 + 0.45 * (k - 1)  # noqa: E731  (an AVX2 CPU)


def allowing_trees(curve, draft_ratio, alpha, free=False, nodes=16):
    s = warmed(curve, draft_ratio, alpha, free=free)
    s.trees = nodes
    return s


@pytest.mark.parametrize("free", [False, True], ids=["draft model", "prompt lookup"])
def test_a_flat_cost_curve_drafts_trees(free):
    choice = allowing_trees(FLAT, 0.1, 0.7, free).choose()
    assert choice.tree is not None and choice.gamma == choice.tree.nodes
    assert choice.tree.width > 1 and choice.tree.nodes > 8  # wider than any chain's γ


@pytest.mark.parametrize("free", [False, True], ids=["draft model", "prompt lookup"])
def test_a_steep_cost_curve_keeps_chains(free):
    choice = allowing_trees(STEEP, 0.1, 0.7, free).choose()
    assert choice.gamma > 0 and choice.tree is None


def test_a_draft_behind_more_than_the_rest_of_the_call_is_worth_prices_no_tree(monkeypatch):
    # On the flat curve a tree wins where the draft is in step; taking 3000 missed tokens
    # (a long prompt it never took: 15 T(1) at a draft pass of 0.1 T(1)) costs more than
    # the 10 plain steps left, so no proposal can pay there.
    priced = []
    real = Scheduler.best_tree
    monkeypatch.setattr(Scheduler, "best_tree", lambda self: priced.append(1) or real(self))
    s = allowing_trees(lambda k: 1 + 0.05 * (k - 1), 0.1, 0.7)
    assert s.choose(remaining=10, behind=0).tree is not None and priced
    priced.clear()
    s = allowing_trees(lambda k: 1 + 0.05 * (k - 1), 0.1, 0.7)
    assert s.choose(remaining=10, behind=3000).gamma == 0 and not priced


def test_a_draft_behind_for_the_rest_of_the_call_is_neither_priced_nor_forecast(monkeypatch):
    # 3000 tokens to catch up at 0.45 T(1) a pass cost more than the 64 plain steps left;
    # the next round, with one more missed and one fewer left, is no better.
    from specmlx.policy import AutoGamma
    from specmlx.policy.round import Plan, RoundSummary

    model = Scheduler(measured(THIS_CPU["curve"], THIS_CPU["draft_ratio"]), 8)
    model.acceptance = Acceptance(0.95 * 40, 40.0, seen=True)
    draft = SimpleNamespace(name="model", behind=3000)
    auto = AutoGamma([draft], {"model": model}, False)
    model.opening = False
    rates = []
    monkeypatch.setattr(Scheduler, "rate", lambda self, *a, **k: rates.append(1) or 1.0)
    read = []
    for remaining in (64, 63):
        assert auto.plan(remaining=remaining).gamma == 0
        # the forecast's read is of the first judged row (k = 1); a plain round judges none
        tops = lambda k: (read.append(k) if k else None) or [0.99] * k  # noqa: E731
        auto.observe(RoundSummary(Plan(None, 0), "plain", 0, 0, 0, 0.0, 0.02, target_tops=tops))
        auto.while_running()
        draft.behind += 1
    assert model.out_for_call and not read
    # a round: the probe-length check and hopeless()'s 8 perfect rates; no γ's forecast
    assert len(rates) <= 2 * (1 + 8)
    model.start_call()
    assert not model.out_for_call


def test_a_call_that_allows_no_trees_drafts_chains_on_a_flat_curve():
    choice = allowing_trees(FLAT, 0.1, 0.7, nodes=0).choose()
    assert choice.gamma > 0 and choice.tree is None


def test_a_tree_is_at_most_the_calls_limit():
    choice = allowing_trees(FLAT, 0.1, 0.7, nodes=5).choose()
    assert choice.tree is not None and choice.tree.nodes <= 5


def test_siblings_that_seldom_pass_keep_chains_and_siblings_that_often_pass_make_trees():
    def chosen(accepted):
        s = allowing_trees(lambda k: 1 + 0.1 * (k - 1), 0.1, 0.7)
        s.acceptance.siblings = [[accepted, 30.0]] * 3  # of 30 judged at each rank
        return s.choose().tree

    often = chosen(25.0)
    assert chosen(1.0) is None and often is not None and often.width > 1


def test_a_tree_round_teaches_acceptance_what_its_walk_met():
    s = allowing_trees(FLAT, 0.1, 0.7)
    before = s.acceptance.judged
    # at the root the second child passed; under it the first; then a leaf
    s.record_tree(4, T1, tree.walk([-1, -1, 1, 2], [1, 2, 3]))
    assert s.acceptance.siblings[0][1] == 1 and s.acceptance.siblings[0][0] == 1
    assert s.acceptance.judged == pytest.approx(0.9 * before + 3)  # three first children


def test_the_greedy_tree_is_the_best_tree_of_its_size_where_rank_chances_fall():
    # Brute force over every tree of up to 6 nodes, at most 3 deep and 3 wide.
    alphas, later = [0.7, 0.6, 0.5], [0.4, 0.3]
    for n in range(1, 7):
        parents, scores = grow_shape(alphas, later, n, width=3)
        assert sum(scores) == pytest.approx(best_score(alphas, later, n), rel=1e-9)


def best_score(alphas, later, n):
    best = 0.0
    for parents in product(*[range(-1, j) for j in range(n)]):
        parents = list(parents)
        depths, ranks = tree.depths(parents), tree.ranks(parents)
        if max(depths) > len(alphas) or max(ranks) > len(later):
            continue
        scores = []
        for j, p in enumerate(parents):
            above = 1.0 if p < 0 else scores[p]
            scores.append(above * rank_chance(alphas[depths[j] - 1], later, ranks[j]))
        best = max(best, sum(scores))
    return best


def test_each_prefix_of_a_planned_shape_is_a_tree():
    parents, _ = grow_shape([0.8] * 8, [0.3, 0.2, 0.1], 16)
    for n in range(1, 17):
        tree.check(parents[:n])


def test_a_fixed_tree_size_drafts_that_many_nodes_gamma_deep():
    from specmlx.drafters.lookup import LookupDrafter

    lookup = LookupDrafter()
    lookup.start([1, 2, 3, 1, 2, 3, 1, 2])
    plan = FixedGamma(3, [lookup], trees=7).plan(100)
    assert plan.tree.nodes == plan.gamma == 7 and len(plan.tree.at_depth) <= 3


def fixed_tree_after(rounds: list[tuple[list[int] | None, list[int], int]]) -> FixedGamma:
    """A fixed γ = 8 policy for trees of 8 nodes, shown rounds of (parents or None for a
    chain of 8, the accepted path, accepted drafts)."""
    from dataclasses import replace

    from specmlx.drafters.lookup import LookupDrafter
    from specmlx.policy.round import Plan, RoundSummary

    lookup = LookupDrafter()
    lookup.start([*range(1, 12)] * 2 + [1, 2])  # it can offer 8 drafts
    policy = FixedGamma(8, [lookup], trees=8)
    for parents, path, accepted in rounds:
        summary = RoundSummary(Plan(lookup, 8), "lookup", 8, 8, accepted, 0.0, 0.0)
        policy.observe(replace(summary, parents=parents, path=path))
    return policy


def test_a_fixed_tree_runs_as_a_chain_where_every_draft_passes():
    policy = fixed_tree_after([(None, list(range(8)), 8)] * 20)
    plan = policy.plan(100)
    assert plan.tree is None and plan.gamma == 8


def test_a_fixed_tree_spreads_where_first_choices_fail_and_second_ones_pass():
    # every round: the root's first child fails, its second passes, then nothing
    parents = [-1, -1, 0, 1, 2, 3, 4, 5]
    policy = fixed_tree_after([(parents, [1], 1)] * 20)
    plan = policy.plan(100)
    assert plan.tree is not None and plan.tree.at_depth[0] >= 2 and plan.tree.depth == 8
