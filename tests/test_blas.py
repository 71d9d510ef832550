"""The memory-bound CPU path: float32 expansion of INT4 weights, BLAS detection, re-exec."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

import specmlx
from specmlx import blas
from specmlx.convert.quantize import quantize

TOKENS = mx.array([[3, 17, 42, 99, 7, 250, 11, 5]])


def quantized_layers(module) -> list:
    return [
        m for m in module.modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    ]


@pytest.fixture(scope="module")
def int4_dir(model_dirs, tmp_path_factory):
    """The tiny qwen2 target in INT4 (embedding and head too), float32 scales."""
    out = tmp_path_factory.mktemp("int4") / "q"
    quantize(model_dirs["target"], out, group_size=32, embed_bits=4, dtype="float32")
    return out


# ---- CPU weights ---------------------------------------------------------------------


def test_fp32_expansion_keeps_logits_and_greedy_tokens(int4_dir):
    int4 = specmlx.load(int4_dir, cpu_weights="int4")
    fp32 = specmlx.load(int4_dir, cpu_weights="fp32")
    assert int4.weights == "int4" and quantized_layers(int4.module)
    assert fp32.weights == "fp32" and not quantized_layers(fp32.module)
    assert "expanded to fp32" in fp32.describe()
    assert all(v.dtype == mx.float32 for _, v in tree_flatten(fp32.module.parameters()))

    a, b = int4.module(TOKENS), fp32.module(TOKENS)
    # Same weights, only the summation order differs.
    assert mx.abs(a - b).max().item() < 1e-4 * max(1.0, mx.abs(a).max().item())
    greedy = [
        specmlx.generate(m, "def fibonacci(n):", max_tokens=24, num_draft=0).tokens
        for m in (int4, fp32)
    ]
    assert greedy[0] == greedy[1]


def test_fp32_target_speculates_with_an_int4_draft_exactly(int4_dir):
    fp32 = specmlx.load(int4_dir, cpu_weights="fp32")
    int4 = specmlx.load(int4_dir, cpu_weights="int4")
    alone = specmlx.generate(fp32, "class Stack:", max_tokens=16, num_draft=0).tokens
    spec = specmlx.generate(fp32, "class Stack:", draft=int4, max_tokens=16, num_draft=3)
    assert spec.tokens == alone


def tiny_qwen2(tied: bool) -> nn.Module:
    from mlx_lm.models import qwen2

    args = qwen2.ModelArgs.from_dict(
        {
            "model_type": "qwen2",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6,
            "vocab_size": 256,
            "tie_word_embeddings": tied,
        }
    )
    mx.random.seed(0)
    return qwen2.Model(args)


def test_tied_head_expands_and_stays_a_dense_matmul():
    model = tiny_qwen2(tied=True)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    before = model(TOKENS)
    assert blas.expand_quantized(model) == 8  # 7 linears + the tied embedding
    assert type(model.model.embed_tokens) is nn.Embedding
    assert mx.allclose(model(TOKENS), before, atol=1e-4).item()


def test_expansion_can_leave_8_bit_layers_packed():
    # specmlx's checkpoints keep embeddings and heads at 8 bits: the native kernel runs
    # those faster than a float32 BLAS, so the fp32 mode leaves them packed.
    model = tiny_qwen2(tied=False)
    nn.quantize(
        model,
        group_size=32,
        bits=4,
        class_predicate=lambda path, m: (
            hasattr(m, "to_quantized")
            and ({"group_size": 32, "bits": 8} if path == "lm_head" else True)
        ),
    )
    mx.eval(model.parameters())
    before = model(TOKENS)
    assert blas.expand_quantized(model, keep_bits=(8,)) == 8  # 7 linears + the embedding
    assert isinstance(model.lm_head, nn.QuantizedLinear) and model.lm_head.bits == 8
    assert mx.allclose(model(TOKENS), before, atol=1e-4).item()


def test_dense_params_counts_packed_values(model_dirs, int4_dir):
    dense = specmlx.load(model_dirs["target"])
    int4 = specmlx.load(int4_dir, cpu_weights="int4")
    expected = sum(v.size for _, v in tree_flatten(dense.module.parameters()))
    assert blas.dense_params(int4.module) == expected


def test_auto_expands_only_with_a_fast_blas_no_native_kernel_and_room(int4_dir, monkeypatch):
    module = specmlx.load(int4_dir, cpu_weights="int4").module
    monkeypatch.setattr(blas, "fast_blas_active", lambda: True)
    monkeypatch.setattr(blas, "_native_covers", lambda m: False)
    monkeypatch.setattr(blas, "available_memory", lambda: 1 << 40)
    assert blas.pick_cpu_weights(module, "auto", "cpu")[0] == "fp32"
    assert blas.pick_cpu_weights(module, "auto", "gpu")[0] == "int4"
    assert blas.pick_cpu_weights(module, "int4", "cpu") == ("int4", "requested")
    monkeypatch.setattr(blas, "available_memory", lambda: blas.dense_params(module) * 4)
    mode, why = blas.pick_cpu_weights(module, "auto", "cpu")
    assert mode == "int4" and "available" in why  # 4 bytes/param fit, the 1.3 margin not
    monkeypatch.setattr(blas, "available_memory", lambda: 1 << 40)
    monkeypatch.setattr(blas, "_native_covers", lambda m: True)
    assert blas.pick_cpu_weights(module, "auto", "cpu") == ("int4", "native INT4 kernel is faster")
    monkeypatch.setattr(blas, "_native_covers", lambda m: False)
    monkeypatch.setattr(blas, "fast_blas_active", lambda: False)
    assert blas.pick_cpu_weights(module, "auto", "cpu")[0] == "int4"


def test_dense_checkpoint_and_bad_mode(models):
    assert models["target"].weights == "dense"
    with pytest.raises(specmlx.SpecmlxError, match="int4, fp32"):
        blas.pick_cpu_weights(models["target"].module, "fp16", "cpu")


# ---- detection and settings -------------------------------------------------------------


def test_blas_info_describes_this_process():
    info = blas.blas_info()
    assert {"name", "path", "threads", "how", "fast"} <= info.keys()
    if sys.platform == "linux" and blas.active_library() is None:
        # pytest imported mlx itself, so unless it was LD_PRELOADed: the bundled BLAS
        assert info["how"] == "bundled" and not info["fast"]
        assert "libblas" in Path(info["path"]).name
    assert info["name"] in blas.describe(info)


def test_threads_setting(monkeypatch):
    monkeypatch.setenv("SPECMLX_THREADS", "3")
    assert blas.default_threads() == (3, "SPECMLX_THREADS")
    monkeypatch.setenv("SPECMLX_THREADS", "zero")
    with pytest.raises(specmlx.SpecmlxError, match="SPECMLX_THREADS"):
        blas.default_threads()
    monkeypatch.delenv("SPECMLX_THREADS")
    n, why = blas.default_threads()
    assert 1 <= n <= (os.cpu_count() or 1) and why.startswith("auto")


def test_explicit_library_path(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECMLX_BLAS", str(tmp_path / "missing.so"))
    with pytest.raises(specmlx.SpecmlxError, match="SPECMLX_BLAS"):
        blas.find_fast_blas()
    (tmp_path / "libopenblas.so.0").write_bytes(b"")
    monkeypatch.setenv("SPECMLX_BLAS", str(tmp_path / "libopenblas.so.0"))
    assert blas.find_fast_blas() == tmp_path / "libopenblas.so.0"


def test_coretype_is_one_openblas_knows():
    assert blas._coretype() in ("", "SkylakeX", "Haswell")


@pytest.mark.skipif(sys.platform != "linux", reason="the gfortran link is for Linux wheels")
def test_gfortran_link_points_at_mlx_bundled_copy(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECMLX_HOME", str(tmp_path))
    folders = blas._gfortran_dirs()
    if not folders:
        pytest.skip("this mlx wheel bundles no libgfortran")
    link = folders[0] / "libgfortran.so.5"
    assert link.is_symlink() and link.resolve().parent == folders[1].resolve()
    assert blas._gfortran_dirs() == folders  # idempotent


# ---- the CLI's set-up, in fresh processes -----------------------------------------------

# Prints a line when it starts (twice if it re-executes itself), runs the CLI entry point
# as the `specmlx` command would, then reports the BLAS it ended up with.
PROBE = textwrap.dedent(
    """
    import json, os, sys
    if os.environ.get("PRE_IMPORT_MLX"):
        import mlx.core
    print("start", os.environ.get("SPECMLX_BLAS_REEXEC", "-"), flush=True)
    sys.argv = ["specmlx", *json.loads(os.environ["ARGS"]), "--help"]
    from specmlx.cli import main
    try:
        main()
    except SystemExit:
        pass
    from specmlx import blas
    print("INFO", json.dumps(blas.blas_info(probe=True)), flush=True)
    """
)


def run_probe(args: list[str] = (), **env: str) -> tuple[int, dict]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECMLX_", "LD_"))}
    full_env.update(env, ARGS=json.dumps(list(args)), SPECMLX_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=full_env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    info = json.loads(next(line for line in lines if line.startswith("INFO"))[5:])
    return sum(line.startswith("start") for line in lines), info


needs_fast_blas = pytest.mark.skipif(
    sys.platform != "linux" or blas.find_fast_blas() is None,
    reason="no OpenBLAS here: pip install 'specmlx[cpu-fast]' or apt install libopenblas0-pthread",
)


@needs_fast_blas
def test_cli_loads_openblas_in_process_and_it_takes_effect():
    starts, info = run_probe()
    assert starts == 1 and info["fast"] and info["how"] == "in-process"
    assert info["name"].startswith("OpenBLAS") and info["threads"] == 1
    _, reference = run_probe(["--no-fast-blas"])
    assert not reference["fast"] and "disabled" in reference["why_not_fast"]
    # The timing proves MLX's matmuls really moved (OpenBLAS is 10-30x faster here).
    assert info["gflops"] > 2 * reference["gflops"]


@needs_fast_blas
def test_cli_reexecs_once_when_mlx_was_imported_first():
    starts, info = run_probe(PRE_IMPORT_MLX="1")
    assert starts == 2 and info["fast"] and info["how"] == "LD_PRELOAD"


@needs_fast_blas
def test_reexec_guard_and_opt_outs():
    starts, info = run_probe(PRE_IMPORT_MLX="1", SPECMLX_NO_REEXEC="1")
    assert starts == 1 and not info["fast"] and "imported" in info["why_not_fast"]
    # A child of our own re-exec (guard set) never re-executes again, whatever it finds.
    starts, info = run_probe(PRE_IMPORT_MLX="1", SPECMLX_BLAS_REEXEC="auto")
    assert starts == 1 and not info["fast"]
    starts, info = run_probe(PRE_IMPORT_MLX="1", SPECMLX_FAST_BLAS="0")
    assert starts == 1 and not info["fast"]


SYSTEM_GFORTRAN = Path("/usr/lib/x86_64-linux-gnu/libgfortran.so.5")


@needs_fast_blas
@pytest.mark.skipif(
    not (hasattr(os, "geteuid") and os.geteuid() == 0 and SYSTEM_GFORTRAN.exists()),
    reason="hiding the system libgfortran needs root and Debian's x86_64 layout",
)
def test_without_system_gfortran_the_cli_borrows_mlx_bundled_copy(tmp_path):
    # As on a fresh machine with only pip: OpenBLAS needs libgfortran.so.5 and the system
    # has none (hidden here by a bind mount in a private mount namespace).
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    hide = f"mount --bind /dev/null {SYSTEM_GFORTRAN.resolve()} && exec {sys.executable} {script}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECMLX_", "LD_"))}
    env.update(ARGS="[]", SPECMLX_THREADS="1", SPECMLX_HOME=str(tmp_path))
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c", hide], env=env, capture_output=True, text=True, timeout=120
    )
    if "unshare" in out.stderr and out.returncode != 0:
        pytest.skip(f"no private mount namespace here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    info = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("INFO"))[5:])
    assert info["fast"] and info["how"] == "LD_PRELOAD"
