"""The target split over two ranks on localhost (MLX's ring backend), drafts on rank 0.

Two processes are started the way mlx.launch starts them: MLX_RANK and MLX_HOSTFILE (a
JSON list of each rank's "ip:port"), one run of tests/ranks_worker.py doing every config
(start-up is most of the cost); one test runs `mlx.launch -n 2 --backend ring` itself.
What holds, and is checked:

- greedy speculation (auto γ, a fixed γ, trees, prompt lookup) on two ranks equals the
  two ranks' target alone, token for token, tensor parallel (qwen2, llama, qwen3_moe,
  qwen2 in INT4 on the native kernel, and glm4_moe drafting with its MTP head) and
  pipeline parallel (qwen3_next, which mlx-lm can only pipeline, alone and with its MTP
  head, and qwen2 dense and INT4); coupled sampling at T = 1 too;
- both ranks emit the same tokens, rejection sampling included;
- against one process: a pipeline split gives the same logits bit for bit (each layer runs
  whole, on the same kernels: the native INT4 kernel included), a tensor split does not
  (each rank sums half of every dot product and the all-sum adds the halves: ~1e-6
  apart), yet its greedy tokens are the same here;
- rejection sampling at T = 1 on two ranks follows the target's exact distribution of the
  first two tokens (chi-square, 1,200 runs: see test_rejection_sampling_...);
- generate under mlx.launch, chat with input on rank 0 alone, and a killed rank (either)
  ending the other in one line within seconds.
The lockstep's protocol and the split's choice are also checked in one process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from ranks_worker import PROMPT, tokens
from stats_util import ALPHA, chi_square_pvalue, exact_joint

import specmlx
from specmlx import distributed, lockstep
from specmlx.cli import main
from specmlx.tiny import build_tiny_model

HERE = Path(__file__).parent
PY = sys.executable
CHI_PROMPT = [5, 17, 42, 99]
CHI_RUNS = 1200


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def start(argv: list[str], tmp: Path, stdin: list | None = None, **kw) -> list[subprocess.Popen]:
    """Two ranks of `argv`, as mlx.launch starts them on localhost with the ring backend."""
    hostfile = tmp / f"hosts-{time.monotonic_ns()}.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
    procs = []
    for rank in range(2):
        env = {**os.environ, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank)}
        feed = subprocess.PIPE if stdin and stdin[rank] is not None else subprocess.DEVNULL
        procs.append(
            subprocess.Popen(
                argv, env=env, stdin=feed, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw
            )
        )
    return procs


def finish(procs, stdin=None, timeout=240) -> list[tuple[int, str, str]]:
    out = []
    for rank, p in enumerate(procs):
        data = stdin[rank].encode() if stdin and stdin[rank] is not None else None
        try:
            o, e = p.communicate(data, timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, o.decode(errors="replace"), e.decode(errors="replace")))
    return out


def int4(path: Path, seed: int) -> Path:
    """A tiny qwen2 in MLX's INT4 (g32): the native kernel's layout."""
    build_tiny_model(path, seed=seed)
    model = specmlx.load(path, native=False)
    nn.quantize(model.module, group_size=32, bits=4)
    weights = dict(tree_flatten(model.module.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = json.loads((path / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    return path


CONFIGS = {  # name: (architecture, split, what: "" dense, "int4", or "mtp": its MTP head drafts)
    "qwen2-tensor": ("qwen2", "tensor", ""),
    "llama-tensor": ("llama", "tensor", ""),
    "qwen3_moe-tensor": ("qwen3_moe", "tensor", ""),
    "qwen3_next-auto": ("qwen3_next", "auto", ""),  # mlx-lm pipelines it only
    "qwen2-pipeline": ("qwen2", "pipeline", ""),
    "qwen2-int4-tensor": ("qwen2", "tensor", "int4"),
    "qwen2-int4-pipeline": ("qwen2", "pipeline", "int4"),
    "glm4_moe-mtp-tensor": ("glm4_moe", "tensor", "mtp"),
    "qwen3_next-mtp-pipeline": ("qwen3_next", "pipeline", "mtp"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ranks")
    pairs = {}
    for arch in ("qwen2", "llama", "qwen3_moe", "qwen3_next"):
        target = build_tiny_model(root / f"{arch}-t", arch=arch, seed=0)
        draft = build_tiny_model(root / f"{arch}-d", arch=arch, seed=1, perturb_from=target)
        pairs[arch] = (target, draft)
    pairs["qwen2-int4"] = (int4(root / "int4-t", 0), int4(root / "int4-d", 1))
    for arch in ("glm4_moe", "qwen3_next"):
        pairs[f"{arch}-mtp"] = (build_tiny_model(root / f"{arch}-mtp", arch=arch, mtp=True), "mtp")
    chi_target = build_tiny_model(root / "chi-t", seed=0, layers=1)
    chi_draft = build_tiny_model(
        root / "chi-d", seed=1, layers=1, perturb_from=chi_target, noise=0.1
    )
    pairs["chi"] = (chi_target, chi_draft)
    endless = build_tiny_model(root / "endless", seed=0)
    config = json.loads((endless / "config.json").read_text())
    config.update(eos_token_id=config["vocab_size"] - 1, max_position_embeddings=1_000_000)
    (endless / "config.json").write_text(json.dumps(config))
    (endless / "generation_config.json").unlink()
    pairs["endless"] = (endless, pairs["qwen2"][1])
    return {"root": root, **pairs}


def pair(models, name: str) -> tuple[Path, Path | str]:
    arch, _, what = CONFIGS[name]
    return models[f"{arch}-{what}" if what else arch]


@pytest.fixture(scope="module")
def two_ranks(models) -> dict:
    """Every config's results on two ranks: {"ranks": [rank 0's, rank 1's], "out": dir}."""
    out = models["root"] / "out"
    out.mkdir()
    configs = [
        {
            "name": name,
            "target": str(pair(models, name)[0]),
            "draft": str(pair(models, name)[1]),
            "shard": shard,
        }
        for name, (_, shard, _) in CONFIGS.items()
    ]
    chi_target, chi_draft = models["chi"]
    chi = {
        "target": str(chi_target),
        "draft": str(chi_draft),
        "shard": "tensor",
        "prompt": CHI_PROMPT,
        "runs": CHI_RUNS,
    }
    spec = out / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "configs": configs, "chi": chi}))
    results = finish(start([PY, str(HERE / "ranks_worker.py"), str(spec)], out))
    for rank, (code, _, err) in enumerate(results):
        if code != 0 and "[ring]" in err and not (out / f"rank{rank}.json").exists():
            pytest.skip(f"the ring backend cannot run here: {err.strip().splitlines()[-1]}")
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return {"ranks": ranks, "out": out}


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_speculation_on_two_ranks_equals_their_target_alone(two_ranks, name):
    got = two_ranks["ranks"][0]["configs"][name]
    for variant in ("auto", "fixed", "tree", "lookup"):
        assert got[variant] == got["alone"], variant
    assert got["coupled"] == got["coupled_alone"]
    assert got["shard"] == ("tensor" if CONFIGS[name][1] == "tensor" else "pipeline")


