"""What `specmlx serve` costs over `specmlx generate`, and what 8 concurrent clients get.

1. Overhead. The same chat prompt (greedy, 64 tokens), with a fixed γ and with auto,
   N times each, alternating (A) one streamed request to a running server, timed on the
   client (request sent -> first content delta; tokens after the first / first -> last
   delta), and (B) `specmlx generate --json` in a fresh process, read from its own stats
   (ttft, decode_tps). The pair's order flips every run (AB, BA, ...), so drift on a
   shared machine lands on both alike. The greedy text must be the same both ways.
2. Concurrency. 8 streaming clients x 2 requests each (different prompts, greedy, 48
   tokens), total tokens / wall time, against the same 16 requests one after another,
   in the order C S S C. The server decodes one request at a time, so the two should be
   about equal.
3. The server is stopped with SIGINT (it must exit, cleanly), and every raw figure and the
   machine's facts go to a JSON, the medians and ratios to a short markdown.

With --batch it measures continuous batching instead (issue 64's first bar): 4 streamed
clients at once, one code prompt each (greedy, 128 tokens, auto γ), against one client
sending the same 4 one after another, in the order O F F O ... (--rounds pairs); with
--baseline, the one-client pass also runs against a second server that decodes one
request at a time (SPECMLX_MAX_BATCH=1), interleaved. The bars: four clients' total tok/s
≥ 2× one client's, every first token ≤ 1.5 s, every reply equal to the same request
alone, one client ≥ 0.97× the unbatched server's. Written to server-batch*.json / .md.

    python -m bench server_overhead --batch --baseline

    python -m bench server_overhead \\
        --model $SPECMLX_HOME/models/qwen2.5-coder-1.5b-instruct-int4 \\
        --draft $SPECMLX_HOME/models/qwen2.5-coder-0.5b-instruct-int4

A script, not a test: it needs the real model pair and a few minutes of a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import httpx

from bench.timing import median, portable, timed

TARGET = "qwen2.5-coder-1.5b-instruct-int4"  # under $SPECMLX_HOME/models
DRAFT = "qwen2.5-coder-0.5b-instruct-int4"
RESULTS = Path(__file__).parent / "results"

PROMPT = "Write a Python function that checks whether a string is a palindrome."
GAMMAS = (4, "auto")  # 4: the fixed γ the quick bench uses for this pair
MAX_TOKENS = 64

CLIENTS, PER_CLIENT, CONCURRENT_TOKENS = 8, 2, 48
CONCURRENT_GAMMA = 4  # fixed, so both passes do the same rounds (auto follows timings)
PROMPTS = [
    "Write a Python function that reverses a linked list.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a SQL query that finds the second highest salary in a table.",
    "Write a JavaScript function that debounces another function.",
    "Write a Python function that merges two sorted lists.",
    "Write a bash one-liner that counts the lines of every .py file.",
    "Write a Python class for a stack with push, pop and peek.",
    "Write a Rust function that sums a vector of integers.",
    "Write a Python function that checks whether a number is prime.",
    "Write a C function that copies a string without strcpy.",
    "Write a Python function that flattens a nested list.",
    "Write a Go function that reverses a string.",
    "Write a Python function that counts the words in a text file.",
    "Write a regular expression that matches an email address.",
    "Write a Python function that computes the GCD of two numbers.",
    "Write a TypeScript interface for a user with a name and an email.",
]
assert len(PROMPTS) == CLIENTS * PER_CLIENT


# ---------------------------------------------------------------- the machine


def cpu_facts() -> dict:
    """What lscpu names, from /proc/cpuinfo: the figures mean little without it."""
    facts: dict = {}
    info = Path("/proc/cpuinfo")
    for line in info.read_text().splitlines() if info.exists() else []:
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key in ("model name", "cpu family", "model") and key not in facts:
            facts[key] = value
        elif key == "flags" and "flags" not in facts:
            flags = value.split()
            facts["flags"] = sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))
    return facts


def package(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def machine_facts() -> dict:
    # Not specmlx.bench.machine: that imports mlx into this client process, which only
    # needs to send requests. The engine's own view (BLAS, INT4 kernel) comes from the
    # server's start-up lines and generate's --json settings, kept with the results.
    return {
        "cpu": cpu_facts(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "packages": {p: package(p) for p in ("specmlx", "mlx", "mlx-lm", "uvicorn", "httpx")},
        "load_average": os.getloadavg(),
    }


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


# ---------------------------------------------------------------- the server


class Server:
    """`specmlx serve` as a subprocess on 127.0.0.1 and a port the OS picks (--port 0)."""

    def __init__(self, target: Path, draft: Path, env: dict | None = None):
        self.env = env or {}
        self.command = [
            sys.executable, "-m", "specmlx", "serve",
            "-m", str(target), "-d", str(draft),
            "--host", "127.0.0.1", "--port", "0",
        ]  # fmt: skip
        started = time.perf_counter()
        self.process = subprocess.Popen(
            self.command, stderr=subprocess.PIPE, text=True, env={**os.environ, **self.env}
        )
        self.log: list[str] = []
        self._url = threading.Event()
        self.url = ""
        # Drained for the server's whole life: a full pipe would block its logging.
        threading.Thread(target=self._read_log, daemon=True).start()
        if not self._url.wait(180) or not self.url:
            self.process.kill()
            raise RuntimeError("specmlx serve did not start:\n" + "".join(self.log))
        deadline = time.monotonic() + 60
        while True:
            try:
                self.health = httpx.get(f"{self.url}/health", timeout=5).json()
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError("no /health:\n" + "".join(self.log)) from None
                time.sleep(0.05)
        self.ready_s = time.perf_counter() - started
        self.model_id = httpx.get(f"{self.url}/v1/models").json()["data"][0]["id"]

    def _read_log(self) -> None:
        for line in self.process.stderr:
            self.log.append(line)
            found = re.search(r"serving .* at (http://127\.0\.0\.1:\d+)/v1", line)
            if found and not self.url:
                self.url = found[1]
                self._url.set()
        self._url.set()  # the process ended: let the waiter see it

    def stop(self) -> dict:
        """SIGINT, as Ctrl-C would send it; how long it took to exit, and how."""
        started = time.perf_counter()
        self.process.send_signal(signal.SIGINT)
        try:
            rc = self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            rc = None
        log = "".join(self.log)
        return {
            "returncode": rc,
            "exit_s": time.perf_counter() - started,
            "exited": rc is not None,
            "traceback_in_log": "Traceback" in log,
        }


def stream_chat(http: httpx.Client, model: str, prompt: str, gamma, max_tokens: int) -> dict:
    """One streamed chat completion, timed as a client sees it."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "num_draft": gamma,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    pieces, times, server_stats, usage = [], [], None, None
    sent = time.perf_counter()
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the stream reported an error: {chunk['error']}")
            server_stats = chunk.get("specmlx", server_stats)
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:  # the opening chunk's "" is no content
                    pieces.append(text)
                    times.append(time.perf_counter())
    done = time.perf_counter()
    tokens = usage["completion_tokens"]
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    return {
        "text": "".join(pieces),
        "tokens": tokens,
        "deltas": len(pieces),
        "ttft_s": times[0] - sent,
        # The brief's client-side rate: the tokens after the first over first -> last delta.
        "decode_tps": (tokens - 1) / span if span else 0.0,
        "span_s": span,  # first -> last content delta
        "total_s": done - sent,
        "sent_at": sent,
        "done_at": done,
        "server": server_stats,  # the engine's own figures inside the server
    }


