"""specmlx bench: prompt selection, interleaving, ratio arithmetic, greedy check, end to end."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from specmlx import bench
from specmlx.bench import Mode, RunRecord
from specmlx.cli import main
from specmlx.drafters import modes as draft_modes
from specmlx.errors import SpecmlxError


def record(prompt_id: str, mode: str, tokens: int, decode_s: float, **kw) -> RunRecord:
    gamma_text = mode.rpartition(":")[2]
    gamma = 0 if mode == "target" else gamma_text if gamma_text == "auto" else int(gamma_text)
    fields = dict(
        prompt_id=prompt_id,
        category=kw.pop("category", "qa"),
        temperature=kw.pop("temperature", 0.0),
        mode=mode,
        engine="specmlx" if mode == "target" else mode.split(":")[0],
        gamma=gamma,
        family="specmlx" if mode == "target" else mode.split(":")[0],
        order=0,
        prompt_tokens=10,
        tokens=tokens,
        token_ids=kw.pop("token_ids", list(range(tokens))),
        text="",
        finish_reason="length",
        prefill_s=1.0,
        ttft_s=1.0,
        decode_s=decode_s,
        wall_s=decode_s + 1.0,
        target_passes=tokens,
        drafted=0,
        accepted=0,
        draft_s=None,
        peak_memory_bytes=0,
        rss_bytes=0,
    )
    fields.update(kw)
    return RunRecord(**fields)


def test_the_bench_imports_neither_the_cli_nor_rich_nor_typer():
    # The CLI renders what the bench returns; the bench must not need it to run.
    code = (
        "import sys, specmlx.bench; "
        "print([m for m in sys.modules if m.split('.')[0] in ('rich', 'typer') "
        "or m.startswith('specmlx.cli')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------- prompt suites


def test_split_honours_the_held_out_rule():
    suite = bench.read_suite()
    assert len(suite) == 560
    tune = bench.select_prompts(suite, split="tune")
    heldout = bench.select_prompts(suite, split="heldout")
    assert len(tune) + len(heldout) == 560
    assert not {"math_reasoning", "rag"} & {p.category for p in tune}
    assert {p.category for p in heldout} == {"math_reasoning", "rag", "humaneval"}
    humaneval_ids = lambda ps: {int(p.id.split("/")[1]) for p in ps if p.category == "humaneval"}  # noqa: E731
    assert humaneval_ids(tune) == set(range(40))
    assert humaneval_ids(heldout) == set(range(40, 80))
    with pytest.raises(SpecmlxError, match="held out"):
        bench.select_prompts(suite, split="tune", categories=["rag"])
    with pytest.raises(SpecmlxError, match="unknown category"):
        bench.select_prompts(suite, categories=["poetry"])


def write_suite(folder: Path) -> Path:
    """A suite folder in the packaged suites' format: one Spec-Bench prompt, one HumanEval."""
    folder.mkdir()
    row = {"question_id": 7, "category": "qa", "turns": ["Why is the sky blue?", "And red?"]}
    (folder / "spec_bench.jsonl").write_text(json.dumps(row) + "\n")
    row = {"question_id": 41, "category": "code", "turns": ["def add(a, b):"]}
    (folder / "humaneval.jsonl").write_text(json.dumps(row) + "\n")
    return folder


def test_a_suite_dir_takes_the_place_of_the_packaged_suites(tmp_path):
    suite = bench.read_suite(write_suite(tmp_path / "suite"))
    assert suite == [
        bench.Prompt("spec_bench/7", "qa", "Why is the sky blue?", "tune"),
        bench.Prompt("humaneval/41", "humaneval", "def add(a, b):", "heldout"),
    ]


def test_a_suite_dir_without_a_suite_file_is_a_clear_error(tmp_path):
    folder = write_suite(tmp_path / "suite")
    (folder / "humaneval.jsonl").unlink()
    with pytest.raises(SpecmlxError, match="humaneval.jsonl"):
        bench.read_suite(folder)


def test_skip_takes_a_later_part_of_each_category():
    suite = bench.read_suite()
    first = bench.select_prompts(suite, categories=["humaneval"], limit=4)
    later = bench.select_prompts(suite, categories=["humaneval"], limit=2, skip=2)
    assert [p.id for p in later] == [p.id for p in first[2:]]