def test_every_rank_emits_the_same_tokens(two_ranks):
    rank0, rank1 = two_ranks["ranks"]
    assert rank0["configs"] == rank1["configs"]
    assert rank0["chi"] == rank1["chi"]


@pytest.mark.parametrize("name", CONFIGS)
def test_the_split_against_one_process(two_ranks, models, name):
    """Pipeline: the logits of one process, bit for bit. Tensor: within float32 rounding
    (the halves' sums), and the same greedy tokens."""
    target = specmlx.load(pair(models, name)[0])
    ids = target.tokenizer.encode(PROMPT)
    alone = np.array(target.module(mx.array(ids)[None]))
    split = np.load(two_ranks["out"] / f"{name}-logits.npy")
    got = two_ranks["ranks"][0]["configs"][name]
    if got["shard"] == "pipeline":
        assert np.array_equal(alone, split)
    else:
        np.testing.assert_allclose(alone, split, atol=1e-4)
    assert tokens(target) == got["alone"]
    assert tokens(target, temperature=1.0, seed=7) == got["coupled_alone"]


def test_rejection_sampling_on_two_ranks_follows_the_target_distribution(two_ranks, models):
    """First two tokens of 1,200 two-token generations at T = 1 (γ 2, a perturbed draft),
    against the target's exact joint distribution (32 cells once those expected below 5
    are merged: 31 degrees of freedom). Power: a sampler whose chi-square divergence
    from the target's, sum (p' - p)^2 / p over those cells, is 0.042 or more gives a
    noncentrality of 50 or more, rejected at 0.001 with probability 0.9 or more; one
    that trusts its draft (test_lossless.py's controls) is far off that. One process
    runs the full 3,000-run checks (test_lossless.py); this one checks that two ranks
    sample as one does."""
    target = specmlx.load(models["chi"][0])
    counts = np.array(two_ranks["ranks"][0]["chi"])
    assert counts.sum() == CHI_RUNS
    assert chi_square_pvalue(counts, exact_joint(target, {"temperature": 1.0}, CHI_PROMPT)) > ALPHA


