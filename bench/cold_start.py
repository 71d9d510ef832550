"""Cold start: launch to both models ready and to the first token, and a loaded pair's memory.

For specmlx with its weights mapped and with them copied (mx.load), mlx-lm, and llama.cpp
when a build is cached.

Start-up: each run is a fresh subprocess that generates ONE token from a short prompt
(greedy, same target and draft for every tool), so its wall time is interpreter + imports
+ tokenizer + weights + prefill + first token (+ exit). specmlx's own --json breakdown
(ready = process start to both models ready, first token, and the parts) is kept for
each run. mlx-lm is timed loading the pair (`mlx_lm.load` of both, weights evaluated) and
exiting, not to its first token: its bf16 activations make INT4 on x86 CPUs minutes per
token (bench/results/cold_start_qwen2.5-coder-1.5b+0.5b.md). llama.cpp (mmap-loaded GGUFs,
its default) runs `llama-speculative -n 1` when `python -m bench llamacpp` has built it and the
pair's GGUFs are at $SPECMLX_HOME/gguf. The variants alternate run by run (the order
reverses every other run) and the figures are medians, so a busy moment on a shared
machine lands on all alike.

Page cache: "warm" runs follow runs that read the same files; "dropped" runs each start
after `sync; echo 3 > /proc/sys/vm/drop_caches` (root on Linux only; skipped otherwise),
so the weights AND the Python packages come from disk, as on the first run after a boot.

Memory (--memory): two processes load the same pair at once and decode a few tokens with
drafts (so every weight page of both models has been touched), then wait; while both are
alive each one's anonymous (private) RSS, file-backed RSS and proportional set size (PSS,
/proc/PID/smaps_rollup: a shared page split between the processes that map it, other
processes on the same files included) are read, against the bytes of the pair's
safetensors files. "Both" is the two processes' private pages plus one copy of the
largest file-backed set: what the pair of processes costs the machine.

Decode (--decode): the target loaded twice in this process, mapped and copied, decodes
the same greedy reply alternately; tokens must match, tok/s are medians.

    python -m bench cold_start                     # the tiny demo pair
    python -m bench cold_start --model DIR --draft DIR --runs 3 --memory --decode \
        --out bench/results/cold_start_X
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from bench.timing import cpu_name, median, orders, portable, timed, write_atomic

DROP_CACHES = Path("/proc/sys/vm/drop_caches")
MB = 1024 * 1024

# Loads the pair as `specmlx generate` does, decodes a few tokens with two drafts a round
# (auto could keep the draft idle, leaving its pages untouched), says so, and waits for
# stdin to close: the memory a ready process holds, read from outside while it waits.
LOAD_AND_WAIT = """
import sys
from specmlx.cli.options import load_pair
from specmlx.engine import encode_prompt, generate
target, draft = load_pair(sys.argv[1], sys.argv[2], False, "auto", lambda line: None)
ids = encode_prompt(target, "def")
steps = generate(target, ids, draft, max_tokens=4, temperature=0, num_draft=2)
print([s.token for s in steps], target.info["reading"]["how"], flush=True)
sys.stdin.read()
"""
# specmlx's two ways of reading weights (specmlx/loading.py), by its environment switch.
READINGS = {"specmlx mapped": {"SPECMLX_MMAP": "1"}, "specmlx lazy-copy": {"SPECMLX_MMAP": "0"}}
MLX_LM_LOAD = "import sys; from mlx_lm import load; [load(path) for path in sys.argv[1:]]"


def drop_page_cache() -> bool:
    """Empty the page cache; False where this process may not."""
    try:
        os.sync()
        DROP_CACHES.write_text("3\n")
        return True
    except OSError:
        return False


def llama_speculative() -> Path | None:
    """The newest cached llama.cpp build's llama-speculative, if bench.llamacpp made one."""
    from specmlx.paths import home

    builds = home() / "llama.cpp"
    found = sorted(builds.glob("*/bin/llama-speculative"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def gguf_for(model: str) -> Path | None:
    from specmlx.paths import home

    path = home() / "gguf" / f"{Path(model).name}.gguf"
    return path if path.is_file() else None


def variants(model: str, draft: str | None, prompt: str) -> dict[str, tuple[list[str], dict]]:
    """name -> (argv, environment changes)."""
    specmlx = [sys.executable, "-m", "specmlx", "generate", "--model", model, "--prompt", prompt]
    # No chat template: a prompt of a few tokens, since prefill is not what is measured.
    specmlx += ["--max-tokens", "1", "--temperature", "0", "--raw", "--json"]
    specmlx += ["--draft", draft] if draft else ["--no-draft"]
    runs = {name: (specmlx, env) for name, env in READINGS.items()}
    runs["mlx_lm load"] = ([sys.executable, "-c", MLX_LM_LOAD, model, *([draft] * bool(draft))], {})
    binary = llama_speculative()
    ggufs = [gguf_for(model), gguf_for(draft)] if draft else []
    if binary and ggufs and all(ggufs):
        threads = str(len(os.sched_getaffinity(0)))
        llama = [str(binary), "-m", str(ggufs[0]), "-md", str(ggufs[1]), "-p", prompt]
        llama += ["-n", "1", "--temp", "0", "-t", threads, "-td", threads, "-c", "512"]
        runs["llama.cpp speculative"] = (llama, {})
    return runs


def timed_run(argv: list[str], env: dict) -> dict:
    done, wall = timed(
        lambda: subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **env})
    )
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:5])} ... failed:\n{done.stderr[-2000:]}")
    run = {"wall_s": wall}
    if "--json" in argv:
        run["specmlx"] = json.loads(done.stdout)["timings"]
    return run