def test_selection_is_round_robin_and_shortest_first():
    suite = bench.read_suite()
    chosen = bench.select_prompts(suite, categories=["qa", "writing"], limit=5, shortest=True)
    assert [p.category for p in chosen] == ["qa", "writing", "qa", "writing", "qa"]
    qa = [p for p in chosen if p.category == "qa"]
    assert [len(p.text) for p in qa] == sorted(len(p.text) for p in qa)
    assert len(qa[0].text) == min(len(p.text) for p in suite if p.category == "qa")


def test_mt_bench_stands_for_its_eight_categories():
    mt = bench.select_prompts(bench.read_suite(), categories=["mt-bench"])
    assert {p.category for p in mt} == set(bench.MT_BENCH) and len(mt) == 80


# ---------------------------------------------------------------- modes and their order


def test_schedule_interleaves_every_mode_per_prompt_and_rotates():
    prompts = [bench.Prompt(f"p/{i}", "qa", "x", "tune") for i in range(4)]
    modes = [bench.TARGET, Mode("specmlx", 2), Mode("mlx-lm", 2)]
    order = bench.schedule(prompts, [0.0, 1.0], modes)
    assert len(order) == 4 * 2 * 3
    blocks = [order[i : i + 3] for i in range(0, len(order), 3)]
    for b, block in enumerate(blocks):
        assert len({(p.id, t) for p, t, _ in block}) == 1  # one prompt and T per block
        names = [m.name for _, _, m in block]
        assert sorted(names) == sorted(m.name for m in modes)
        assert names[0] == modes[b % 3].name  # rotated: no mode always goes first
    assert [(p.id, t) for p, t, _ in order[::3]] == [
        (f"p/{i}", t) for i in range(4) for t in (0.0, 1.0)
    ]


def test_repeats_run_back_to_back_per_prompt_still_rotated():
    prompts = [bench.Prompt(f"p/{i}", "qa", "x", "tune") for i in range(2)]
    modes = [bench.TARGET, Mode("specmlx", 2)]
    order = bench.schedule(prompts, [0.0], modes, repeat=3)
    assert [p.id for p, _, _ in order] == ["p/0"] * 6 + ["p/1"] * 6
    assert [m.name for _, _, m in order[:4]] == ["target", "specmlx:2", "specmlx:2", "target"]


def test_gammas_parse_in_order_without_duplicates():
    assert bench.parse_gammas("1, 2,4,2") == [1, 2, 4]
    assert bench.parse_gammas("auto,4") == ["auto", 4]


def test_gamma_zero_is_refused_since_the_target_alone_always_runs():
    with pytest.raises(SpecmlxError, match=">= 1"):
        bench.parse_gammas("0,2")


def test_mlx_lm_gammas_refuse_auto():
    with pytest.raises(SpecmlxError, match="mlx-lm has no adaptive"):
        bench.parse_gammas("auto", allow_auto=False)


def test_temperatures_are_numbers_at_least_zero():
    assert bench.parse_temperatures("0,0.7,1,0.7") == [0.0, 0.7, 1.0]
    for text in ("hot", "-1", ""):
        with pytest.raises(SpecmlxError, match="--temperature"):
            bench.parse_temperatures(text)


def test_modes_run_the_target_then_specmlx_then_mlx_lm_at_its_integer_gammas():
    modes = bench.build_modes(["auto", 2], mlx_lm=True, mlx_lm_target=True)
    assert [m.name for m in modes] == [
        "target",
        "specmlx:auto",
        "specmlx:2",
        "mlx-lm:0",
        "mlx-lm:2",
    ]


def test_the_control_is_the_target_alone_again():
    modes = bench.build_modes([2], mlx_lm=False, control=True)
    assert [m.name for m in modes] == ["target", "target:again", "specmlx:2"]
    assert not modes[1].speculative


def test_mlx_lm_gammas_can_differ_from_specmlx_gammas():
    modes = bench.build_modes(["auto"], mlx_lm_gammas=[3, 5])
    assert [m.name for m in modes] == ["target", "specmlx:auto", "mlx-lm:3", "mlx-lm:5"]


def test_each_draft_mode_runs_at_every_gamma():
    modes = bench.build_modes([3], mlx_lm=False, draft_modes=["auto", "model", "lookup"])
    assert [m.name for m in modes] == ["target", "specmlx:3", "specmlx/model:3", "specmlx/lookup:3"]


def test_draft_modes_are_the_engines():
    assert bench.parse_draft_modes(" ,".join(draft_modes())) == draft_modes()
    with pytest.raises(SpecmlxError, match="--draft-mode"):
        bench.parse_draft_modes("beam")