def run_generate(target: Path, draft: Path, prompt: str, gamma, max_tokens: int) -> dict:
    """`specmlx generate --json` in a fresh process; its own stats, as a user gets them."""
    command = [
        sys.executable, "-m", "specmlx", "generate",
        "-m", str(target), "-d", str(draft),
        "-n", str(max_tokens), "-t", "0", "-g", str(gamma), "--json", prompt,
    ]  # fmt: skip
    out, wall = timed(
        lambda: subprocess.run(command, capture_output=True, text=True, check=True, timeout=300)
    )
    result = json.loads(out.stdout)
    stats = result["stats"]
    return {
        "text": result["text"],
        "tokens": stats["tokens"],
        "ttft_s": stats["ttft"],
        "decode_tps": stats["decode_tps"],
        "prefill_tokens": stats["prefill_tokens"],
        "acceptance": stats["acceptance"],
        "tokens_per_pass": stats["tokens_per_pass"],
        "rounds_by_gamma": stats["rounds_by_gamma"],
        "cold_start_s": result["timings"]["cold_start_s"],
        "process_wall_s": wall,
        "settings": result["settings"],
    }


# ---------------------------------------------------------------- 1. overhead


def overhead(server: Server, target: Path, draft: Path, runs: int) -> dict:
    out = {}
    with httpx.Client(base_url=server.url, timeout=300) as http:
        for gamma in GAMMAS:
            say(f"overhead, γ = {gamma}: a warm-up request (kept, not in the medians)")
            warmup = stream_chat(http, server.model_id, PROMPT, gamma, MAX_TOKENS)
            pairs = []
            for i in range(runs):
                order = "AB" if i % 2 == 0 else "BA"
                pair = {"order": order}
                for side in order:
                    if side == "A":
                        pair["server"] = stream_chat(
                            http, server.model_id, PROMPT, gamma, MAX_TOKENS
                        )
                    else:
                        pair["generate"] = run_generate(target, draft, PROMPT, gamma, MAX_TOKENS)
                s, g = pair["server"], pair["generate"]
                pair["same_text"] = s["text"] == g["text"]
                pair["tps_ratio"] = s["decode_tps"] / g["decode_tps"]
                pair["ttft_ratio"] = s["ttft_s"] / g["ttft_s"]
                pair["per_token_overhead_ms"] = 1e3 * (1 / s["decode_tps"] - 1 / g["decode_tps"])
                pair["engine_tps_ratio"] = s["server"]["decode_tps"] / g["decode_tps"]
                pairs.append(pair)
                say(
                    f"  {i + 1}/{runs} {order}: server {s['decode_tps']:.2f} tok/s "
                    f"ttft {s['ttft_s']:.3f} s | generate {g['decode_tps']:.2f} tok/s "
                    f"ttft {g['ttft_s']:.3f} s | same text {pair['same_text']}"
                )
            out[str(gamma)] = {"warmup": warmup, "pairs": pairs, "summary": summarize(pairs)}
    return out


