"""The fast BLAS under MLX: detection and settings, and the CLI loading it (in-process, or
by re-executing itself once) only when fp32 weights are asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import specmlx
from specmlx import cli, cpu
from specmlx.cpu import blas

# ---- detection and settings -------------------------------------------------------------


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


@pytest.mark.skipif(sys.platform != "linux", reason="the gfortran link is for Linux wheels")
def test_gfortran_link_points_at_mlx_bundled_copy(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECMLX_HOME", str(tmp_path))
    folders = blas._gfortran_dirs()
    if not folders:
        pytest.skip("this mlx wheel bundles no libgfortran")
    link = folders[0] / "libgfortran.so.5"
    assert link.is_symlink() and link.resolve().parent == folders[1].resolve()
    assert blas._gfortran_dirs() == folders  # idempotent


# ---- when the CLI sets a fast BLAS up -----------------------------------------------------


@pytest.mark.parametrize(
    "args, asks",
    [
        (["generate", "-p", "hi"], False),
        (["generate", "--cpu-weights", "auto", "-p", "hi"], False),
        (["chat", "--cpu-weights", "int4"], False),
        (["--no-fast-blas", "generate", "-p", "hi"], False),
        (["generate", "--cpu-weights", "fp32", "-p", "hi"], True),
        (["chat", "--cpu-weights=fp32"], True),
    ],
)
def test_the_cli_sets_a_fast_blas_up_only_when_fp32_weights_are_asked_for(
    args, asks, monkeypatch, capsys
):
    calls = []
    monkeypatch.setattr(cpu, "setup_cli", lambda **kw: calls.append(kw))
    monkeypatch.setattr(sys, "argv", ["specmlx", *args, "--help"])
    cli.main()
    assert "Usage" in capsys.readouterr().out
    assert calls == ([{"no_fast_blas": False}] if asks else [])


def test_no_fast_blas_reaches_the_fp32_set_up(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(cpu, "setup_cli", lambda **kw: calls.append(kw))
    argv = ["specmlx", "--no-fast-blas", "generate", "--cpu-weights", "fp32", "--help"]
    monkeypatch.setattr(sys, "argv", argv)
    cli.main()
    assert calls == [{"no_fast_blas": True}]


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
    from specmlx.cpu import blas
    print("INFO", json.dumps(blas.blas_info()), flush=True)
    """
)
FP32 = ["generate", "--cpu-weights", "fp32"]


def run_probe(args: list[str] = FP32, **env: str) -> tuple[int, dict]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECMLX_", "LD_"))}
    full_env.update(env, ARGS=json.dumps(list(args)), SPECMLX_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=full_env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    info = json.loads(next(line for line in lines if line.startswith("INFO"))[5:])
    return sum(line.startswith("start") for line in lines), info


def bundled_blas() -> Path | None:
    """mlx[cpu]'s own reference BLAS: a library that preloads harmlessly (it is the one MLX
    would bind anyway), so it can stand in for OpenBLAS where the machine has none."""
    import mlx

    libs = Path(mlx.__path__[0]).parent / "mlx_cpu.libs"
    return next(iter(sorted(libs.glob("libblas-*.so*"))), None)


@pytest.mark.skipif(
    sys.platform != "linux" or bundled_blas() is None, reason="needs mlx[cpu]'s bundled BLAS"
)
def test_the_cli_reexecs_for_fp32_weights_only():
    # mlx imported first: a BLAS named by SPECMLX_BLAS can then only come by re-executing.
    env = dict(PRE_IMPORT_MLX="1", SPECMLX_BLAS=str(bundled_blas()))
    for args in (["generate"], ["generate", "--cpu-weights", "int4"], ["chat"]):
        starts, _ = run_probe(args, **env)
        assert starts == 1, args
    starts, info = run_probe(FP32, **env)
    assert starts == 2 and info["how"] == "LD_PRELOAD"
    assert Path(info["path"]).name == bundled_blas().name


needs_fast_blas = pytest.mark.skipif(
    sys.platform != "linux" or blas.find_fast_blas() is None,
    reason="no OpenBLAS here: pip install 'specmlx[cpu-fast]' or apt install libopenblas0-pthread",
)


@needs_fast_blas
def test_cli_loads_openblas_for_fp32_weights_in_process_or_by_one_reexec():
    # in-process where it loads there; a wheel's OpenBLAS on a system without the
    # libgfortran it links loads by one re-exec, preloaded beside mlx's own libgfortran
    starts, info = run_probe()
    assert info["fast"] and (starts, info["how"]) in ((1, "in-process"), (2, "LD_PRELOAD"))
    # active_library: the library MLX's cblas_sgemm now resolves to.
    assert info["name"].startswith("OpenBLAS") and info["threads"] == 1
    _, reference = run_probe(["--no-fast-blas", *FP32])
    assert not reference["fast"] and "disabled" in reference["why_not_fast"]
    _, int4 = run_probe(["generate"])
    assert not int4["fast"] and int4["how"] == "bundled"


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
    env.update(ARGS=json.dumps(FP32), SPECMLX_THREADS="1", SPECMLX_HOME=str(tmp_path))
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c", hide], env=env, capture_output=True, text=True, timeout=120
    )
    if "unshare" in out.stderr and out.returncode != 0:
        pytest.skip(f"no private mount namespace here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    info = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("INFO"))[5:])
    assert info["fast"] and info["how"] == "LD_PRELOAD"