def summarize(results: dict) -> list[str]:
    lines = []
    for cache, tools in results.items():
        if not tools:
            continue
        lines.append(f"{cache} page cache (medians of {len(next(iter(tools.values())))}):")
        for tool, runs in tools.items():
            line = f"  {tool:<22} launch → exit {median(r['wall_s'] for r in runs):5.2f} s"
            if "specmlx" in runs[0]:
                t = [r["specmlx"] for r in runs]
                parts = ["interpreter_s", "import_s", "tokenizer_s", "weights_s"]
                line += (
                    f" · ready {median(x['cold_start_s'] for x in t):.2f} s"
                    f" · first token {median(x['first_token_s'] for x in t):.2f} s ("
                    + " · ".join(f"{p[:-2]} {median(x[p] for x in t):.2f}" for p in parts)
                    + f" · first forward {median(x['first_forward_s'] for x in t):.2f})"
                )
            lines.append(line)
    return lines


def status_kb(pid: int, path: str, keys: tuple[str, ...]) -> dict[str, int]:
    values = {}
    for line in Path(f"/proc/{pid}/{path}").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in keys:
            values[key] = int(rest.split()[0])
    return values


def memory_of_two(model: str, draft: str, env: dict) -> dict:
    """Two processes on the same pair at once, both ready: each one's RSS split and PSS."""
    argv = [sys.executable, "-c", LOAD_AND_WAIT, model, draft]
    procs = [
        subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
        )
        for _ in range(2)
    ]
    said = [p.stdout.readline().strip() for p in procs]
    if not all(said):
        raise SystemExit("a loading process exited before it was ready")
    each = []
    for p in procs:
        status = status_kb(p.pid, "status", ("VmRSS", "RssAnon", "RssFile"))
        rollup = status_kb(p.pid, "smaps_rollup", ("Pss", "Pss_Anon", "Pss_File"))
        each.append({k: v * 1024 for k, v in {**status, **rollup}.items()})
    for p in procs:
        p.stdin.close()
        p.wait()
    return {"said": said, "processes": each, "pss_total": sum(e["Pss"] for e in each)}


def memory_lines(memory: dict, weights_bytes: int) -> list[str]:
    lines = [f"memory, two processes on the pair at once (weights: {weights_bytes / MB:.0f} MB):"]
    for name, m in memory.items():
        anon = median(e["RssAnon"] for e in m["processes"])
        rss = median(e["VmRSS"] for e in m["processes"])
        both = sum(e["RssAnon"] for e in m["processes"])
        both += max(e["RssFile"] for e in m["processes"])
        lines.append(
            f"  {name:<22} private (anon) RSS {anon / MB:5.0f} MB each "
            f"({anon / weights_bytes:.0%} of the weights) · RSS {rss / MB:5.0f} MB each · "
            f"both {both / MB:5.0f} MB · PSS sum {m['pss_total'] / MB:5.0f} MB"
        )
    return lines