def summarize(pairs: list[dict]) -> dict:
    s = [p["server"] for p in pairs]
    g = [p["generate"] for p in pairs]
    server_tps, generate_tps = (
        median(x["decode_tps"] for x in s),
        median(x["decode_tps"] for x in g),
    )
    return {
        "runs": len(pairs),
        "server_ttft_s": median(x["ttft_s"] for x in s),
        "generate_ttft_s": median(x["ttft_s"] for x in g),
        "server_decode_tps": server_tps,
        "generate_decode_tps": generate_tps,
        # The engine's figure inside the server, defined as generate's (tokens / first
        # round -> last token): apart from the client-side one, it tells the HTTP path's
        # share from the engine's.
        "server_engine_decode_tps": median(x["server"]["decode_tps"] for x in s),
        "server_engine_ttft_s": median(x["server"]["ttft_s"] for x in s),
        "server_prefill_tokens": median(x["server"]["prefill_tokens"] for x in s),
        "generate_prefill_tokens": median(x["prefill_tokens"] for x in g),
        "tps_ratio_median": median(p["tps_ratio"] for p in pairs),
        "engine_tps_ratio_median": median(p["engine_tps_ratio"] for p in pairs),
        # the same request, client-side over the engine's own: the HTTP path plus the
        # client-side rate's leaving out of the first round
        "client_over_engine_tps_median": median(
            x["decode_tps"] / x["server"]["decode_tps"] for x in s
        ),
        "server_tokens_per_pass": median(x["server"]["tokens_per_pass"] for x in s),
        "http_ms_per_token_median": median(http_ms_per_token(x) for x in s),
        "ttft_ratio_median": median(p["ttft_ratio"] for p in pairs),
        "per_token_overhead_ms_median": median(p["per_token_overhead_ms"] for p in pairs),
        "per_token_overhead_ms_of_medians": 1e3 * (1 / server_tps - 1 / generate_tps),
        "same_text": sum(p["same_text"] for p in pairs),
    }


def http_ms_per_token(reply: dict) -> float:
    """What the HTTP path adds per token, from one request's own two clocks: the client's
    first -> last delta against the engine's first -> last token, spread over the tokens
    between. The engine's span is decode_time - ttft, which holds when the request
    prefilled nothing (its prompt was cached: ttft is then the first round alone)."""
    engine = reply["server"]
    engine_span = reply["tokens"] / engine["decode_tps"] - engine["ttft_s"]
    return 1e3 * (reply["span_s"] - engine_span) / (reply["tokens"] - 1)


# ---------------------------------------------------------------- 2. concurrency


def concurrent_pass(server: Server) -> list[dict]:
    """CLIENTS clients, each with its own connection, sending PER_CLIENT requests in turn."""
    start_line = threading.Barrier(CLIENTS)

    def one_client(c: int) -> list[dict]:
        prompts = PROMPTS[c * PER_CLIENT : (c + 1) * PER_CLIENT]
        with httpx.Client(base_url=server.url, timeout=600) as http:
            start_line.wait()  # every client sends its first request at the same moment
            return [request(http, server, p) for p in prompts]

    with ThreadPoolExecutor(CLIENTS) as pool:
        return [r for rs in pool.map(one_client, range(CLIENTS)) for r in rs]


def sequential_pass(server: Server) -> list[dict]:
    with httpx.Client(base_url=server.url, timeout=600) as http:
        return [request(http, server, p) for p in PROMPTS]


def request(http: httpx.Client, server: Server, prompt: str) -> dict:
    reply = stream_chat(http, server.model_id, prompt, CONCURRENT_GAMMA, CONCURRENT_TOKENS)
    return {"prompt": prompt, **reply}