# ---------------------------------------------------------------- summary


def test_with_repeats_a_prompts_ratio_is_of_median_runs():
    # One run of the target stalled (5 tok/s of its usual 10): the median leaves it out.
    records = [
        record("a", "target", 10, 1.0),
        record("a", "target", 10, 2.0),
        record("a", "target", 10, 1.0),
        record("a", "specmlx:4", 12, 1.0),
        record("a", "specmlx:4", 11, 1.0),
        record("a", "specmlx:4", 13, 1.0),
    ]
    assert bench.pairwise_ratios(records)[("specmlx:4", 0.0, "a")] == pytest.approx(1.2)
    row = next(r for r in bench.summarize(records) if r["mode"] == "specmlx:4")
    assert (row["prompts"], row["runs"], row["speedup_median"]) == (1, 3, pytest.approx(1.2))


def test_speedup_is_the_median_of_pairwise_ratios():
    # target 10, 20, 40 tok/s; the mode 15, 20, 20 tok/s: ratios 1.5, 1.0, 0.5
    records = [
        record("a", "target", 10, 1.0),
        record("b", "target", 20, 1.0),
        record("c", "target", 40, 1.0),
        record("a", "specmlx:4", 15, 1.0, drafted=40, accepted=10, target_passes=5),
        record("b", "specmlx:4", 20, 1.0, drafted=40, accepted=20, target_passes=5),
        record("c", "specmlx:4", 40, 2.0, drafted=40, accepted=30, target_passes=10),
    ]
    ratios = bench.pairwise_ratios(records)
    assert ratios[("specmlx:4", 0.0, "a")] == pytest.approx(1.5)
    assert ratios[("specmlx:4", 0.0, "c")] == pytest.approx(0.5)
    row = next(r for r in bench.summarize(records) if r["mode"] == "specmlx:4")
    assert row["speedup_median"] == pytest.approx(1.0)
    assert (row["speedup_min"], row["speedup_max"]) == (pytest.approx(0.5), pytest.approx(1.5))
    # Spec-Bench's ratio of totals: (75 tok / 4 s) / (70 tok / 3 s)
    assert row["speedup_total"] == pytest.approx((75 / 4) / (70 / 3))
    assert row["alpha"] == pytest.approx(60 / 120)
    assert row["tau"] == pytest.approx(75 / 20)
    assert row["decode_tps_median"] == pytest.approx(20.0)


def test_the_summary_adds_up_the_rounds_specmlx_reports():
    # γ = auto's rounds by the γ it chose, and those the draft's confidence cut short,
    # summed over a mode's runs; engines that report none (mlx-lm, the target) count none.
    records = [
        record("a", "target", 10, 1.0),
        record("b", "target", 10, 1.0),
        record("a", "specmlx:auto", 10, 1.0, engine_stats={"rounds_by_gamma": {2: 3, 0: 1}}),
        record(
            "b",
            "specmlx:auto",
            10,
            1.0,
            engine_stats={"rounds_by_gamma": {4: 2, 2: 1}, "cut_short": 2},
        ),
    ]
    rows = {r["mode"]: r for r in bench.summarize(records) if r["category"] == "all"}
    assert list(rows["specmlx:auto"]["rounds_by_gamma"].items()) == [("0", 1), ("2", 4), ("4", 2)]
    assert rows["specmlx:auto"]["cut_short"] == 2
    assert (rows["target"]["rounds_by_gamma"], rows["target"]["cut_short"]) == (None, 0)


def test_mlx_lm_rounds_rebuilt_from_draft_flags():
    # γ=3, max 8: round 1 accepts 3 (+ bonus), round 2 accepts 1 then the target's token,
    # round 3 drafts only min(3, 8 - 6) = 2 and is cut at max_tokens after both.
    flags = [True, True, True, False, True, False, True, True]
    got = bench.mlx_lm_rounds(flags, gamma=3, max_tokens=8)
    assert got["target_passes"] == 3
    assert got["drafted"] == 3 + 3 + 2
    assert got["accepted"] == 3 + 1 + 2
    assert got["drafted_by_position"] == [3, 3, 2]
    assert got["accepted_by_position"] == [3, 2, 1]
    assert bench.mlx_lm_rounds([False] * 5, gamma=0, max_tokens=5)["target_passes"] == 5


# ---------------------------------------------------------------- the run, with fake runners


