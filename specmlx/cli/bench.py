"""`specmlx bench`: target alone vs specmlx vs mlx-lm speculative, one interleaved run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..paths import portable
from ..settings import DEFAULT_SAMPLING
from ..wording import counted, human_bytes
from . import app, options

# --quick: a few short prompts, few tokens, one γ, greedy: minutes, not hours, on a slow CPU
QUICK = {"prompts": 4, "max_tokens": 48, "gamma": "4", "temperature": "0"}
DEFAULTS = {"max_tokens": 128, "gamma": "1,2,4,6", "temperature": "0,0.7,1.0"}


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def _num(value, fmt: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{fmt}}{suffix}"


def _speedup(row: dict) -> str:
    if row["speedup_median"] is None:
        return "–"
    return f"{row['speedup_median']:.2f}× [{row['speedup_min']:.2f}–{row['speedup_max']:.2f}]"


def render(result: dict, console: Console) -> None:
    """Overall table per temperature, then speedup by category, then divergences."""
    modes = result["settings"]["modes"]
    rows = result["summary"]
    for temp in result["settings"]["temperatures"]:
        table = Table(
            title=f"T={temp:g} · all categories · medians over prompts", title_justify="left"
        )
        for col in (
            "mode", "tok/s", "speedup [min–max]", "total", "e2e", "α", "τ",
            "draft", "prefill tok/s", "TTFT s", "peak MiB", "greedy same",
        ):  # fmt: skip
            table.add_column(Text(col), justify="left" if col == "mode" else "right")
        for mode in modes:
            row = next(
                (r for r in rows if r["mode"] == mode and r["temperature"] == temp
                 and r["category"] == "all"),
                None,
            )  # fmt: skip
            if row is None:
                continue
            greedy = (
                f"{row['greedy_checked'] - row['greedy_divergent']}/{row['greedy_checked']}"
                if row["greedy_checked"]
                else "–"
            )
            table.add_row(
                mode,
                f"{row['decode_tps_median']:.2f}",
                _speedup(row),
                _num(row["speedup_total"], suffix="×"),
                _num(row["e2e_speedup_median"], suffix="×"),
                _num(row["alpha"]),
                _num(row["tau"]),
                _num(row["draft_share"] and 100 * row["draft_share"], ".0f", "%"),
                f"{row['prefill_tps_median']:.1f}",
                f"{row['ttft_s_median']:.2f}",
                f"{row['peak_memory_bytes'] / 2**20:.0f}",
                greedy,
            )
        console.print(table)

        categories = sorted({r["category"] for r in rows if r["temperature"] == temp} - {"all"})
        spec_modes = [m for m in modes if m != "target"]
        if len(categories) > 1 and spec_modes:
            by_cat = Table(
                title=f"T={temp:g} · speedup by category (median of pairs; τ, and the "
                "end-to-end speedup with both prefills, in brackets)",
                title_justify="left",
            )
            by_cat.add_column("category")
            by_cat.add_column("n", justify="right")
            for mode in spec_modes:
                by_cat.add_column(mode, justify="right")
            for category in categories:
                cells, n = [], 0
                for mode in spec_modes:
                    row = next(
                        (r for r in rows if r["mode"] == mode and r["temperature"] == temp
                         and r["category"] == category),
                        None,
                    )  # fmt: skip
                    n = max(n, row["prompts"] if row else 0)
                    # results from before the end-to-end figure have none
                    e2e = _num(row.get("e2e_speedup_median"), suffix="×") if row else "–"
                    cells.append(
                        f"{row['speedup_median']:.2f}× ({_num(row['tau'])}; {e2e})"
                        if row and row["speedup_median"] is not None
                        else "–"
                    )
                by_cat.add_row(category, str(n), *cells)
            console.print(by_cat)

    for row in rows:
        if row["gamma"] == "auto" and row["category"] == "all" and row["rounds_by_gamma"]:
            used = ", ".join(f"γ={g}: {n}" for g, n in row["rounds_by_gamma"].items())
            if row.get("cut_short"):  # results from before the stop rule have none
                used += f" ({row['cut_short']} cut short by the draft's confidence)"
            console.print(f"{row['mode']} at T={row['temperature']:g}, rounds by γ: {used}")
    divergent = [r for r in result["runs"] if r["matches_target"] is False]
    for r in divergent:
        console.print(
            f"greedy divergence: {r['mode']} on {r['prompt_id']} differs from the "
            f"target alone at token {r['diverges_at']}",
            style="yellow",
            markup=False,
        )
    retimed = result.get("retimed") or []  # results from before steal was measured have none
    if retimed:
        worst = max(r["steal"] for r in retimed)
        console.print(
            f"{counted(len(retimed), 'run')} timed again: the hypervisor took over "
            f"{result['settings']['steal_limit']:.0%} of the CPUs during their block "
            f"(up to {worst:.0%})",
            style="dim",
            markup=False,
        )
    m, cold = result["machine"], result["cold_start"]
    label = f"{result['label']} · " if result.get("label") else ""  # older results have none
    console.print(
        f"{label}{m['cpu']} · {m['cores']} cores · {m['backend']} · mlx {m['mlx']} · "
        f"mlx-lm {m['mlx_lm']} · BLAS {m['blas']['active'] or 'not found'} · "
        f"CPU weights {result['models']['target'].get('cpu_weights') or '?'} · "
        f"cold start {_num(cold.get('cold_start_s'))} s (weights {_num(cold.get('weights_s'))}) "
        f"+ first call {_num(cold['first_call_wall_s'])} s"
        f" · peak RSS {human_bytes(result['memory']['rss_peak_bytes'])} · "
        f"run {_duration(result['duration_s'])}",
        style="dim",
        markup=False,
    )


def _stdout_console() -> Console:
    out = Console()
    # logs and pipes: wide enough that the table is not wrapped
    return out if out.is_terminal else Console(width=180)


def progress_line(event: dict) -> str:
    """What the bench says on stderr at each event of lib.run_bench: a warm-up call, a run,
    or a block about to be timed again (its runs then say "again", as they are reported
    a second time)."""
    if event["phase"] == "warmup":
        return (
            f"warm-up {event['index'] + 1}/{event['total']} · {event['mode']} · "
            f"T={event['temperature']:g}"
        )
    if event["phase"] == "retime":
        return (
            f"runs {event['first'] + 1}–{event['last'] + 1} timed again "
            f"({event['retime']} of at most {event['retimes']}): the hypervisor took "
            f"{event['steal']:.0%} of the CPUs during them, over the {event['limit']:.0%} limit"
        )
    again = " (again)" if event.get("retime") else ""
    return (
        f"run {event['index'] + 1}/{event['total']}{again} · prompt {event['prompt'] + 1}/"
        f"{event['prompts']} {event['prompt_id']} · {event['mode']} · "
        f"T={event['temperature']:g} · elapsed {_duration(event['elapsed_s'])} · "
        f"ETA {_duration(event['eta_s'])}"
    )


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False, default=str))
    tmp.replace(path)


@app.command()
def bench(
    model: str = options.Model,
    draft: str = options.Draft,
    dtype: str = options.Dtype,
    cpu_weights: str = options.CpuWeights,
    gamma: str = typer.Option(
        None,
        "--gamma",
        "-g",
        help="Comma-separated γ values, integers or auto (default auto,1,2,4,6).",
    ),
    temperature: str = typer.Option(
        None, "--temperature", "-t", help="Comma-separated temperatures (default 0,0.7,1.0)."
    ),
    draft_mode: str = typer.Option(
        "auto",
        "--draft-mode",
        help="Comma-separated specmlx draft modes: auto (generate's default with a draft: "
        "lookup where the context has a match, else the model), model, lookup.",
    ),
    sampling: str = typer.Option(
        None,
        "--sampling",
        help="Comma-separated specmlx samplings at T > 0, each a mode of its own: rejection, "
        "coupled (default: generate's).",
    ),
    categories: str = typer.Option(
        None, "--categories", "-c", help="Comma-separated categories; 'mt-bench' = its eight."
    ),
    split: str = typer.Option(
        "tune", "--split", help="tune | heldout | all (never tune against heldout)."
    ),
    prompts: int = typer.Option(
        None, "--prompts", "--limit", help="Prompts in all, round-robin over categories."
    ),
    shortest: bool = typer.Option(False, "--shortest", help="Shortest prompts of each category."),
    skip: int = typer.Option(
        0, "--skip", help="Leave out the first N prompts of each category (run in parts)."
    ),
    max_tokens: int = typer.Option(
        None, "--max-tokens", "-n", help="Tokens per run (default 128)."
    ),
    repeat: int = typer.Option(
        1,
        "--repeat",
        help="Time each prompt N times in every mode, interleaved; a prompt's ratio is of "
        "medians (short replies vary ±20% run to run on a busy machine).",
    ),
    quick: bool = typer.Option(
        False, "--quick", help="4 shortest prompts × 48 tokens, γ 4 (+auto), greedy."
    ),
    seed: int = options.Seed,
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    mlx_lm: bool = typer.Option(
        True, "--mlx-lm/--no-mlx-lm", help="Also run mlx-lm's speculative."
    ),
    mlx_lm_target: bool = typer.Option(
        False, "--mlx-lm-target", help="Also run mlx-lm's plain decoding (its own baseline)."
    ),
    control: bool = typer.Option(
        False,
        "--control",
        help="Also run the target alone a second time (target:again): an A/A test whose "
        "speedup is this machine's noise floor.",
    ),
    mlx_lm_gamma: str = typer.Option(
        None, "--mlx-lm-gamma", help="mlx-lm's γ values, if not --gamma's integers (e.g. 3,5)."
    ),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup", help="Untimed first call per mode."),
    json_path: Path = typer.Option(None, "--json", help="Write every raw figure to this file."),
    plot_path: Path = typer.Option(None, "--plot", help="Write a PNG plot (needs matplotlib)."),
    from_json: Path = typer.Option(
        None, "--from-json", help="Render (and --plot) a saved --json result; run nothing."
    ),
    suite_dir: Path = typer.Option(
        None,
        "--suite-dir",
        help="Folder with spec_bench.jsonl and humaneval.jsonl (default: the packaged suites).",
    ),
    label: str = typer.Option(
        None,
        "--label",
        help="Recorded as the result's label: what ran, e.g. the commit "
        "(--label $(git rev-parse --short HEAD)).",
    ),
) -> None:
    """Benchmark target alone vs speculative decoding (specmlx and mlx-lm), interleaved."""
    from .. import bench as lib
    from ..settings import check_max_tokens, parse_gamma

    err = Console(stderr=True, soft_wrap=True)
    if from_json is not None:
        result = lib.read_result(from_json)
        render(result, _stdout_console())
        if plot_path is not None:
            lib.plot(result, plot_path)
            err.print(f"wrote {plot_path}", style="dim", markup=False)
        return
    preset = QUICK if quick else {}
    gamma = gamma or preset.get("gamma") or DEFAULTS["gamma"]
    gammas = lib.parse_gammas(gamma)
    for value in gammas:
        parse_gamma(value)  # generate's rule, its maximum included
    if "auto" not in gammas:
        gammas = ["auto", *gammas]  # the default policy is always worth seeing
    draft_modes = lib.parse_draft_modes(draft_mode)
    samplings = lib.parse_samplings(sampling) if sampling else [DEFAULT_SAMPLING]
    temps = lib.parse_temperatures(
        temperature or preset.get("temperature") or DEFAULTS["temperature"]
    )
    max_tokens = max_tokens or preset.get("max_tokens") or DEFAULTS["max_tokens"]
    check_max_tokens(max_tokens)
    if repeat < 1:  # before loading the models, as for --max-tokens
        raise options.SpecmlxError(f"--repeat must be >= 1, got {repeat}")
    suite = lib.read_suite(suite_dir)
    chosen = lib.select_prompts(
        suite,
        split=split,
        categories=[c.strip() for c in categories.split(",") if c.strip()] if categories else None,
        limit=prompts or preset.get("prompts"),
        shortest=shortest or quick,
        skip=skip,
    )
    if plot_path is not None:
        try:
            import matplotlib  # noqa: F401  (fail before hours of running, not after)
        except ImportError:
            raise options.SpecmlxError(
                "--plot needs matplotlib; install it with `pip install 'specmlx[bench]'`"
            ) from None
    log = lambda msg: err.print(msg, style="dim", markup=False)  # noqa: E731
    target, drafter, timings = options.load_timed(model, draft, False, dtype, log, cpu_weights)
    if drafter is None:
        raise options.SpecmlxError("bench needs a draft model: pass --draft")
    mlx_lm_gammas = lib.parse_gammas(mlx_lm_gamma, allow_auto=False) if mlx_lm_gamma else None
    modes = lib.build_modes(
        gammas, mlx_lm, mlx_lm_target, draft_modes, mlx_lm_gammas, control, samplings
    )
    runs = len(chosen) * len(temps) * len(modes) * repeat
    times = f" × {repeat} repeats" if repeat > 1 else ""
    log(
        f"{counted(len(chosen), 'prompt')} × {counted(len(temps), 'temperature')} × "
        f"{counted(len(modes), 'mode')}{times} = {counted(runs, 'run')} "
        f"of ≤ {counted(max_tokens, 'token')}; modes: {', '.join(m.name for m in modes)}"
    )

    def progress(event: dict) -> None:
        log(progress_line(event))
        if event["phase"] != "run":
            return
        if json_path is not None and event["records"] and event["index"] % len(modes) == 0:
            # A long run that dies still leaves its finished blocks on disk.
            _write_json(
                json_path,
                {"schema": lib.SCHEMA, "partial": True,
                 "runs": [r.to_dict() for r in event["records"]]},
            )  # fmt: skip

    result = lib.run_bench(
        target,
        drafter,
        chosen,
        modes,
        temps,
        max_tokens=max_tokens,
        repeat=repeat,
        seed=seed,
        chat_template=not raw,
        warmup=warmup,
        cold_start=timings,
        progress=progress,
    )
    result["argv"] = [portable(arg) for arg in sys.argv]
    result["label"] = label
    # Every resolved setting spelled out, so the run can be repeated whatever the defaults become.
    parts = [
        "specmlx bench",
        f"--model {portable(target.path)} --draft {portable(drafter.path)} --dtype {dtype}",
        f"--cpu-weights {cpu_weights}",
        f"--gamma {','.join(str(g) for g in gammas)}",
        f"--draft-mode {','.join(draft_modes)}" if draft_modes != ["auto"] else "",
        f"--sampling {','.join(samplings)}",
        f"--temperature {','.join(f'{t:g}' for t in temps)}",
        f"--split {split}",
        f"--categories {categories}" if categories else "",
        f"--prompts {len(chosen)}",
        "--shortest" if shortest or quick else "",
        f"--skip {skip}" if skip else "",
        f"--max-tokens {max_tokens} --seed {seed}",
        f"--repeat {repeat}" if repeat > 1 else "",
        "--raw" if raw else "",
        "" if mlx_lm else "--no-mlx-lm",
        "--mlx-lm-target" if mlx_lm_target else "",
        "--control" if control else "",
        f"--mlx-lm-gamma {mlx_lm_gamma}" if mlx_lm_gamma and mlx_lm else "",
        "" if warmup else "--no-warmup",
        f"--suite-dir {portable(suite_dir)}" if suite_dir else "",
    ]
    result["command"] = " ".join(part for part in parts if part)
    result["settings"].update(
        split=split, categories=categories, quick=quick, cpu_weights=cpu_weights
    )
    render(result, _stdout_console())
    if json_path is not None:
        _write_json(json_path, result)
        log(f"wrote {json_path}")
    if plot_path is not None:
        lib.plot(result, plot_path)
        log(f"wrote {plot_path}")