def concurrency(server: Server, rounds: int) -> dict:
    """Concurrent and sequential passes in the order C S, S C, ... (a round each), so that a
    busy stretch of the shared machine is split between the two kinds alike.

    Every prompt shares the chat template's system prompt, and the server's pool hands a
    request the idle Session with the longest common prefix, however short: so here one
    Session serves every request in turn, and each prefills only its own user message,
    in both kinds of pass alike (prefill tokens are kept per request to show it)."""
    pair = ["concurrent", "sequential"]
    kinds = [kind for r in range(rounds) for kind in (pair if r % 2 == 0 else pair[::-1])]
    passes = []
    for kind in kinds:
        say(f"concurrency: a {kind} pass, {len(PROMPTS)} requests of {CONCURRENT_TOKENS} tokens")
        requests = concurrent_pass(server) if kind == "concurrent" else sequential_pass(server)
        summary = pass_summary(requests)
        passes.append({"kind": kind, "summary": summary, "requests": requests})
        say(
            f"  {summary['tokens']} tokens in {summary['wall_s']:.1f} s = "
            f"{summary['tokens_per_s']:.2f} tok/s (engine median "
            f"{summary['engine_decode_tps_median']:.2f})"
        )
    out: dict = {"order": kinds}
    for kind in ("concurrent", "sequential"):
        mine = [p["summary"] for p in passes if p["kind"] == kind]
        tokens, wall = sum(p["tokens"] for p in mine), sum(p["wall_s"] for p in mine)
        out[kind] = {
            "passes": len(mine),
            "tokens": tokens,
            "wall_s": wall,
            "tokens_per_s": tokens / wall,  # over every pass of this kind
            "tokens_per_s_by_pass": [p["tokens_per_s"] for p in mine],
        }
    out["throughput_ratio"] = out["concurrent"]["tokens_per_s"] / out["sequential"]["tokens_per_s"]
    # Greedy: a request's text must not depend on what else was queued with it.
    first = next(p for p in passes if p["kind"] == "sequential")
    alone = {r["prompt"]: r["text"] for r in first["requests"]}
    others = [r for p in passes if p is not first for r in p["requests"]]
    out["same_text"] = sum(r["text"] == alone[r["prompt"]] for r in others)
    out["compared_texts"] = len(others)
    out["passes"] = passes
    return out


def pass_summary(requests: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in requests)
    wall = max(r["done_at"] for r in requests) - min(r["sent_at"] for r in requests)
    return {
        "requests": len(requests),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        # The engine's own rate per request: a pass whose engine ran slower met a busy
        # machine, not a slower server path.
        "engine_decode_tps_median": median(r["server"]["decode_tps"] for r in requests),
        "prefill_tokens": sum(r["server"]["prefill_tokens"] for r in requests),
        "ttft_s_median": median(r["ttft_s"] for r in requests),
        "ttft_s_max": max(r["ttft_s"] for r in requests),
        "latency_s_median": median(r["total_s"] for r in requests),
        "latency_s_max": max(r["total_s"] for r in requests),
    }


# ---------------------------------------------------------------- --batch


BATCH_PROMPTS = [PROMPTS[0], PROMPTS[1], PROMPTS[4], PROMPTS[6]]  # four Python functions
BARS = {"throughput_ratio": 2.0, "ttft_s_max": 1.5, "one_client_ratio": 0.97}


def one_client(server: Server, prompts: list[str], gamma, max_tokens: int) -> list[dict]:
    """One client sending each prompt in turn."""
    with httpx.Client(base_url=server.url, timeout=600) as http:
        return [
            {"prompt": p, **stream_chat(http, server.model_id, p, gamma, max_tokens)}
            for p in prompts
        ]


def many_clients(server: Server, prompts: list[str], gamma, max_tokens: int) -> list[dict]:
    """A client per prompt, each on its own connection, all sending at the same moment."""
    start_line = threading.Barrier(len(prompts))

    def client(prompt: str) -> dict:
        with httpx.Client(base_url=server.url, timeout=600) as http:
            start_line.wait()
            return {
                "prompt": prompt,
                **stream_chat(http, server.model_id, prompt, gamma, max_tokens),
            }

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(client, prompts))