def run_fake_bench(target, repeat: int, progress=lambda event: None) -> tuple[dict, list]:
    """run_bench on one prompt at T = 1, the target alone and γ = 2, seed 7, with a runner
    that only records each call's (mode, seed)."""
    calls = []

    def fake(target, draft, ids, mode, temperature, max_tokens, seed):
        calls.append((mode.name, seed))
        return record("", mode.name, 4, 1.0)

    prompts = [bench.Prompt("p/0", "qa", "x y", "tune")]
    modes = [bench.TARGET, Mode("specmlx", 2)]
    result = bench.run_bench(
        target, target, prompts, modes, [1.0], repeat=repeat, seed=7, warmup=False,
        runners={"specmlx": fake}, progress=progress,
    )  # fmt: skip
    return result, calls


def test_each_repeat_samples_with_its_own_seed(models):
    # At T > 0 one seed is one text per mode: repeats must sample others to average over.
    result, seeds = run_fake_bench(models["target"], repeat=3)
    assert sorted(seeds) == sorted((m, s) for m in ("target", "specmlx:2") for s in (7, 8, 9))
    assert sorted(r["repeat"] for r in result["runs"]) == [0, 0, 1, 1, 2, 2]


def steal_in_the_first_blocks_second_run(monkeypatch) -> None:
    """The hypervisor takes 10% of the CPUs during the first block's second run only."""
    steal = iter([0.0, 0.0, 0.0, 0.10] + [0.0] * 20)
    clock = [0, 0]

    def cpu_times():
        clock[0] += round(next(steal) * 100)
        clock[1] += 100
        return tuple(clock)

    monkeypatch.setattr("specmlx.bench.run.cpu_times", cpu_times)


def test_a_block_that_lost_cpus_to_steal_is_timed_again_whole(models, monkeypatch):
    # Both of the block's runs are timed again (the modes stay interleaved) and the first
    # try is kept apart.
    steal_in_the_first_blocks_second_run(monkeypatch)
    result, calls = run_fake_bench(models["target"], repeat=2)
    assert len(calls) == 6 and calls[:2] == calls[2:4]  # the same seeds again
    assert [r["steal"] for r in result["retimed"]] == [0.0, pytest.approx(0.10)]
    assert sorted((r["mode"], r["repeat"]) for r in result["runs"]) == [
        ("specmlx:2", 0), ("specmlx:2", 1), ("target", 0), ("target", 1)
    ]  # fmt: skip
    assert all(r["steal"] == 0.0 for r in result["runs"])


def test_a_block_timed_again_is_announced_and_its_runs_say_again(models, monkeypatch):
    # Its runs' progress came a second time word for word, as if printed twice by mistake.
    from specmlx.cli.bench import progress_line

    steal_in_the_first_blocks_second_run(monkeypatch)
    lines = []
    run_fake_bench(models["target"], repeat=2, progress=lambda e: lines.append(progress_line(e)))
    assert [line.split(" · elapsed")[0] for line in lines] == [
        "run 1/4 · prompt 1/1 p/0 · target · T=1",
        "run 2/4 · prompt 1/1 p/0 · specmlx:2 · T=1",
        "runs 1–2 timed again (1 of at most 2): the hypervisor took 10% of the CPUs during "
        "them, over the 2% limit",
        "run 1/4 (again) · prompt 1/1 p/0 · target · T=1",
        "run 2/4 (again) · prompt 1/1 p/0 · specmlx:2 · T=1",
        "run 3/4 · prompt 1/1 p/0 · specmlx:2 · T=1",
        "run 4/4 · prompt 1/1 p/0 · target · T=1",
    ]


# ---------------------------------------------------------------- end to end, on tiny models

MODES = ["target", "target:again", "specmlx:auto", "specmlx:1", "specmlx:3", "mlx-lm:1", "mlx-lm:3"]


@pytest.fixture(scope="module")
def bench_run(model_dirs, tmp_path_factory):
    """One small bench through the CLI on the tiny models: JSON and PNG written."""
    out = tmp_path_factory.mktemp("bench")
    json_path, png_path = out / "run.json", out / "run.png"
    argv = ["bench", "--model", str(model_dirs["target"]), "--draft", str(model_dirs["perturbed"])]
    argv += ["--categories", "qa,humaneval", "--prompts", "2", "--shortest", "-g", "1,3"]
    argv += ["-t", "0,1", "-n", "12", "--control", "--label", "tiny pair"]
    argv += ["--json", str(json_path), "--plot", str(png_path)]
    main(argv)
    return json.loads(json_path.read_text()), png_path


