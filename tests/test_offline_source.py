"""An offline model's source: what specmlx.json says it is, how `specmlx models` says to
get it back, `specmlx models gguf` writing it, a kept GGUF left where it is, and the
first use's conversion drawing `specmlx quantize`'s bar.

As in test_models.py, the "wheels" are zip files made on the spot around a tiny GGUF and
nothing touches the network (a fetch of wheels not in the directory fails the test).
"""

from __future__ import annotations

import json

import pytest
from test_gguf import write_gguf
from test_models import make_wheels

from specmlx import models
from specmlx.cli import main
from specmlx.errors import SpecmlxError


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMLX_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # no hub models listed
    return tmp_path / "home"


@pytest.fixture
def fake(model_dirs, tmp_path, monkeypatch, home) -> tuple[models.WheelModel, bytes]:
    """An offline model "fake" (directory fake-int4) whose 3 wheels are in home/wheels."""
    gguf = write_gguf(model_dirs["target"], tmp_path / "tiny.gguf", "Q8_0")
    spec = make_wheels(home / "wheels", gguf.read_bytes(), "tiny-part", 3)
    monkeypatch.setitem(models.OFFLINE_MODELS, "fake", spec)
    return spec, gguf.read_bytes()


def info(home) -> dict:
    return json.loads((home / "models" / "fake-int4" / "specmlx.json").read_text())


def test_specmlx_json_names_the_wheels_and_the_command_that_writes_the_gguf(fake, home):
    spec, _ = fake
    models.build_offline_model("fake")
    source = info(home)
    assert source["source_packages"] == ["tiny-part1==1.0", "tiny-part2==1.0", "tiny-part3==1.0"]
    assert "tiny-part1==1.0 … tiny-part3==1.0" in source["source"]
    assert source["source_sha256"] == spec.sha256
    assert source["source_command"] == "specmlx models gguf fake-int4"
    assert not list((home / "gguf").iterdir())  # the GGUF assembled to convert is not kept


def test_models_says_how_to_get_the_source_back_and_gguf_writes_it(fake, home, capsys):
    spec, data = fake
    models.build_offline_model("fake")
    main(["models"])
    hint = "fake-int4: its source GGUF is not kept; `specmlx models gguf fake-int4` writes it again"
    assert hint in capsys.readouterr().out
    main(["models", "--json"])
    (listed,) = json.loads(capsys.readouterr().out)
    assert listed["source_command"] == "specmlx models gguf fake-int4"
    assert listed["source"].startswith("PyPI wheels tiny-part1==1.0")
    main(["models", "gguf", "fake-int4"])
    written = home / "gguf" / "fake-int4.gguf"
    assert written.read_bytes() == data
    assert f"wrote {written}" in capsys.readouterr().out
    main(["models"])
    assert "not kept" not in capsys.readouterr().out  # it is there now


def test_models_gguf_refuses_an_existing_file_and_an_unknown_name(fake, home, capsys):
    (home / "gguf").mkdir(parents=True)
    (home / "gguf" / "fake-int4.gguf").write_bytes(b"mine")
    for args, says in [
        (["fake-int4"], "already exists; pass --force to replace it"),
        (["nope"], "'nope' is not an offline model built from PyPI wheels"),
    ]:
        with pytest.raises(SystemExit) as exited:
            main(["models", "gguf", *args])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and says in err and err.count("\n") == 1, err
    assert (home / "gguf" / "fake-int4.gguf").read_bytes() == b"mine"


def test_a_kept_gguf_is_converted_without_the_wheels_and_stays(fake, home, monkeypatch):
    spec, data = fake
    kept = models.gguf_path(spec)
    kept.parent.mkdir(parents=True)
    kept.write_bytes(data)
    monkeypatch.setattr(models, "fetch_wheels", lambda *a, **k: pytest.fail("wheels fetched"))
    models.build_offline_model("fake")
    assert kept.read_bytes() == data
    assert info(home)["source_sha256"] == spec.sha256


def test_a_kept_gguf_that_is_not_the_pinned_one_is_refused(fake, home):
    spec, data = fake
    kept = models.gguf_path(spec)
    kept.parent.mkdir(parents=True)
    kept.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit of tensor data
    with pytest.raises(SpecmlxError, match="is not a fake model .*delete it and rerun"):
        models.build_offline_model("fake")
    assert not (home / "models" / "fake-int4").exists()


def test_the_first_use_draws_the_quantize_bar_on_a_terminal(fake, home, monkeypatch, capsys):
    from specmlx.cli import options

    monkeypatch.setattr(models, "OFFLINE_PAIR", ("fake", "fake"))  # built once, used twice
    monkeypatch.setattr(models, "hub_reachable", lambda *a, **k: False)
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich: stderr counts as a terminal
    monkeypatch.setenv("TERM", "xterm-256color")
    for name in ("SPECMLX_MODEL", "SPECMLX_DRAFT"):
        monkeypatch.delenv(name, raising=False)
    target, _ = options.load_pair(None, None, True, "auto", print)
    assert target.path == home / "models" / "fake-int4"
    err = capsys.readouterr().err
    assert "converting to INT4" in err and "tensors" in err, err