def batching(
    server: Server, baseline: Server | None, rounds: int, gamma, max_tokens: int, clients: int
) -> dict:
    """One client (O) and `clients` at once (F) in the order O F, F O, ...; with a baseline
    server, its one-client pass (B) beside each O. Totals over every pass of a kind."""
    prompts = (BATCH_PROMPTS * clients)[:clients]
    say("batching: a warm-up request on each server (kept, not in the totals)")
    warmup = [one_client(s, prompts[:1], gamma, max_tokens) for s in (server, baseline) if s]
    kinds = []
    for r in range(rounds):
        pair = ["one", "many"] if r % 2 == 0 else ["many", "one"]
        if baseline is not None:
            pair.insert(pair.index("one") + (r % 2), "unbatched")
        kinds += pair
    passes = []
    for kind in kinds:
        say(f"batching: a {kind} pass, {len(prompts)} requests of {max_tokens} tokens")
        if kind == "many":
            replies = many_clients(server, prompts, gamma, max_tokens)
        else:
            replies = one_client(
                baseline if kind == "unbatched" else server, prompts, gamma, max_tokens
            )
        summary = pass_summary(replies)
        passes.append({"kind": kind, "summary": summary, "requests": replies})
        say(
            f"  {summary['tokens']} tokens in {summary['wall_s']:.1f} s = "
            f"{summary['tokens_per_s']:.2f} tok/s, TTFT max {summary['ttft_s_max']:.2f} s"
        )
    out: dict = {"order": kinds, "warmup": warmup, "passes": passes}
    for kind in dict.fromkeys(kinds):
        mine = [p["summary"] for p in passes if p["kind"] == kind]
        tokens, wall = sum(p["tokens"] for p in mine), sum(p["wall_s"] for p in mine)
        out[kind] = {
            "tokens": tokens,
            "wall_s": wall,
            "tokens_per_s": tokens / wall,
            "ttft_s_max": max(p["ttft_s_max"] for p in mine),
        }
    out["throughput_ratio"] = out["many"]["tokens_per_s"] / out["one"]["tokens_per_s"]
    if baseline is not None:
        out["one_client_ratio"] = out["one"]["tokens_per_s"] / out["unbatched"]["tokens_per_s"]
    # Greedy: each reply must be the one its request gets alone (the first one-client pass).
    alone = {
        r["prompt"]: r["text"] for r in next(p for p in passes if p["kind"] == "one")["requests"]
    }
    others = [r for p in passes for r in p["requests"] if p["kind"] != "one"]
    out["same_text"], out["compared_texts"] = (
        sum(r["text"] == alone[r["prompt"]] for r in others),
        len(others),
    )
    out["batch_stats"] = [
        r["server"].get("batch") for p in passes if p["kind"] == "many" for r in p["requests"]
    ]
    return out


def result_head(args: argparse.Namespace, started: float, facts: dict) -> dict:
    """What every result of this script opens with: the command, commit, time, machine."""
    return {
        "schema": 1,
        "command": " ".join(portable(a) if os.path.isabs(a) else a for a in sys.argv),
        "commit": git_commit(),
        "duration_s": time.perf_counter() - started,
        "machine": facts,
        "load_average_end": os.getloadavg(),
        "models": {"target": portable(args.model), "draft": portable(args.draft)},
    }


def batch_markdown(result: dict) -> str:
    b, facts = result["batching"], result["machine"]
    bars = [
        ("total tok/s, many clients / one", b["throughput_ratio"], "≥", BARS["throughput_ratio"]),
        ("slowest first token, many clients (s)", b["many"]["ttft_s_max"], "≤", BARS["ttft_s_max"]),
    ]
    if "one_client_ratio" in b:
        bars.append(
            (
                "one client, batching / unbatched server",
                b["one_client_ratio"],
                "≥",
                BARS["one_client_ratio"],
            )
        )
    lines = [
        "# `specmlx serve` continuous batching — Qwen2.5-Coder 1.5B + 0.5B INT4",
        "",
        "```",
        result["command"],
        "```",
        "",
        f"CPU: {cpu_line(facts)}; commit {result['commit']}; load average "
        f"{fmt_load(facts['load_average'])} at the start, "
        f"{fmt_load(result['load_average_end'])} at the end.",
        f"{len(b['passes'][0]['requests'])} code prompts, T = 0, "
        f"{result['settings']['max_tokens']} tokens, γ {result['settings']['gamma']}, "
        f"passes in the order {', '.join(b['order'])}.",
        "",
        "| pass | tokens | wall s | tok/s | TTFT median / max |",
        "| --- | --- | --- | --- | --- |",
    ]
    for i, one in enumerate(b["passes"], 1):
        p = one["summary"]
        lines.append(
            f"| {i}. {one['kind']} | {p['tokens']} | {p['wall_s']:.1f} | {p['tokens_per_s']:.2f} "
            f"| {p['ttft_s_median']:.2f} / {p['ttft_s_max']:.2f} s |"
        )
    lines += ["", "| bar | measured | wanted | met |", "| --- | --- | --- | --- |"]
    for name, value, sign, bar in bars:
        met = value >= bar if sign == "≥" else value <= bar
        lines.append(f"| {name} | {value:.3f} | {sign} {bar} | {'yes' if met else 'NO'} |")
    lines += [
        "",
        f"Replies equal to the same request alone: {b['same_text']}/{b['compared_texts']}.",
        f"What the batch did (each many-clients reply's stats): {b['batch_stats'][:4]}",
        "",
    ]
    return "\n".join(lines)