def decode_mapped_vs_copied(model: str, rounds: int = 5, tokens: int = 48) -> dict:
    """Greedy decode of the target alone, its weights mapped and copied, interleaved."""
    import specmlx
    from specmlx.engine import encode_prompt, generate

    loaded = {}
    for name, env in READINGS.items():
        os.environ.update(env)
        loaded[name] = specmlx.load(model, lazy=False)
    os.environ.pop("SPECMLX_MMAP")
    ids = encode_prompt(loaded["specmlx mapped"], "def quicksort(items):")
    tps: dict[str, list[float]] = {name: [] for name in loaded}
    replies = {}
    for _, order in orders(loaded, rounds):
        for name in order:
            gen = generate(loaded[name], ids, max_tokens=tokens, temperature=0, num_draft=0)
            replies[name] = [step.token for step in gen]
            tps[name].append(gen.stats.decode_tps)
    return {"same_tokens": len(set(map(tuple, replies.values()))) == 1, "tps": tps}


def decode_lines(decode: dict) -> list[str]:
    same = "the same" if decode["same_tokens"] else "DIFFERENT"
    speeds = " · ".join(f"{name} {median(v):.2f} tok/s" for name, v in decode["tps"].items())
    return [f"decode, target alone, greedy ({same} tokens): {speeds} (medians)"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="target model dir (default: the tiny demo pair)")
    parser.add_argument("--draft", help="draft model dir (default: the demo draft)")
    parser.add_argument("--no-draft", action="store_true", help="target alone")
    parser.add_argument("--prompt", default="Hi", help="keep it short: prefill is not the point")
    parser.add_argument(
        "--runs", type=int, default=5, help="runs per variant and cache state (0: --memory only)"
    )
    parser.add_argument("--no-drop", action="store_true", help="warm page cache only")
    parser.add_argument("--memory", action="store_true", help="also two processes' memory")
    parser.add_argument("--decode", action="store_true", help="also decode mapped vs copied")
    parser.add_argument("--out", help="write OUT.json and OUT.md")
    args = parser.parse_args(argv)

    if args.model is None:
        from specmlx.models import tiny_demo_pair

        target, draft = (str(p) for p in tiny_demo_pair())
    else:
        target, draft = args.model, args.draft
    draft = None if args.no_draft else draft
    runs_of = variants(target, draft, args.prompt)

    results: dict[str, dict[str, list]] = {"warm": {}, "dropped": {}}
    can_drop = not args.no_drop and drop_page_cache()
    for cache in ("warm", "dropped"):
        if args.runs == 0 or (cache == "dropped" and not can_drop):
            continue
        runs: dict[str, list] = {name: [] for name in runs_of}
        if cache == "warm":
            for argv, env in runs_of.values():  # fill the page cache (and __pycache__)
                timed_run(argv, env)
        for _, order in orders(runs_of, args.runs):
            for name in order:
                if cache == "dropped":
                    drop_page_cache()
                runs[name].append(timed_run(*runs_of[name]))
        results[cache] = runs
        print("\n".join(summarize({cache: runs})), flush=True)

    memory, weights_bytes = {}, 0
    if args.memory and draft:
        files = [f for d in (target, draft) for f in Path(d).glob("model*.safetensors")]
        weights_bytes = sum(f.stat().st_size for f in files)
        for name, env in READINGS.items():
            memory[name] = memory_of_two(target, draft, env)
        print("\n".join(memory_lines(memory, weights_bytes)), flush=True)
    decode = decode_mapped_vs_copied(target) if args.decode else {}
    if decode:
        print("\n".join(decode_lines(decode)), flush=True)

    if args.out:
        meta = {
            "command": " ".join(portable(a) if os.path.isabs(a) else a for a in sys.argv),
            "model": portable(target),
            "draft": portable(draft) if draft else None,
            "prompt": args.prompt,
            "machine": f"{platform.system()} {platform.machine()}, {cpu_name()}",
            "page_cache_dropped": can_drop,
            "git": subprocess.run(
                ["git", "describe", "--always", "--dirty"], capture_output=True, text=True
            ).stdout.strip(),
            "load_average_at_end": os.getloadavg(),
        }
        out = Path(args.out)  # a name like cold_start_qwen2.5-coder: no suffix to replace
        record = {**meta, "runs": results, "memory": memory, "weights_bytes": weights_bytes}
        record["decode"] = decode
        write_atomic(out.with_name(out.name + ".json"), json.dumps(record, indent=1))
        md = [f"# Cold start: `{meta['command']}`", ""]
        md += [f"- {k}: {v}" for k, v in meta.items() if k != "command"]
        body = summarize(results) + (memory_lines(memory, weights_bytes) if memory else [])
        body += decode_lines(decode) if decode else []
        md += ["", "```", *body, "```", ""]
        write_atomic(out.with_name(out.name + ".md"), "\n".join(md))