def test_bench_writes_a_finished_result_and_a_plot(bench_run):
    result, png = bench_run
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert result["schema"] == bench.SCHEMA and "partial" not in result
    for key in ("machine", "models", "settings", "cold_start", "prompts", "runs", "summary"):
        assert key in result


def test_the_result_records_the_machine_and_the_models(bench_run, models):
    result, _ = bench_run
    machine = result["machine"]
    assert machine["backend"] == "cpu" and machine["mlx"] and machine["mlx_lm"] and machine["cpu"]
    assert set(machine["blas"]) == {"active", "mapped"}
    target = result["models"]["target"]
    assert target["dtype"] == "float32"
    assert target["cpu_weights"] == models["target"].weights  # the mode the loader chose


def test_the_result_carries_the_callers_label(bench_run):
    result, _ = bench_run
    assert result["label"] == "tiny pair"


def test_every_prompt_temperature_and_mode_runs_once_in_order(bench_run):
    result, _ = bench_run
    assert result["settings"]["modes"] == MODES  # auto added: the default policy
    runs = result["runs"]
    assert len(runs) == 2 * 2 * len(MODES)
    assert [r["order"] for r in runs] == list(range(len(runs)))
    for r in runs:
        assert r["tokens"] == len(r["token_ids"]) <= 12
        assert r["decode_s"] > 0 and r["prefill_s"] > 0 and r["ttft_s"] > 0
        assert r["peak_memory_bytes"] > 0 and r["rss_bytes"] > 0


def test_speculative_runs_at_a_fixed_gamma_draft(bench_run):
    result, _ = bench_run
    fixed = [r for r in result["runs"] if isinstance(r["gamma"], int) and r["gamma"]]
    assert len(fixed) == 2 * 2 * 4  # specmlx and mlx-lm at γ 1 and 3
    for r in fixed:
        assert r["drafted"] > 0 and 0 <= r["alpha"] <= 1 and r["tau"] >= 1


def test_specmlx_greedy_tokens_equal_the_target_alones(bench_run):
    # specmlx is lossless: greedy speculative tokens equal the target alone's, always
    result, _ = bench_run
    greedy = [
        r
        for r in result["runs"]
        if r["temperature"] == 0 and r["engine"] == "specmlx" and r["mode"] != "target"
    ]
    assert len(greedy) == 2 * 4  # target:again, auto, γ 1 and 3 on two prompts
    assert all(r["matches_target"] is True for r in greedy)


def test_the_summary_has_a_row_per_mode_temperature_and_category(bench_run):
    result, _ = bench_run
    keys = {(r["mode"], r["temperature"], r["category"]) for r in result["summary"]}
    assert keys == {
        (m, t, c) for m in MODES for t in (0.0, 1.0) for c in ("qa", "humaneval", "all")
    }


def test_the_control_is_paired_with_the_target_and_drafts_nothing(bench_run):
    result, _ = bench_run
    control = [
        r for r in result["summary"] if r["mode"] == "target:again" and r["category"] == "all"
    ]
    assert len(control) == 2  # one per temperature
    assert all(r["speedup_median"] is not None and r["alpha"] is None for r in control)


def test_the_command_spells_out_the_resolved_settings(bench_run):
    command = bench_run[0]["command"]
    assert "--gamma auto,1,3 " in command
    assert "--prompts 2" in command and "--control" in command and "--shortest" in command


def test_greedy_check_catches_a_planted_divergence(bench_run):
    result, _ = bench_run
    fields = bench.RunRecord.__dataclass_fields__
    records = [RunRecord(**{k: v for k, v in r.items() if k in fields}) for r in result["runs"]]
    planted = next(r for r in records if r.mode == "specmlx:3" and r.temperature == 0)
    planted.token_ids = copy.copy(planted.token_ids)
    assert len(planted.token_ids) > 5
    planted.token_ids[5] = (planted.token_ids[5] + 1) % 100
    bench.compare_to_target(records)
    assert planted.matches_target is False and planted.diverges_at == 5
    others = [r for r in records if r.engine == "specmlx" and r.temperature == 0 and r.gamma]
    assert sum(r.matches_target is False for r in others) == 1
    row = next(
        r
        for r in bench.summarize(records)
        if r["mode"] == "specmlx:3" and r["temperature"] == 0 and r["category"] == "all"
    )
    assert row["greedy_divergent"] == 1 and row["greedy_checked"] == 2


