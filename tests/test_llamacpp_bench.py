"""bench.llamacpp's pure parts: its options, what it reads from llama.cpp's tools
(recorded output of llama.cpp 0c1e57098, vendored by llama-cpp-python 0.3.36) and the
summary it computes. Nothing here builds llama.cpp or times anything.

`bench` is the package at the repository's root (`python -m bench llamacpp`), imported as
one: pytest puts the root on sys.path (pyproject's `pythonpath`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specmlx.errors import SpecmlxError


@pytest.fixture(scope="module")
def bench():
    import bench.llamacpp

    # the repository's own bench/, not a package of that name from elsewhere
    here = Path(__file__).resolve().parents[1] / "bench"
    assert Path(bench.llamacpp.__file__).resolve().parent == here
    return bench.llamacpp


PROMPT = (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\n<|im_start|>user\nWrite hello world in C.<|im_end|>\n"
    "<|im_start|>assistant\n"
)

SPECULATIVE_STDOUT = (
    "\n\n" + PROMPT + 'Certainly! Below is a simple "Hello, World!" program\n\n\n\n'
)
SPECULATIVE_STDERR = """\
0.04.160.379 I cmn          init: llama threadpool init, n_threads = 2
1.48.357.713 I encoded   35 tokens in   18.190 seconds, speed:    1.924 t/s
1.48.357.733 I decoded   12 tokens in   70.787 seconds, speed:    0.170 t/s
1.48.357.747 I 
1.48.357.760 I n_draft   = 4
1.48.357.773 I n_predict = 12
1.48.357.786 I n_drafted = 13
1.48.357.800 I n_accept  = 8
1.48.357.813 I accept    = 61.538%
1.48.357.965 I common_perf_print: prompt eval time =   46192.25 ms /    53 tokens (  871.55 ms per token,     1.15 tokens per second)
1.48.357.979 I common_perf_print:        eval time =       0.00 ms /     1 runs   (    0.00 ms per token,      inf tokens per second)
"""  # noqa: W291, E501

COMPLETION_STDOUT = 'Certainly! Below is a simple "Hello\n\n'
COMPLETION_STDERR = """\
0.11.438.213 I generate: n_ctx = 4096, n_batch = 2048, n_predict = 8, n_keep = 0
0.36.830.140 I common_perf_print:    sampling time =       1.29 ms
0.36.830.165 I common_perf_print:    samplers time =       0.51 ms /    43 tokens
0.36.830.180 I common_perf_print:        load time =   10334.63 ms
0.36.830.194 I common_perf_print: prompt eval time =    9323.64 ms /    35 tokens (  266.39 ms per token,     3.75 tokens per second)
0.36.830.208 I common_perf_print:        eval time =   16039.19 ms /     7 runs   ( 2291.31 ms per token,     0.44 tokens per second)
"""  # noqa: E501

HELP = """\
-e,    --escape, --no-escape            whether to process escapes sequences (\\n, \\r, \\t, \\', \\", \\\\)
--spec-draft-threads, -td, --threads-draft N
--spec-draft-n-max N                    number of tokens to draft for speculative decoding (default: 3)
--spec-type none,draft-simple,draft-eagle3,draft-mtp,draft-dflash,draft-dspark,ngram-simple
--draft, --draft-n, --draft-max N       the argument has been removed. use --spec-draft-n-max or
"""  # noqa: E501

BENCH_JSON = """\
[
  {
    "build_commit": "0c1e57098",
    "build_number": 1,
    "n_threads": 2,
    "n_prompt": 1,
    "n_gen": 0,
    "n_depth": 128,
    "avg_ns": 511317575,
    "samples_ns": [ 511317575 ],
    "samples_ts": [ 1.95573 ]
  }
]
"""

CHANGELOG = """\
## [Unreleased]

## [0.3.36]

- feat: update llama.cpp to ggml-org/llama.cpp@0c1e57098

## [0.3.35]

- feat: update llama.cpp to ggml-org/llama.cpp@4df29be4f
"""


# --- options


def test_quick_is_one_repeat_of_16_tokens_on_one_prompt(bench):
    args = bench.parse_args(["--quick", "--repeat", "5", "--tokens", "99"])
    assert (args.repeat, args.tokens, args.prompts) == (1, 16, 1)


def test_defaults_are_the_full_run(bench):
    args = bench.parse_args(["--label", "x"])
    assert (args.threads, args.repeat, args.tokens, args.prompts) == (2, 3, 64, 4)
    assert args.only == ["decode", "prefill", "passes", "spec"]
    assert args.draft_max == [2, 4, 8]
    assert args.isa == "native"


def test_isa_avx2_is_refused_on_a_cpu_without_avx2s_companions(bench, monkeypatch):
    monkeypatch.setattr(bench, "cpu_flags", lambda: ["avx", "avx2", "fma", "sse4_2"])
    with pytest.raises(SpecmlxError, match="lacks bmi2, f16c"):
        bench.parse_args(["--isa", "avx2"])
    monkeypatch.setattr(bench, "cpu_flags", lambda: ["avx", "avx2", "bmi2", "f16c", "fma"])
    assert bench.parse_args(["--isa", "avx2"]).isa == "avx2"


def test_only_the_native_build_compiles_for_this_cpu(bench):
    assert bench.ISA_BUILDS["native"] == ("-DGGML_NATIVE=ON",)
    assert bench.ISA_BUILDS["avx2"] == ("-DGGML_NATIVE=OFF",)  # ggml's default set: AVX2
    assert not any("NATIVE" in option for option in bench.CMAKE_OPTIONS)


def test_sampled_runs_give_both_engines_the_same_seed_and_plain_sampling(bench):
    llama = bench.Llama.__new__(bench.Llama)
    llama.bin, llama.ggufs, llama.threads = Path("/x"), {"target": Path("t.gguf")}, "2"
    llama.repack = True
    greedy, sampled = llama.generate(16), llama.generate(16, 1.0, seed=3)
    assert greedy[greedy.index("--temp") + 1] == "0" and "--seed" not in greedy
    assert sampled[sampled.index("--temp") + 1] == "1"
    assert sampled[sampled.index("--seed") + 1] == "3"
    assert sampled[sampled.index("--top-k") + 1] == "0"  # no truncation, as specmlx samples


def test_sampled_runs_have_no_greedy_check(bench):
    runs = [
        spec_run("specmlx", "plain", "p", 10.0, same=None),
        spec_run("specmlx", "auto", "p", 15.0, drafted=4, accepted=3, same=None),
    ]
    modes = bench.summarize_spec(runs)["modes"]
    assert modes["specmlx:auto"]["greedy_same"] is None
    assert bench._same(modes["specmlx:auto"]) == "–"


def test_only_takes_a_comma_separated_subset(bench):
    assert bench.parse_args(["--only", "spec,decode"]).only == ["spec", "decode"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--only", "decode,speed"],
        ["--draft-max", "4,0"],
        ["--draft-max", "four"],
        ["--threads", "0"],
        ["--prompts", "41"],
        ["--label", "a/b"],
        ["--temperature", "-1"],
    ],
)
def test_bad_options_are_refused_in_one_line(bench, argv):
    with pytest.raises(SpecmlxError):
        bench.parse_args(argv)


# --- the build cache


def test_the_build_is_cached_per_version_and_cpu_flags(bench, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECMLX_HOME", str(tmp_path))
    avx2 = bench.build_dir("0.3.36", ["avx2", "fma"])
    assert avx2.parent == tmp_path / "llama.cpp" and avx2.name.startswith("0.3.36-")
    assert avx2 == bench.build_dir("0.3.36", ["avx2", "fma"])
    assert avx2 != bench.build_dir("0.3.36", ["avx2", "avx512f", "fma"])
    assert avx2 != bench.build_dir("0.3.35", ["avx2", "fma"])
    held = bench.build_dir("0.3.36", ["avx2", "avx512f", "fma"], "avx2")
    assert held.name == "0.3.36-avx2" and held != avx2  # runs on any AVX2 CPU


def test_the_vendored_commit_is_read_from_the_versions_own_changelog_entry(bench):
    assert bench.vendored_commit(CHANGELOG, "0.3.36") == "0c1e57098"
    assert bench.vendored_commit(CHANGELOG, "0.3.35") == "4df29be4f"
    assert bench.vendored_commit(CHANGELOG, "0.3.1") is None


def test_isa_flags_keep_the_vector_extensions(bench):
    flags = ["amx_tile", "avx2", "avx512f", "fpu", "sse4_2", "vme"]
    assert bench.isa_flags(flags) == ["amx_tile", "avx2", "avx512f"]


# --- llama.cpp's output


def test_flag_names_come_from_help_and_a_removed_alias_loses_to_the_new_name(bench):
    flags = bench.tool_flags(HELP)
    assert flags["draft_max"] == "--spec-draft-n-max"
    assert flags["draft_threads"] == "--spec-draft-threads"
    assert flags["spec_type"] == "draft-simple"


def test_an_older_build_s_draft_max_flag_is_found(bench):
    flags = bench.tool_flags("--draft-max, --draft, --draft-n N   number of tokens to draft\n")
    assert flags["draft_max"] == "--draft-max"
    assert flags["spec_type"] is None


def test_speculative_output_gives_the_text_after_the_prompt_and_the_counts(bench):
    run = bench.parse_speculative(SPECULATIVE_STDOUT, SPECULATIVE_STDERR, PROMPT)
    assert run["text"] == 'Certainly! Below is a simple "Hello, World!" program'
    assert (run["prompt_tokens"], run["tokens"], run["decode_s"]) == (35, 12, 70.787)
    assert (run["drafted"], run["accepted"]) == (13, 8)


def test_speculative_output_without_its_counts_is_refused(bench):
    with pytest.raises(SpecmlxError, match="n_drafted"):
        bench.parse_speculative(
            SPECULATIVE_STDOUT, SPECULATIVE_STDERR.replace("n_drafted", "x"), ""
        )


def test_completion_decode_time_is_eval_plus_sampling_not_the_prompt_eval(bench):
    run = bench.parse_completion(COMPLETION_STDOUT, COMPLETION_STDERR)
    assert run["text"] == 'Certainly! Below is a simple "Hello'
    assert run["tokens"] == 7 and run["prompt_tokens"] == 35
    assert run["decode_s"] == pytest.approx((16039.19 + 1.29) / 1000)


def test_completion_stopped_by_an_eos_drops_the_end_of_text_marker(bench):
    run = bench.parse_completion("Done.\n [end of text]\n\n\n", COMPLETION_STDERR)
    assert run["text"] == "Done.\n"


def test_llama_bench_json_is_read_after_any_preamble(bench):
    (test,) = bench.parse_bench_json("warming up\n" + BENCH_JSON)
    assert test["samples_ns"] == [511317575] and test["n_depth"] == 128


def test_llama_bench_without_json_is_refused(bench):
    with pytest.raises(SpecmlxError):
        bench.parse_bench_json("error: failed to load model\n")


def test_texts_agree_when_the_shorter_is_a_prefix_of_the_longer(bench):
    assert bench.same_text("def f():\n    return 1", "def f():\n    return 1\n")
    assert bench.same_text("def f():\n    return", "def f():\n    return 1")
    assert not bench.same_text("def f():\n    return 2", "def f():\n    return 1")
    assert not bench.same_text("", "def f():")


# --- the summary


def spec_run(engine, mode, prompt, tps, drafted=0, accepted=0, same=True, draft_max=None):
    return {
        "engine": engine,
        "mode": mode,
        "prompt": prompt,
        "draft_max": draft_max,
        "tps": tps,
        "drafted": drafted,
        "accepted": accepted,
        "same_as_plain": same,
    }


def test_interleaving_alternates_which_engine_goes_first(bench):
    calls = []
    bench.interleaved(3, lambda r: calls.append(("a", r)), lambda r: calls.append(("b", r)))
    assert calls == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]


def test_a_mode_s_speed_is_the_median_over_prompts_of_per_prompt_medians(bench):
    runs = [
        spec_run("specmlx", "plain", "p1", 10.0),
        spec_run("specmlx", "plain", "p1", 12.0),
        spec_run("specmlx", "plain", "p2", 20.0),
        spec_run("specmlx", "auto", "p1", 15.0, 10, 8),
        spec_run("specmlx", "auto", "p1", 18.0, 10, 9),
        spec_run("specmlx", "auto", "p2", 20.0, 0, 0, same=False),
    ]
    modes = bench.summarize_spec(runs)["modes"]
    assert modes["specmlx:plain"]["tps"] == pytest.approx((11.0 + 20.0) / 2)
    # p1: 16.5 / 11 = 1.5; p2: 20 / 20 = 1.0
    assert modes["specmlx:auto"]["vs_plain"] == pytest.approx(1.25)
    assert modes["specmlx:auto"]["alpha"] == pytest.approx(17 / 20)
    assert modes["specmlx:auto"]["greedy_same"] == 2 and modes["specmlx:auto"]["runs"] == 3


def test_each_speculative_tool_reports_its_fastest_draft_max(bench):
    runs = [spec_run("llama.cpp", "plain", "p1", 20.0)]
    for d, tps in ((2, 24.0), (4, 30.0), (8, 26.0)):
        runs.append(spec_run("llama.cpp", "speculative-simple", "p1", tps, 8, 6, draft_max=d))
    summary = bench.summarize_spec(runs)
    assert summary["best"] == {"llama.cpp:speculative-simple": "llama.cpp:speculative-simple@4"}
    assert summary["modes"]["llama.cpp:speculative-simple@4"]["vs_plain"] == pytest.approx(1.5)


def test_pass_costs_are_medians_and_their_ratio_to_one_token(bench):
    result = {
        "passes": {
            "llama.cpp": {"ms": {"1": [10.0, 30.0, 20.0], "8": [40.0, 40.0, 41.0]}},
            "specmlx": {"ms": {"1": [50.0], "8": [100.0]}},
        }
    }
    passes = bench.summarize(result)["passes"]
    assert passes["llama.cpp"]["ms"] == {"1": 20.0, "8": 40.0}
    assert passes["llama.cpp"]["vs_1"]["8"] == pytest.approx(2.0)
    assert passes["specmlx"]["vs_1"]["8"] == pytest.approx(2.0)


def test_decode_summary_has_each_engine_s_median_and_their_ratio(bench):
    result = {"decode": {"llama.cpp": {"tps": [20.0, 30.0, 25.0]}, "specmlx": {"tps": [10.0]}}}
    decode = bench.summarize(result)["decode"]
    assert decode["llama.cpp"] == 25.0 and decode["specmlx_vs_llama"] == pytest.approx(0.4)


def test_the_markdown_has_one_row_per_engine_and_dashes_for_parts_not_run(bench):
    result = {
        "label": "t",
        "command": "python -m bench llamacpp --only decode",
        "machine": {
            "lscpu_model": "AMD EPYC",
            "isa": ["avx2"],
            "cores": 2,
            "mlx": "0.32.4",
            "specmlx": "0.1",
            "load_average": (0.1, 0.1, 0.1),
        },
        "settings": {"threads": 2, "repeat": 1, "tokens": 16, "prompts": 1},
        "decode": {"llama.cpp": {"tps": [25.0]}, "specmlx": {"tps": [12.5]}},
    }
    text = bench.markdown(result, bench.summarize(result))
    rows = [
        line
        for line in text.splitlines()
        if line.startswith("| llama.cpp") or line.startswith("| specmlx")
    ]
    assert len(rows) == 2
    assert rows[0].startswith("| llama.cpp | 25.0 | – |")
    assert rows[1].startswith("| specmlx | 12.5 | – |")
    assert "held to" not in text


def test_the_markdown_says_when_both_engines_were_held_to_avx2(bench):
    result = {
        "label": "t",
        "command": "python -m bench llamacpp --isa avx2",
        "machine": {
            "lscpu_model": "AMD EPYC",
            "isa": ["avx2", "avx512f"],
            "cores": 2,
            "mlx": "0.32.4",
            "specmlx": "0.1",
            "load_average": (0.1, 0.1, 0.1),
        },
        "settings": {"threads": 2, "repeat": 1, "tokens": 16, "prompts": 1, "isa": "avx2"},
    }
    text = bench.markdown(result, bench.summarize(result))
    assert "- both engines held to avx2: llama.cpp built with -DGGML_NATIVE=OFF" in text
    assert "SPECMLX_ISA=avx2" in text


# --- llama.cpp's weight repacking


def fake_tools(bin_dir: Path, bench_script: str) -> None:
    """llama-bench as a shell script, and speculative tools whose --help is HELP's."""
    bin_dir.mkdir()
    tools = {
        "llama-bench": bench_script,
        "llama-speculative": f"cat <<'HELP'\n{HELP}HELP\n",
        "llama-speculative-simple": f"cat <<'HELP'\n{HELP}HELP\n",
    }
    for name, body in tools.items():
        path = bin_dir / name
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(0o755)


def test_a_crash_with_weights_repacked_turns_repacking_off_for_every_tool(bench, tmp_path):
    # as this build does on an AMX Xeon: SIGSEGV on any multi-token pass unless --repack 0
    fake_tools(
        tmp_path / "bin",
        f'case "$*" in *"--repack 0"*) cat <<\'J\'\n{BENCH_JSON}J\n;; *) kill -SEGV $$;; esac\n',
    )
    llama = bench.Llama(tmp_path / "bin", {"target": tmp_path / "t.gguf"}, 2)
    assert llama.repack is False
    assert llama.bench("-p", "1", "-n", "0")[0]["n_depth"] == 128  # ran with --repack 0
    assert "--no-repack" in llama.generate(8)


def test_repacking_stays_on_where_it_runs(bench, tmp_path):
    fake_tools(tmp_path / "bin", f"cat <<'J'\n{BENCH_JSON}J\n")
    llama = bench.Llama(tmp_path / "bin", {"target": tmp_path / "t.gguf"}, 2)
    assert llama.repack is True
    assert "--no-repack" not in llama.generate(8)