def test_generate_under_mlx_launch_prints_once(models, tmp_path):
    target, draft = models["qwen2"]
    launch = shutil.which("mlx.launch", path=str(Path(PY).parent)) or shutil.which("mlx.launch")
    if launch is None:
        pytest.skip("no mlx.launch (installed with mlx) next to this Python")
    base = free_ports(1)[0]
    argv = [launch, "-n", "2", "--backend", "ring", "--starting-port", str(base)]
    argv += ["--", PY, "-m", "specmlx", "generate", "-m", str(target), "-d", str(draft)]
    argv += ["-p", PROMPT, "--raw", "-n", "24", "-g", "3", "--json", "-q"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1, run.stdout  # rank 0's JSON alone
    out = json.loads(lines[0])
    assert out["tokens"] == tokens(specmlx.load(target), n=24)


def test_chat_takes_its_input_on_rank_0_alone(models, tmp_path):
    target, draft = models["qwen2"]
    argv = [PY, "-m", "specmlx", "chat", "-m", str(target), "-d", str(draft), "-n", "8", "-q"]
    feed = ["hello\n/set temperature 1\nwrite code\n", None]  # rank 1 reads nothing
    (code0, out0, err0), (code1, out1, err1) = finish(start(argv, tmp_path, feed), feed)
    assert code0 == code1 == 0, err0 + err1
    assert out0.strip() and out1 == "" and err1 == ""


@pytest.mark.parametrize("killed", [1, 0])
def test_a_killed_rank_ends_the_other_in_one_line(models, tmp_path, killed):
    target, draft = models["endless"]
    argv = [PY, "-m", "specmlx", "generate", "-m", str(target), "-d", str(draft), "--raw"]
    argv += ["-p", "def f", "-n", "100000", "-q"]
    procs = start(argv, tmp_path)
    os.set_blocking(procs[0].stdout.fileno(), False)
    deadline = time.monotonic() + 120
    while not procs[0].stdout.read(1):  # rank 0 prints: both are decoding
        assert procs[0].poll() is None and time.monotonic() < deadline, procs[0].stderr.read()
        time.sleep(0.1)
    time.sleep(0.5)
    procs[killed].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    survivor = procs[1 - killed]
    _, err = survivor.communicate(timeout=30)
    took = time.monotonic() - killed_at
    procs[killed].wait()
    lines = err.decode().strip().splitlines()
    assert survivor.returncode == 1 and took < 10, (took, lines)
    assert len(lines) == 1 and "lost the other ranks" in lines[0], lines


def test_serve_on_two_ranks_answers_as_one_process_does(models, tmp_path):
    """The server on rank 0 alone, concurrent clients, a stop string, a seeded sample and
    a streaming client that leaves early (every rank stops at its token); the replies are
    one process's. SIGTERM to rank 0 ends both, quietly (rank 0 tells the others)."""
    import httpx
    import openai
    from test_server import running

    from specmlx.server import make_app

    target, draft = models["qwen2"]
    asks = [
        dict(prompt="def fibonacci(n):", temperature=0),
        dict(prompt="class Stack:", temperature=0, stop=["s"]),
        dict(prompt="def f", temperature=1.0, seed=3),
        dict(prompt="The quick brown fox", temperature=0),
    ]

    def replies(base: str, concurrent: bool) -> list[str]:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0, timeout=60)

        def ask(kw: dict) -> str:
            return client.completions.create(model="m", max_tokens=16, **kw).choices[0].text

        if not concurrent:
            return [ask(kw) for kw in asks]
        with ThreadPoolExecutor(len(asks)) as pool:
            got = list(pool.map(ask, asks))
        stream = client.completions.create(
            model="m", prompt="def g", max_tokens=200, temperature=0, stream=True
        )
        next(iter(stream))
        stream.close()  # gone after its first piece
        return [*got, ask(asks[0])]

    port = free_ports(1)[0]
    argv = [PY, "-m", "specmlx", "serve", "-m", str(target), "-d", str(draft), "-q"][:-1]
    procs = start([*argv, "--port", str(port)], tmp_path)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and procs[0].poll() is None
                time.sleep(0.2)
        got = replies(f"http://127.0.0.1:{port}", concurrent=True)
    finally:
        procs[0].send_signal(signal.SIGTERM)
        (code0, _, err0), (code1, out1, err1) = finish(procs, timeout=60)
    with running(make_app(specmlx.load(target), specmlx.load(draft), model_id="m")) as base:
        want = replies(base, concurrent=False)
    assert got == [*want, want[0]]
    # uvicorn raises the signal again once it has shut down: rank 0 ends by it
    assert code0 in (0, -signal.SIGTERM) and code1 == 0, err0[-2000:] + err1
    assert out1 == err1 == ""