# ---------------------------------------------------------------- saved results


def test_a_saved_result_renders_and_plots_again(bench_run, tmp_path, capsys):
    _, png = bench_run
    saved = png.with_suffix(".json")
    main(["bench", "--from-json", str(saved), "--plot", str(tmp_path / "again.png")])
    assert "speedup" in capsys.readouterr().out
    assert (tmp_path / "again.png").read_bytes()[:4] == b"\x89PNG"


def test_a_result_that_did_not_finish_is_refused(tmp_path):
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"schema": bench.SCHEMA, "partial": True, "runs": []}))
    with pytest.raises(SpecmlxError, match="did not finish"):
        bench.read_result(partial)


# What every committed result holds (bench/results/*.json, from the first run to the
# latest): the keys the readers may rely on. Results carry more (later fields: label,
# retimed, a row's cut_short and runs; dropped ones: machine.code), which readers take
# where present, so an old result still renders.
RESULT_SCHEMA = {
    "": {"schema", "argv", "command", "started", "duration_s", "machine", "models",
         "settings", "cold_start", "memory", "prompts", "warmup", "runs", "summary"},
    "settings": {"modes", "temperatures", "categories", "split", "max_tokens", "seed",
                 "chat_template", "cpu_weights", "quick", "interleaving", "timing", "warmup"},
    "machine": {"cpu", "cores", "cores_usable", "backend", "device", "mlx", "mlx_lm",
                "specmlx", "python", "platform", "blas", "int4_kernel", "env",
                "load_average", "load_average_end"},
    "machine.blas": {"active", "mapped"},
    "cold_start": {"cold_start_s", "weights_s", "import_s", "tokenizer_s", "before_main_s",
                   "first_call_wall_s", "first_call_ttft_s"},
    "memory": {"rss_peak_bytes", "rss_bytes_end"},
    "models.target": {"name", "path", "model_type", "description", "dtype", "quantization",
                      "cpu_weights", "cpu_weights_why", "layer_types", "load_info"},
    "summary[]": {"mode", "engine", "family", "gamma", "temperature", "category", "prompts",
                  "tokens", "decode_tps_median", "decode_tps_total", "speedup_median",
                  "speedup_min", "speedup_max", "speedup_total", "e2e_speedup_median",
                  "alpha", "tau", "draft_share", "prefill_tps_median", "ttft_s_median",
                  "peak_memory_bytes", "rss_bytes", "greedy_checked", "greedy_divergent",
                  "rounds_by_gamma"},
    "runs[]": {"prompt_id", "category", "temperature", "mode", "engine", "family", "gamma",
               "order", "prompt_tokens", "tokens", "token_ids", "text", "finish_reason",
               "prefill_s", "ttft_s", "decode_s", "wall_s", "target_passes", "drafted",
               "accepted", "draft_s", "peak_memory_bytes", "rss_bytes", "decode_tps",
               "prefill_tps", "e2e_tps", "alpha", "tau", "draft_share", "drafted_by_position",
               "accepted_by_position", "matches_target", "diverges_at", "engine_stats"},
}  # fmt: skip


def schema_problems(result: dict) -> list[str]:
    """What `result` lacks of RESULT_SCHEMA, as 'where: key' lines."""
    problems = [] if result.get("schema") == bench.SCHEMA else [f"schema: {result.get('schema')}"]
    for where, keys in RESULT_SCHEMA.items():
        if where.endswith("[]"):
            parts = result.get(where[:-2]) or [{}]
        else:
            part = result
            for step in filter(None, where.split(".")):
                part = part.get(step, {})
            parts = [part]
        for part in parts:
            problems += [f"{where or 'top'}: {key}" for key in sorted(keys - set(part))]
    return problems