def batch_main(args) -> None:
    started = time.perf_counter()
    facts = machine_facts()
    say(f"CPU: {cpu_line(facts)}")
    server = Server(args.model, args.draft)
    baseline = Server(args.model, args.draft, {"SPECMLX_MAX_BATCH": "1"}) if args.baseline else None
    try:
        part = batching(server, baseline, args.rounds, args.gamma, args.max_tokens, args.clients)
    finally:
        stops = [s.stop() for s in (server, baseline) if s]
    result = {
        **result_head(args, started, facts),
        "settings": {
            "max_tokens": args.max_tokens,
            "gamma": args.gamma,
            "clients": args.clients,
            "rounds": args.rounds,
            "prompts": BATCH_PROMPTS,
            "bars": BARS,
        },
        "server": {"log": server.log, "baseline_log": baseline.log if baseline else None},
        "batching": part,
        "stop": stops,
    }
    out = args.out or RESULTS / "server-batch-qwen2.5-coder.json"
    md = args.md or RESULTS / "server-batch.md"
    out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    md.write_text(batch_markdown(result))
    say(f"wrote {out} and {md} in {result['duration_s'] / 60:.1f} min")


# ---------------------------------------------------------------- the report


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cpu_line(facts: dict) -> str:
    cpu = facts["cpu"]
    flags = set(cpu.get("flags", []))
    isa = [
        name
        for name, flag in (
            ("AVX-512F", "avx512f"),
            ("AVX-512 VNNI", "avx512_vnni"),
            ("AVX-512 BF16", "avx512_bf16"),
            ("AVX-VNNI", "avx_vnni"),
            ("AVX2", "avx2"),
        )
        if flag in flags
    ]
    zen = " (Zen 5)" if (cpu.get("cpu family"), cpu.get("model")) == ("26", "2") else ""
    return (
        f"{cpu.get('model name', '?')} family {cpu.get('cpu family', '?')} model "
        f"{cpu.get('model', '?')}{zen}, {facts['cores_usable']} cores, {', '.join(isa)}"
    )