# -- in one process -------------------------------------------------------------------


class FakeWorld:
    def __init__(self, rank: int):
        self._rank = rank

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return 2


def test_lockstep_sends_rank_0s_plans_and_proposals_and_the_others_follow(model_dirs, monkeypatch):
    """Rank 0's generation records every broadcast; rank 1's replays them: its drafts are
    rank 0's (it never runs the draft model) and its tokens the same."""
    target, draft = specmlx.load(model_dirs["target"]), specmlx.load(model_dirs["perturbed"])
    sent: list[mx.array] = []

    def record(x, world):
        sent.append(x)
        return x

    def generate(rank: int, **kw):
        target.group = FakeWorld(rank)
        try:
            return specmlx.generate(target, PROMPT, draft, max_tokens=30, **kw).run()
        finally:
            target.group = None

    from specmlx.drafters.model import ModelDrafter

    propose, drafted, replay = ModelDrafter.propose, [], [iter(())]

    def counted(self, *a, **k):
        drafted.append(1)
        return propose(self, *a, **k)

    rejection = {"temperature": 1.0, "sampling": "rejection", "num_draft": 2}
    for kw in ({}, {"num_draft": 3, "tree": "off"}, {"num_draft": 3, "tree": 5}, rejection):
        sent.clear()
        monkeypatch.setattr(distributed, "broadcast", record)
        leader = generate(0, **kw)
        replay[0], drafted[:] = iter(list(sent)), []
        monkeypatch.setattr(distributed, "broadcast", lambda x, world: next(replay[0]))
        monkeypatch.setattr(ModelDrafter, "propose", counted)
        follower = generate(1, **kw)
        monkeypatch.undo()
        assert follower.tokens == leader.tokens and drafted == []
        assert follower.stats.accepted == leader.stats.accepted
        assert leader.stats.accepted > 0 or "num_draft" not in kw  # auto may keep plain
        assert next(replay[0], None) is None  # every broadcast taken, none more
        if not kw:
            assert specmlx.generate(target, PROMPT, max_tokens=30).run().tokens == leader.tokens


def test_a_rank_out_of_step_stops_in_one_line(model_dirs, monkeypatch):
    target = specmlx.load(model_dirs["target"])
    draft = specmlx.load(model_dirs["perturbed"])
    target.group = FakeWorld(1)
    monkeypatch.setattr(distributed, "broadcast", lambda x, world: mx.array([-1, 0, 5, 9]))
    with pytest.raises(specmlx.SpecmlxError, match="out of step with rank 0"):
        specmlx.generate(target, PROMPT, draft, max_tokens=4).run()


def test_the_split_is_tensor_where_mlx_lm_has_it_else_pipeline_else_refused(tmp_path):
    built = {
        a: specmlx.load(build_tiny_model(tmp_path / a, arch=a))
        for a in ("qwen2", "qwen3_next", "phi3")
    }
    assert distributed.pick_shard(built["qwen2"].module, "auto") == "tensor"
    assert distributed.pick_shard(built["qwen2"].module, "pipeline") == "pipeline"
    assert distributed.pick_shard(built["qwen3_next"].module, "auto") == "pipeline"
    with pytest.raises(specmlx.SpecmlxError, match="use --shard pipeline"):
        distributed.pick_shard(built["qwen3_next"].module, "tensor")
    with pytest.raises(specmlx.SpecmlxError, match="neither shard"):
        distributed.pick_shard(built["phi3"].module, "auto")


def test_shard_alone_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "-p", "hi", "--shard", "tensor"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mlx.launch" in err[0]


def test_a_lost_peer_is_told_apart_from_other_errors():
    assert distributed.lost_peer(RuntimeError("[ring] connection to a peer was lost"))
    assert not distributed.lost_peer(RuntimeError("[matmul] shapes"))
    assert lockstep.lockstep.__doc__  # the module is importable alone


def test_a_split_target_keeps_costs_apart_from_the_whole_ones(model_dirs):
    """What a pass costs split over ranks (a collective per layer) is no figure for one
    process: the measured costs' keys tell them apart."""
    target = specmlx.load(model_dirs["target"])
    whole = specmlx.Session(target).cost_key("model")
    target.shard, target.group = "tensor", FakeWorld(0)
    try:
        split = specmlx.Session(target).cost_key("model")
    finally:
        target.shard, target.group = "", None
    assert "@tensorx2" in split and split.replace("@tensorx2", "") == whole
