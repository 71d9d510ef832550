"""The γ policy: speculate only where measured costs and acceptance say it pays."""

import pytest

from specmlx.schedule import Acceptance, Costs, Scheduler


def warmed(curve, draft_cost, alpha, max_gamma=8, weight=40.0):
    """A scheduler that has seen T(k) = curve(k) for every k and acceptance alpha per position."""
    costs = Costs({k: curve(k) for k in range(1, max_gamma + 2)}, draft_cost)
    s = Scheduler(costs, max_gamma, draft_measured=True)
    s.acceptance = Acceptance([alpha * weight] * max_gamma, [weight] * max_gamma)
    return s


def test_compute_bound_verify_means_no_speculation():
    # MLX's INT4 CPU kernels: k new tokens cost k times one token.
    s = warmed(lambda k: 0.3 * k, draft_cost=0.1, alpha=0.95)
    assert s.choose().gamma == 0


def test_flat_verify_with_good_drafts_means_speculation():
    # Memory-bound (GPU, or fp32 with a fast BLAS): verifying 9 tokens costs ~one.
    s = warmed(lambda k: 0.3 * (1 + 0.02 * (k - 1)), draft_cost=0.03, alpha=0.8)
    assert s.choose().gamma >= 3


def test_flat_verify_with_bad_drafts_means_no_speculation():
    s = warmed(lambda k: 0.3, draft_cost=0.1, alpha=0.05)
    assert s.choose().gamma == 0


def test_better_acceptance_never_shortens_gamma():
    chosen = [
        warmed(lambda k: 0.3 * (1 + 0.1 * (k - 1)), 0.03, alpha).choose().gamma
        for alpha in (0.3, 0.5, 0.7, 0.9, 0.97)
    ]
    assert chosen == sorted(chosen) and chosen[-1] > chosen[0]


def test_free_drafts_are_worth_trying_even_when_the_draft_model_is_not():
    costs = Costs({k: 0.3 * (1 + 0.05 * (k - 1)) for k in range(1, 10)}, draft_per_pass=0.5)
    model = Scheduler(costs, draft_measured=True)
    lookup = Scheduler(costs, free_drafts=True)
    for s in (model, lookup):
        s.acceptance.accepted, s.acceptance.reached = [6.0] * 8, [10.0] * 8
    assert model.choose().gamma == 0 and lookup.choose().gamma > 0


def test_cold_start_measures_plain_then_probes():
    s = Scheduler(Costs())
    assert s.choose().gamma == 0  # first round: T(1)
    s.record(0, 0, verify_s=0.3, draft_s=None, passes=0)
    g = s.choose().gamma
    assert g > 0  # second round: T(g+1) and the draft's cost, with real drafts
    s.record(g, 1, verify_s=0.3 * (g + 1), draft_s=0.1 * g, passes=g)
    assert s.choose().gamma == 0  # linear verify: it stops speculating


def test_after_choosing_zero_it_reprobes_with_backoff():
    s = warmed(lambda k: 0.3 * k, draft_cost=0.1, alpha=0.95)
    probes = [i for i in range(200) if s.choose().gamma > 0]
    assert probes and all(b - a > 16 for a, b in zip(probes, probes[1:], strict=False))
    assert probes[-1] - probes[-2] > probes[1] - probes[0]  # back-off grows


def test_hopeless_costs_probe_without_the_draft_model():
    # Even perfect acceptance loses: re-probes only re-measure the cost curve, for free.
    s = warmed(lambda k: 0.3 * k, draft_cost=0.1, alpha=0.95)
    choice = next(c for c in (s.choose() for _ in range(100)) if c.gamma > 0)
    assert choice.cost_probe and choice.gamma == 2  # short: only T(k)'s slope is in question


def test_unmeasured_verify_lengths_are_interpolated_on_a_line():
    costs = Costs({1: 1.0, 5: 3.0})
    assert costs.target_time(3) == pytest.approx(2.0)
    assert costs.target_time(9) == pytest.approx(5.0)


def test_expected_tokens_follow_the_per_position_acceptance():
    a = Acceptance([8.0, 4.0], [10.0, 8.0])  # decayed counts
    prior = 0.6 * 2
    a1, a2 = (8 + prior) / 12, (4 + prior) / 10
    assert a.expected_tokens(2) == pytest.approx(1 + a1 + a1 * a2)


def test_costs_survive_a_round_trip_through_json():
    costs = Costs({1: 0.1, 5: 0.2}, 0.03)
    assert Costs.from_json(costs.to_json()) == costs


def test_a_marginal_forecast_is_not_worth_speculating():
    # γ = 1 forecast 2% faster than plain decoding: within timing noise, so stay plain.
    s = warmed(lambda k: 0.3 * (1 + 0.3 * (k - 1)), draft_cost=0.05, alpha=0.5)
    plain, one = s.rate(0), s.rate(1)
    assert 1.0 < one / plain < 1.05
    assert s.choose().gamma == 0


def test_costs_from_disk_are_checked_by_one_real_draft_round_per_session():
    cached = Costs({k: 0.3 * k for k in range(1, 10)}, draft_per_pass=0.1)  # says: never draft
    s = Scheduler(cached)
    assert s.choose().gamma > 0 and not s.choose().cost_probe
    s.record(4, 4, verify_s=0.32, draft_s=0.04, passes=4)  # this machine is memory-bound now
    assert s.draft_measured and s.choose().gamma > 0


def test_acceptance_is_cached_with_the_costs(tmp_path, monkeypatch):
    from specmlx import schedule

    monkeypatch.setenv("SPECMLX_HOME", str(tmp_path))
    seen = Acceptance([3.0, 1.0], [4.0, 3.0])
    schedule.save_costs("pair", Costs({1: 0.2, 5: 0.4}, 0.1), seen)
    costs, acceptance = schedule.load_costs("pair")
    assert costs == Costs({1: 0.2, 5: 0.4}, 0.1) and acceptance == seen
    assert schedule.load_costs("another pair") == (Costs(), None)