def markdown(result: dict) -> str:
    facts = result["machine"]
    lines = [
        "# `specmlx serve` overhead and concurrency — Qwen2.5-Coder 1.5B + 0.5B INT4",
        "",
        "What the HTTP server costs over `specmlx generate` for one streamed request, and",
        "what 8 concurrent clients get from a server that decodes one request at a time.",
        "Raw figures: `server-overhead-qwen2.5-coder.json`.",
        "",
        "```",
        result["command"],
        "```",
        "",
        f"Target `{result['models']['target']}`, draft `{result['models']['draft']}`.",
        "",
        f"CPU: {cpu_line(facts)}; {facts['platform']}; mlx {facts['packages']['mlx']}, "
        f"mlx-lm {facts['packages']['mlx-lm']}; commit {result['commit']}; "
        f"{result['duration_s'] / 60:.1f} min; load average {fmt_load(facts['load_average'])} "
        f"at the start, {fmt_load(result['load_average_end'])} at the end.",
        "",
        f"## 1. One request: server (client-side) vs `generate --json` (own stats), "
        f"N = {result['settings']['runs']} pairs",
        "",
        f"Prompt {PROMPT!r}, chat template, T = 0, max_tokens {MAX_TOKENS}; pairs "
        "alternate AB / BA; the server had one warm-up request per γ first.",
        "",
        "| γ | server tok/s (client) | server tok/s (engine) | generate tok/s | "
        "server / generate | overhead ms/token | HTTP path ms/token | TTFT server | "
        "TTFT generate | same greedy text |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for gamma, part in result["overhead"].items():
        s = part["summary"]
        lines.append(
            f"| {gamma} | {s['server_decode_tps']:.2f} | {s['server_engine_decode_tps']:.2f} "
            f"| {s['generate_decode_tps']:.2f} | {s['tps_ratio_median']:.3f}× "
            f"| {s['per_token_overhead_ms_median']:+.2f} | {s['http_ms_per_token_median']:+.2f} "
            f"| {s['server_ttft_s'] * 1e3:.0f} ms "
            f"| {s['generate_ttft_s'] * 1e3:.0f} ms | {s['same_text']}/{s['runs']} |"
        )
    lines += [
        "",
        "Medians over the pairs; server / generate and ms/token are the medians of each "
        "pair's figure (ms/token = 1/tps_server − 1/tps_generate, client-side server rate). "
        "Client-side tok/s is the tokens after the first over first → last content delta; "
        "the engine's (and generate's) is all tokens over first round → last token. "
        "HTTP path ms/token: the same request's client first → last delta minus the "
        "engine's first → last token, over the tokens between (see `http_ms_per_token`).",
        "",
    ]
    c = result["concurrency"]
    lines += [
        f"## 2. {CLIENTS} concurrent streaming clients × {PER_CLIENT} requests vs the same "
        f"{CLIENTS * PER_CLIENT} one after another",
        "",
        f"T = 0, {CONCURRENT_TOKENS} tokens, γ = {CONCURRENT_GAMMA}, {len(PROMPTS)} different "
        f"prompts, passes in the order {', '.join(c['order'])}.",
        "",
        "| pass | tokens | wall s | tokens/s | engine tok/s (median) | prefill tokens | "
        "TTFT median / max | latency median / max |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, one in enumerate(c["passes"], 1):
        p = one["summary"]
        lines.append(
            f"| {i}. {one['kind']} | {p['tokens']} | {p['wall_s']:.1f} | {p['tokens_per_s']:.2f} "
            f"| {p['engine_decode_tps_median']:.2f} | {p['prefill_tokens']} "
            f"| {p['ttft_s_median']:.2f} / {p['ttft_s_max']:.2f} s "
            f"| {p['latency_s_median']:.2f} / {p['latency_s_max']:.2f} s |"
        )
    cc, sq = c["concurrent"], c["sequential"]
    stop = result["stop"]
    lines += [
        "",
        f"Over every pass of a kind: concurrent {cc['tokens_per_s']:.2f} tok/s, sequential "
        f"{sq['tokens_per_s']:.2f} tok/s, concurrent / sequential "
        f"{c['throughput_ratio']:.3f}×. Greedy texts equal to the first sequential pass's: "
        f"{c['same_text']}/{c['compared_texts']}.",
        "",
        f"Stop: SIGINT → exit code {stop['returncode']} after {stop['exit_s']:.2f} s"
        f"{'; a traceback in its log' if stop['traceback_in_log'] else ', no traceback'}. "
        f"Server ready {result['server']['ready_s']:.1f} s after launch.",
        "",
        "## What it means",
        "",
        *reading(result),
        "",
    ]
    return "\n".join(lines)


def reading(result: dict) -> list[str]:
    """The figures in words; every number here is one of the tables'."""

    def prefills(side: str) -> str:
        parts = result["overhead"].values()
        return " / ".join(f"{p['summary'][f'{side}_prefill_tokens']:.0f}" for p in parts)

    summaries = [part["summary"] for part in result["overhead"].values()]
    http = " / ".join(f"{s['http_ms_per_token_median']:+.2f}" for s in summaries)
    token_ms = " / ".join(f"{1e3 / s['server_engine_decode_tps']:.0f}" for s in summaries)
    out = [
        f"- Per token, the HTTP path adds nothing this run can see: {http} ms (γ = "
        + " / ".join(result["overhead"])
        + f") against {token_ms} ms a token takes to decode. The overhead column, 1/tps_server "
        "− 1/tps_generate, reads negative (the server looks faster), for the two reasons "
        "below, neither of them HTTP.",
    ]
    for gamma, part in result["overhead"].items():
        s = part["summary"]
        out.append(
            f"- γ = {gamma}: server / generate {s['tps_ratio_median']:.3f}× client-side "
            f"({s['per_token_overhead_ms_median']:+.2f} ms/token); the engine inside the "
            f"server ran {s['engine_tps_ratio_median']:.3f}× generate's rate, and the "
            f"client-side rate was {s['client_over_engine_tps_median']:.3f}× the engine's "
            f"for the same requests; the HTTP path itself, timed on both clocks of each "
            f"request, {s['http_ms_per_token_median']:+.2f} ms/token."
        )
    out += [
        "- The client-side rate leaves the first round out, and a speculative round "
        "emits several tokens at once (the first delta's burst counts as taking no time), "
        "so it reads above the engine's figure for the same request; that is definition, "
        "not speed. Between server and generate the engines differ too: each generate is a "
        "fresh process whose first rounds run cold, the server's engine is warm. (With "
        "γ = 4 both ran the same rounds; auto follows timings, and the server's Session "
        "keeps what its policy learnt between requests, so auto's rounds differ.)",
        "- TTFT is not like for like either: a server request finds its prompt's prefix "
        f"already cached (prefill {prefills('server')} tokens vs generate's "
        f"{prefills('generate')}) and warm kernels, while generate's TTFT is a new "
        "process's first forward pass (after its cold start, which its ttft leaves out).",
    ]
    c = result["concurrency"]
    conc = [p["summary"] for p in c["passes"] if p["kind"] == "concurrent"]
    seq = [p["summary"] for p in c["passes"] if p["kind"] == "sequential"]
    out.append(
        f"- Concurrency: {c['throughput_ratio']:.3f}× the sequential throughput. One decode "
        "at a time means concurrent clients share the same tokens/s, and queueing shows as "
        f"latency instead: TTFT median {median(p['ttft_s_median'] for p in conc):.1f}"
        f" s (max {max(p['ttft_s_max'] for p in conc):.1f} s) with {CLIENTS} clients, "
        f"{median(p['ttft_s_median'] for p in seq):.2f} s one by one."
    )
    health, stop = result["server"]["health_end"], result["stop"]
    out += [
        "",
        "Seen of the server in this run (not fixed here):",
        "",
        f"- One Session served all {len(PROMPTS) + 1} different prompts (/health at the end: "
        f"{health['sessions']} session, {health['cache_bytes'] / 2**20:.0f} MiB): the pool hands "
        "a request the idle Session with the longest common prefix however short, and every "
        "chat prompt shares the template's system prompt, so each request takes over the "
        "last one's caches. Here that costs only the user message's prefill; with several "
        "conversations interleaved, each turn would find another's cache and prefill its "
        "whole history (`specmlx/server/pool.py`, `SessionPool.take`).",
        f"- The model id is the --model argument as given, here a full path "
        f"({result['server']['model_id']!r}); /v1/models lists that, and clients must send "
        "it (or the directory name).",
        f"- SIGINT stops it in {stop['exit_s']:.1f} s, no traceback, exit code "
        f"{stop['returncode']} (specmlx's 'interrupted', as for Ctrl-C in generate), not 0.",
    ]
    return out


def fmt_load(load) -> str:
    return " / ".join(f"{x:.2f}" for x in load)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help=f"default: $SPECMLX_HOME/models/{TARGET}")
    parser.add_argument("--draft", type=Path, help=f"default: $SPECMLX_HOME/models/{DRAFT}")
    parser.add_argument("--runs", type=int, default=5, help="A/B pairs per γ")
    parser.add_argument("--out", type=Path, help="default: results/server-overhead-*.json")
    parser.add_argument("--md", type=Path, help="default: results/server-overhead.md")
    parser.add_argument("--batch", action="store_true", help="measure continuous batching")
    parser.add_argument(
        "--baseline", action="store_true", help="--batch: also a server of one at a time"
    )
    parser.add_argument("--clients", type=int, default=4, help="--batch: clients at once")
    parser.add_argument("--max-tokens", type=int, default=128, help="--batch: tokens a reply")
    parser.add_argument("--gamma", default="auto", help="--batch: num_draft of each request")
    parser.add_argument(
        "--rounds", type=int, default=2, help="concurrent + sequential pass pairs (C S, S C)"
    )
    parser.add_argument(
        "--from-json", type=Path, help="write the markdown from a saved JSON; run nothing"
    )
    args = parser.parse_args(argv)
    if args.model is None or args.draft is None:
        from specmlx.paths import home  # not specmlx itself: this client needs no mlx

        args.model = args.model or home() / "models" / TARGET
        args.draft = args.draft or home() / "models" / DRAFT
    if args.gamma != "auto":
        args.gamma = int(args.gamma)
    if args.batch:
        if args.from_json:
            args.md.write_text(batch_markdown(json.loads(args.from_json.read_text())))
        else:
            batch_main(args)
        return
    args.out = args.out or RESULTS / "server-overhead-qwen2.5-coder.json"
    args.md = args.md or RESULTS / "server-overhead.md"
    if args.from_json:
        args.md.write_text(markdown(json.loads(args.from_json.read_text())))
        return

    started = time.perf_counter()
    facts = machine_facts()
    say(f"CPU: {cpu_line(facts)}")
    server = Server(args.model, args.draft)
    say(f"server at {server.url} ({server.model_id}), ready in {server.ready_s:.1f} s")
    try:
        part1 = overhead(server, args.model, args.draft, args.runs)
        part2 = concurrency(server, args.rounds)
        health = httpx.get(f"{server.url}/health").json()
    finally:
        stop = server.stop()
    say(f"stopped: {stop}")

    result = {
        **result_head(args, started, facts),
        "settings": {
            "prompt": PROMPT,
            "gammas": list(GAMMAS),
            "max_tokens": MAX_TOKENS,
            "runs": args.runs,
            "clients": CLIENTS,
            "per_client": PER_CLIENT,
            "concurrent_tokens": CONCURRENT_TOKENS,
            "concurrent_gamma": CONCURRENT_GAMMA,
            "rounds": args.rounds,
            "prompts": PROMPTS,
        },
        "server": {
            "command": [portable(a) if os.path.isabs(a) else a for a in server.command],
            "ready_s": server.ready_s,
            "model_id": portable(server.model_id),
            "log": server.log,  # its start-up lines: weights mode, INT4 kernel, BLAS
            "health_start": server.health,
            "health_end": health,
        },
        "overhead": part1,
        "concurrency": part2,
        "stop": stop,
    }
    args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    args.md.write_text(markdown(result))
    say(f"wrote {args.out} and {args.md} in {result['duration_s'] / 60:.1f} min")
