"""Cold start of `specmlx generate` vs `mlx_lm generate`: process launch to first token.

Each run is a fresh subprocess that generates ONE token from a short prompt (greedy, same
target and draft for both tools), so its wall time is interpreter + imports + tokenizer +
weights + prefill + first token (+ exit). The tools alternate run by run and the figures
are medians, so a busy moment on a shared machine lands on both alike. specmlx's own
--json breakdown (imports, weights, tokenizer, first forward) is kept for each run.

Page cache: "warm" runs follow a run that read the same files; "dropped" runs start
after `sync; echo 3 > /proc/sys/vm/drop_caches` (root on Linux only; skipped otherwise),
so the weights AND the Python packages come from disk, as on the first run after a boot.

    python bench/cold_start.py                     # the tiny demo pair
    python bench/cold_start.py --model DIR --draft DIR --runs 3 --out bench/results/cold_start_X
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def drop_page_cache() -> bool:
    """Empty the page cache; False where this process may not."""
    try:
        os.sync()
        DROP_CACHES.write_text("3\n")
        return True
    except OSError:
        return False


def commands(model: str, draft: str | None, prompt: str) -> dict[str, list[str]]:
    specmlx = [sys.executable, "-m", "specmlx", "generate", "--model", model, "--prompt", prompt]
    # No chat template: a prompt of a few tokens, since prefill is not what is measured.
    specmlx += ["--max-tokens", "1", "--temperature", "0", "--raw", "--json"]
    mlx_lm = [sys.executable, "-m", "mlx_lm", "generate", "--model", model, "--prompt", prompt]
    mlx_lm += ["--max-tokens", "1", "--temp", "0", "--ignore-chat-template"]
    if draft:
        specmlx += ["--draft", draft]
        mlx_lm += ["--draft-model", draft]
    else:
        specmlx += ["--no-draft"]
    return {"specmlx": specmlx, "mlx_lm": mlx_lm}


def timed_run(argv: list[str]) -> dict:
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ})
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:5])} ... failed:\n{done.stderr[-2000:]}")
    run = {"wall_s": wall}
    if "--json" in argv:
        run["specmlx"] = json.loads(done.stdout)["timings"]
    return run


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r["specmlx"][key] for r in runs)


def summarize(results: dict) -> list[str]:
    lines = []
    for cache, tools in results.items():
        if not tools:
            continue
        s, m = tools["specmlx"], tools["mlx_lm"]
        ws, wm = (statistics.median(r["wall_s"] for r in t) for t in (s, m))
        lines.append(
            f"{cache:>8} cache: specmlx {ws:.2f} s · mlx_lm {wm:.2f} s (launch → 1 token → exit, "
            f"median of {len(s)})"
        )
        parts = ["interpreter_s", "import_s", "tokenizer_s", "weights_s", "first_forward_s"]
        shown = " · ".join(f"{p[:-2]} {median_of(s, p):.2f}" for p in parts)
        first = median_of(s, "first_token_s")
        lines.append(f"{'':>16}specmlx parts: {shown} · first token {first:.2f} s")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="target model dir (default: the tiny demo pair)")
    parser.add_argument("--draft", help="draft model dir (default: the demo draft)")
    parser.add_argument("--no-draft", action="store_true", help="target alone")
    parser.add_argument("--prompt", default="Hi", help="keep it short: prefill is not the point")
    parser.add_argument("--runs", type=int, default=5, help="runs per tool and cache state")
    parser.add_argument("--no-drop", action="store_true", help="warm page cache only")
    parser.add_argument("--out", help="write OUT.json and OUT.md")
    args = parser.parse_args()

    if args.model is None:
        from specmlx.models import tiny_demo_pair

        target, draft = (str(p) for p in tiny_demo_pair())
    else:
        target, draft = args.model, args.draft
    draft = None if args.no_draft else draft
    argvs = commands(target, draft, args.prompt)

    results: dict[str, dict[str, list]] = {"warm": {}, "dropped": {}}
    can_drop = not args.no_drop and drop_page_cache()
    for cache in ("warm", "dropped"):
        if cache == "dropped" and not can_drop:
            continue
        runs: dict[str, list] = {"specmlx": [], "mlx_lm": []}
        if cache == "warm":
            for argv in argvs.values():  # fill the page cache (and __pycache__)
                timed_run(argv)
        for i in range(args.runs):
            order = list(argvs) if i % 2 == 0 else list(reversed(argvs))
            for tool in order:
                if cache == "dropped":
                    drop_page_cache()
                runs[tool].append(timed_run(argvs[tool]))
        results[cache] = runs
        print("\n".join(summarize({cache: runs})), flush=True)

    if args.out:
        meta = {
            "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
            "model": target,
            "draft": draft,
            "prompt": args.prompt,
            "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cpus",
            "page_cache_dropped": can_drop,
            "git": subprocess.run(
                ["git", "describe", "--always", "--dirty"], capture_output=True, text=True
            ).stdout.strip(),
            "load_average_at_end": os.getloadavg(),
        }
        out = Path(args.out)
        out.with_suffix(".json").write_text(json.dumps({**meta, "runs": results}, indent=1))
        md = [f"# Cold start: `{meta['command']}`", ""]
        md += [f"- {k}: {v}" for k, v in meta.items() if k != "command"]
        md += ["", "```", *summarize(results), "```", ""]
        out.with_suffix(".md").write_text("\n".join(md))


if __name__ == "__main__":
    main()