def old_result() -> dict:
    """A finished result in the oldest committed shape, two prompts small: no label, no
    steal retiming, no cut_short or runs in its rows, and machine.code, a field since
    dropped."""
    summary, runs = [], []
    for mode, gamma in (("target", 0), ("specmlx:auto", "auto")):
        engine = {"engine": "specmlx", "family": "specmlx", "gamma": gamma, "temperature": 0.0}
        for category in ("qa", "humaneval", "all"):
            auto = mode != "target"
            summary.append({
                **engine, "mode": mode, "category": category, "prompts": 1, "tokens": 8,
                "decode_tps_median": 10.0 + 5 * auto, "decode_tps_total": 10.0 + 5 * auto,
                "speedup_median": 1.0 + 0.5 * auto, "speedup_min": 1.0, "speedup_max": 1.5,
                "speedup_total": 1.0 + 0.5 * auto, "e2e_speedup_median": 1.0 + 0.4 * auto,
                "alpha": 0.9 if auto else None, "tau": 2.0 if auto else None,
                "draft_share": 0.2 if auto else None, "prefill_tps_median": 50.0,
                "ttft_s_median": 0.2, "peak_memory_bytes": 2**20, "rss_bytes": 2**21,
                "greedy_checked": 1 if auto else 0, "greedy_divergent": 0,
                "rounds_by_gamma": {"0": 2, "3": 2} if auto else {},
            })  # fmt: skip
        for order, (prompt, category) in enumerate((("p/1", "qa"), ("humaneval/0", "humaneval"))):
            runs.append({
                **engine, "mode": mode, "prompt_id": prompt, "category": category,
                "order": order, "prompt_tokens": 10, "tokens": 8, "token_ids": list(range(8)),
                "text": "", "finish_reason": "length", "prefill_s": 0.2, "ttft_s": 0.2,
                "decode_s": 0.8, "wall_s": 1.0, "target_passes": 8 - 4 * auto,
                "drafted": 6 * auto, "accepted": 5 * auto, "draft_s": 0.1 if auto else None,
                "peak_memory_bytes": 2**20, "rss_bytes": 2**21, "decode_tps": 10.0,
                "prefill_tps": 50.0, "e2e_tps": 8.0, "alpha": None, "tau": None,
                "draft_share": None, "drafted_by_position": [], "accepted_by_position": [],
                "matches_target": True if auto else None, "diverges_at": None,
                "engine_stats": None,
            })  # fmt: skip
    target = {
        "name": "tiny-target", "path": "$SPECMLX_HOME/models/tiny-target",
        "model_type": "qwen2", "description": "tiny", "dtype": "float32",
        "quantization": {"bits": 4, "group_size": 64}, "cpu_weights": "int4",
        "cpu_weights_why": "", "layer_types": {}, "load_info": {},
    }  # fmt: skip
    return {
        "schema": bench.SCHEMA, "argv": ["specmlx", "bench"], "command": "specmlx bench",
        "started": "2026-11-28T00:00:00Z", "duration_s": 12.0,
        "machine": {
            "cpu": "a CPU", "cores": 2, "cores_usable": 2, "backend": "cpu", "device": "cpu",
            "mlx": "0.32.4", "mlx_lm": "0.32.2", "specmlx": "0.1.0", "python": "3.11",
            "platform": "Linux", "blas": {"active": None, "mapped": None},
            "int4_kernel": "native", "env": {}, "load_average": [1.0, 1.0, 1.0],
            "load_average_end": [1.0, 1.0, 1.0], "code": {"commit": "0000000"},
        },
        "models": {"target": target, "draft": dict(target, name="tiny-draft")},
        "settings": {
            "modes": ["target", "specmlx:auto"], "temperatures": [0.0],
            "categories": ["qa", "humaneval"], "split": "tune", "max_tokens": 8, "seed": 0,
            "chat_template": True, "cpu_weights": "auto", "quick": False,
            "interleaving": "rotated", "timing": "decode", "warmup": True,
        },
        "cold_start": {
            "cold_start_s": 1.0, "weights_s": 0.5, "import_s": 0.2, "tokenizer_s": 0.1,
            "before_main_s": 0.1, "first_call_wall_s": 0.3, "first_call_ttft_s": 0.1,
        },
        "memory": {"rss_peak_bytes": 2**30, "rss_bytes_end": 2**29},
        "prompts": [{"id": "p/1", "category": "qa"},
                    {"id": "humaneval/0", "category": "humaneval"}],
        "warmup": [], "runs": runs, "summary": summary,
    }  # fmt: skip


def test_a_result_of_todays_bench_holds_the_schema_of_every_committed_one(bench_run):
    result, _ = bench_run
    assert schema_problems(result) == []


def test_the_schema_check_names_what_a_result_lacks():
    result = old_result()
    assert schema_problems(result) == []
    del result["memory"]["rss_peak_bytes"], result["summary"][0]["tau"]
    assert schema_problems(result) == ["memory: rss_peak_bytes", "summary[]: tau"]


