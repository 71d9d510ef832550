"""Shared fixtures: tiny random models of real architectures, built once per session."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile

import pytest

import specmlx
from specmlx.cpu import native
from specmlx.paths import home
from specmlx.tiny import build_tiny_model

# A command run without --model must never fetch real weights in tests (the default pair
# would otherwise be downloaded or built): "tiny" is the tiny random demo pair. Set in the
# environment so that subprocesses (`python -m specmlx ...`) inherit it.
os.environ.setdefault("SPECMLX_MODEL", "tiny")
# Tests call the CLI's main() in-process: a command that re-executes itself to put a
# fast BLAS under MLX (specmlx.cpu.blas.setup_cli) would replace pytest. tests/test_cpu_blas.py
# runs the re-exec in subprocesses, with the SPECMLX_ variables cleared.
os.environ.setdefault("SPECMLX_NO_REEXEC", "1")
# Tests write costs, configs and demo models under $SPECMLX_HOME: never the user's own.
# The real converted models (for the tests that use them when present) stay findable.
os.environ.setdefault("SPECMLX_REAL_HOME", str(home()))
os.environ["SPECMLX_HOME"] = tempfile.mkdtemp(prefix="specmlx-test-home-")
atexit.register(shutil.rmtree, os.environ["SPECMLX_HOME"], ignore_errors=True)
# The suite checks the native kernel against mx.quantized_matmul to float32 rounding, so it
# runs the float32-activation kernel; the default, int8 x, has tests/test_native_int8.py.
# Importing specmlx.cpu.native above already read the variable: set the mode too, not
# just the environment that subprocesses inherit.
os.environ.setdefault("SPECMLX_ACTIVATIONS", "float32")
if native.available():
    native.set_activations(os.environ["SPECMLX_ACTIVATIONS"])


# The native kernel's ISAs, lowest first (`_ext.set_isa` forces any up to the CPU's best).
ISAS = ["scalar", "avx2", "avx512"]


@pytest.fixture
def isas():
    """Every ISA this CPU has; the best ISA and the activations mode restored afterwards."""
    if not native.available():
        pytest.skip(f"native kernel not available: {native.reason()}")
    best, mode = native._ext.isa(), native.activations()
    yield ISAS[: ISAS.index(best) + 1]
    native._ext.set_isa(best)
    native.set_activations(mode)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """pair(arch) -> (target dir, draft dir): a tiny float32 model of `arch` and a draft
    that is a perturbed copy of it, each built once in the session."""
    root = tmp_path_factory.mktemp("tiny-pairs")
    built: dict[str, tuple] = {}

    def pair(arch: str):
        if arch not in built:
            target = build_tiny_model(root / f"{arch}-target", arch=arch, seed=0)
            draft = build_tiny_model(
                root / f"{arch}-draft", arch=arch, seed=1, perturb_from=target, noise=0.05
            )
            built[arch] = (target, draft)
        return built[arch]

    return pair


@pytest.fixture
def int8_activations():
    """The native kernel's default mode, int8 x (the suite runs float32 x: see above)."""
    if not native.available():
        pytest.skip(f"int8 activations are the native kernel's, unavailable: {native.reason()}")
    before = native.activations()
    native.set_activations("int8")
    yield
    native.set_activations(before)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """Paths of tiny models in the hub's layout: a qwen2 target, drafts for it, a llama."""
    root = tmp_path_factory.mktemp("models")
    target = build_tiny_model(root / "qwen2-target", arch="qwen2", seed=0)
    return {
        "target": target,
        # close to the target: acceptance well between 0 and 1
        "perturbed": build_tiny_model(
            root / "qwen2-perturbed", seed=1, perturb_from=target, noise=0.1
        ),
        # same tokenizer, independent weights
        "unrelated": build_tiny_model(root / "qwen2-unrelated", arch="qwen2", seed=2),
        "llama": build_tiny_model(root / "llama-target", arch="llama", seed=3),
        "llama_draft": build_tiny_model(root / "llama-draft", arch="llama", seed=4),
    }


@pytest.fixture(scope="session")
def models(model_dirs):
    """The same models loaded with specmlx.load (lazy, float32)."""
    return {name: specmlx.load(path) for name, path in model_dirs.items()}


@pytest.fixture(scope="module")
def endless_target(model_dirs, tmp_path_factory):
    """The target with its EOS moved to a padding id it never samples, and a long context:
    it generates until stopped, so a Ctrl-C always lands mid-run."""
    path = tmp_path_factory.mktemp("endless") / "target"
    shutil.copytree(model_dirs["target"], path)
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = config["vocab_size"] - 1
    config["max_position_embeddings"] = 1_000_000
    (path / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config["eos_token"] = None
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path


@pytest.fixture
def quantized_tiny(model_dirs):
    """Makes a fresh (not the shared session's) tiny qwen2, quantized to INT4 g32, not yet
    on the native kernel: call it twice for two copies."""
    import mlx.nn as nn

    def load():
        model = specmlx.load(model_dirs["target"], native=False)
        nn.quantize(model.module, group_size=32, bits=4)
        return model

    return load


@pytest.fixture(params=["scalar", "avx2", "avx512"])
def forced_isa(request):
    """The kernels forced to one ISA (skipped where this CPU lacks it); the best restored after."""
    if not native.available():
        pytest.skip(f"native kernel not available: {native.reason()}")
    best = native._ext.isa()
    names = ["scalar", "avx2", "avx512"]
    if names.index(request.param) > names.index(best):
        pytest.skip(f"this CPU has no {request.param} (best: {best})")
    native._ext.set_isa(request.param)
    yield request.param
    native._ext.set_isa(best)


@pytest.fixture(params=["int8", "float32"])
def activations(request):
    """The kernels' activations set to int8, then float32; the setting restored after."""
    before = native.activations()
    native.set_activations(request.param)
    yield request.param
    native.set_activations(before)