def test_a_result_in_the_oldest_committed_shape_renders_again(tmp_path, capsys):
    # Older results carry fields since dropped (machine.code, the commit) and lack later ones.
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old_result()))
    main(["bench", "--from-json", str(path)])
    out = capsys.readouterr().out
    assert "speedup [min–max]" in out  # brackets are text, not markup
    assert "1.50× [1.00–1.50]" in out and "humaneval" in out


# ---------------------------------------------------------------- the suite in bench/

ROOT = Path(__file__).resolve().parents[1]


def test_python_m_bench_lists_every_benchmark_with_its_purpose():
    import bench as suite

    names = suite.names()
    assert 0 < len(names) + len(suite.HELPERS) <= 15  # the bar: at most 15 scripts
    out = subprocess.run(
        [sys.executable, "-m", "bench"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    for name in names:
        assert f"  {name} " in out and suite.purpose(name) in out
    assert "timing" not in out.split()


def test_every_benchmark_takes_argv_and_is_listed_in_the_readme():
    import ast

    import bench as suite

    readme = (ROOT / "bench" / "README.md").read_text()
    for name in suite.names():
        tree = ast.parse((ROOT / "bench" / f"{name}.py").read_text())
        mains = [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "main"]
        assert mains and mains[0].args.args[0].arg == "argv", name
        assert f"`{name}`" in readme, f"bench/README.md does not list {name}"


def test_benchmarks_import_each_other_as_package_modules_and_not_the_private_extension():
    import ast

    import bench as suite

    local = {p.stem for p in (ROOT / "bench").glob("*.py")}
    for path in (ROOT / "bench").glob("*.py"):
        source = path.read_text()
        assert "_ext" not in source, f"{path.name} reaches into specmlx.cpu.native._ext"
        for node in ast.walk(ast.parse(source)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module.split(".")[0]]
            assert not set(names) & (local - {"bench"}), f"{path.name} imports {names} by path"
    assert set(suite.HELPERS) <= local


def test_timing_orders_and_interleaves_so_no_variant_always_goes_first():
    from bench import timing

    assert [o for _, o in timing.orders("ab", 4)] == [["a", "b"], ["b", "a"]] * 2
    assert [o for _, o in timing.orders("abc", 3, "rotate")] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]
    ]  # fmt: skip
    calls = []
    out = timing.interleave({n: (lambda r, n=n: calls.append((n, r)) or r) for n in "ab"}, 3)
    assert calls == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    assert out == {"a": [0, 1, 2], "b": [0, 1, 2]}
    assert timing.median([]) is None and timing.median([3, 1, 2]) == 2
    assert abs(timing.geomean([0.5, 2.0]) - 1.0) < 1e-12
    seconds = timing.interleaved_seconds({"x": lambda: None}, 2)
    assert len(seconds["x"]) == 2 and all(s >= 0 for s in seconds["x"])


def test_timing_writes_paths_as_a_committed_result_should_hold_them(tmp_path, monkeypatch):
    from bench import timing
    from specmlx.paths import home

    assert timing.portable(home() / "models" / "x") == "$SPECMLX_HOME/models/x"
    monkeypatch.chdir(tmp_path)
    assert timing.portable(tmp_path / "bench" / "results") == "bench/results"
    assert timing.portable("relative/path") == "relative/path"
    timing.write_atomic(tmp_path / "out.md", "done\n")
    assert (tmp_path / "out.md").read_text() == "done\n"
    assert not list(tmp_path.glob("*.partial"))


def test_plot_without_matplotlib_is_a_clear_error(bench_run, monkeypatch, tmp_path, capsys):
    result, _ = bench_run
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SpecmlxError, match=r"specmlx\[bench\]"):
        bench.plot(result, tmp_path / "x.png")
    with pytest.raises(SystemExit) as exit_info:  # refused before any model is loaded
        main(["bench", "--quick", "--plot", str(tmp_path / "x.png")])
    assert exit_info.value.code == 2
    assert "error: --plot needs matplotlib" in capsys.readouterr().err


def test_results_record_paths_under_specmlx_home_without_the_machines_directories(
    tmp_path, monkeypatch
):
    from specmlx.paths import portable

    monkeypatch.setenv("SPECMLX_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert portable(tmp_path / "home" / "models" / "m") == "$SPECMLX_HOME/models/m"
    assert portable(tmp_path / "out" / "r.json") == "out/r.json"
    assert portable("/elsewhere/r.json") == "/elsewhere/r.json"
