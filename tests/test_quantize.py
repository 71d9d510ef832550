"""`specmlx quantize` from safetensors: mlx-lm's exact format, streaming, atomic, clear errors."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import pytest

import specmlx
from specmlx.cli import main
from specmlx.convert import quantize, shards
from specmlx.errors import SpecmlxError

PROMPT = [5, 17, 42, 7, 99, 3]
# specmlx.load computing as mlx-lm does: its own CPU kernels and float32 expansion are
# faster but round differently, so identical logits are only asked of this setting.
AS_MLX_LM = dict(dtype="float16", native=False, cpu_weights="int4")


def load_all(path: Path) -> dict[str, mx.array]:
    weights = {}
    for file in sorted(path.glob("model*.safetensors")):
        weights.update(mx.load(str(file)))
    return weights


def logits_of(module, tokens=PROMPT) -> mx.array:
    return module(mx.array([tokens]))[0].astype(mx.float32)


def assert_nothing_left(parent: Path, before: set[str]) -> None:
    assert set(os.listdir(parent)) == before, "a failed quantize left files behind"


@pytest.fixture(scope="module")
def mlx_lm_converted(model_dirs, tmp_path_factory):
    """mlx_lm.convert's INT4 output (float16 scales) of the tiny qwen2 and llama models."""
    from mlx_lm.convert import convert

    root = tmp_path_factory.mktemp("mlx-lm-converted")
    out = {}
    for name in ("target", "llama"):
        out[name] = root / name
        convert(str(model_dirs[name]), str(out[name]), True, 64, 4, dtype="float16")
    return out


@pytest.mark.parametrize("name", ["target", "llama"])
def test_int4_output_equals_mlx_lm_convert_tensor_for_tensor(
    name, model_dirs, mlx_lm_converted, tmp_path
):
    quantize(model_dirs[name], tmp_path / "ours", embed_bits=4, dtype="float16")
    ours, theirs = load_all(tmp_path / "ours"), load_all(mlx_lm_converted[name])
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype, key
        assert mx.array_equal(ours[key], theirs[key]).item(), key
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    reference = json.loads((mlx_lm_converted[name] / "config.json").read_text())
    assert config["quantization"] == reference["quantization"]
    assert config["quantization_config"] == reference["quantization_config"]


def test_output_loads_in_mlx_lm_with_the_logits_specmlx_computes(model_dirs, tmp_path):
    from mlx_lm import load as mlx_lm_load

    quantize(model_dirs["target"], tmp_path / "q", dtype="float16")
    reference, _ = mlx_lm_load(str(tmp_path / "q"))
    ours = specmlx.load(tmp_path / "q", **AS_MLX_LM)
    assert mx.array_equal(logits_of(ours.module), logits_of(reference)).item()


def test_specmlx_loads_an_mlx_lm_converted_dir_with_identical_logits(mlx_lm_converted):
    from mlx_lm import load as mlx_lm_load

    reference, _ = mlx_lm_load(str(mlx_lm_converted["target"]))
    ours = specmlx.load(mlx_lm_converted["target"], **AS_MLX_LM)
    assert ours.quantization["bits"] == 4
    assert mx.array_equal(logits_of(ours.module), logits_of(reference)).item()


def test_int4_logits_stay_close_to_the_float_model(models, model_dirs, tmp_path):
    quantize(model_dirs["target"], tmp_path / "q", embed_bits=8, dtype="float32")
    original = logits_of(models["target"].module)
    quantized = logits_of(specmlx.load(tmp_path / "q").module)
    error = mx.abs(quantized - original).max().item()
    assert error < 0.25 * mx.abs(original).max().item()


def test_embed_bits_quantize_embedding_and_head_at_their_own_width(model_dirs, tmp_path):
    summary = quantize(model_dirs["target"], tmp_path / "q", bits=4, embed_bits=8)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization"]["model.embed_tokens"]["bits"] == 8
    assert config["quantization"]["lm_head"]["bits"] == 8
    weights = load_all(tmp_path / "q")
    hidden = 64
    assert weights["model.embed_tokens.weight"].shape[-1] == hidden * 8 // 32
    assert weights["model.layers.0.mlp.up_proj.weight"].shape[-1] == hidden * 4 // 32
    assert summary.unquantized == []
    specmlx.load(tmp_path / "q")


def test_embed_bits_16_keeps_embedding_and_head_unquantized(model_dirs, tmp_path):
    summary = quantize(model_dirs["target"], tmp_path / "q", embed_bits=16, dtype="float16")
    weights = load_all(tmp_path / "q")
    assert weights["model.embed_tokens.weight"].dtype == mx.float16
    assert "model.embed_tokens.scales" not in weights
    assert sorted(summary.unquantized) == ["lm_head", "model.embed_tokens"]
    specmlx.load(tmp_path / "q")


def test_layers_that_cannot_be_grouped_are_left_unquantized_and_listed(model_dirs, tmp_path):
    # hidden size 64 does not divide into groups of 128; the MLP's 128-wide input does
    summary = quantize(model_dirs["target"], tmp_path / "q", group_size=128, embed_bits=4)
    assert "model.layers.0.self_attn.q_proj" in summary.unquantized
    assert "model.layers.0.mlp.down_proj" not in summary.unquantized
    info = json.loads((tmp_path / "q" / "specmlx.json").read_text())
    assert info["unquantized"] == summary.unquantized
    specmlx.load(tmp_path / "q")


def test_large_outputs_are_sharded_with_mlx_lm_names_and_an_index(model_dirs, tmp_path):
    summary = quantize(model_dirs["target"], tmp_path / "q", max_shard_bytes=20_000)
    files = sorted(p.name for p in (tmp_path / "q").glob("model*.safetensors"))
    assert summary.shards == len(files) > 1
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == summary.size_bytes
    for name, file in index["weight_map"].items():
        assert name in mx.load(str(tmp_path / "q" / file))
    specmlx.load(tmp_path / "q")


def test_specmlx_json_records_source_settings_and_bits_per_weight(model_dirs, tmp_path):
    summary = quantize(model_dirs["target"], tmp_path / "q")
    info = json.loads((tmp_path / "q" / "specmlx.json").read_text())
    assert info["source"] == str(model_dirs["target"])
    assert len(info["source_sha256"]) == 64
    assert (info["bits"], info["group_size"], info["embed_bits"]) == (4, 64, 6)
    assert info["bits_per_weight"] == pytest.approx(summary.bits_per_weight, abs=1e-3)
    assert 4 < info["bits_per_weight"] < 8
    assert info["created_with"].startswith(f"specmlx {specmlx.__version__}")


def test_tokenizer_files_are_copied(model_dirs, tmp_path):
    quantize(model_dirs["target"], tmp_path / "q")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "q" / name).read_bytes() == (model_dirs["target"] / name).read_bytes()


def test_out_gets_ordinary_permissions_not_the_temp_dirs_private_ones(model_dirs, tmp_path):
    quantize(model_dirs["target"], tmp_path / "q")
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "q").stat().st_mode & 0o777 == 0o777 & ~mask


def test_existing_out_is_refused_without_force(model_dirs, tmp_path):
    (tmp_path / "q").mkdir()
    with pytest.raises(SpecmlxError, match="already exists; pass --force"):
        quantize(model_dirs["target"], tmp_path / "q")
    assert os.listdir(tmp_path / "q") == []


def test_force_replaces_existing_out(model_dirs, tmp_path):
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "stale.txt").write_text("old")
    quantize(model_dirs["target"], tmp_path / "q", force=True)
    assert not (tmp_path / "q" / "stale.txt").exists()
    assert sorted(os.listdir(tmp_path)) == ["q"]
    specmlx.load(tmp_path / "q")


def test_interrupt_mid_write_leaves_nothing(model_dirs, tmp_path, monkeypatch):
    calls = []

    def interrupted(f, offset, data):
        calls.append(offset)
        if len(calls) == 5:
            raise KeyboardInterrupt

    monkeypatch.setattr(shards, "write_at", interrupted)
    with pytest.raises(KeyboardInterrupt):
        quantize(model_dirs["target"], tmp_path / "new" / "q")
    assert os.listdir(tmp_path) == []


def test_disk_full_mid_write_is_a_clear_error_and_leaves_nothing(model_dirs, tmp_path, monkeypatch):
    def full(f, offset, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shards, "write_at", full)
    with pytest.raises(SpecmlxError, match="disk full"):
        quantize(model_dirs["target"], tmp_path / "q")
    assert os.listdir(tmp_path) == []


def test_too_little_free_space_is_refused_before_writing(model_dirs, tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1000))
    with pytest.raises(SpecmlxError, match=r"not enough disk space .*: it needs 1\.\d MiB, 1000 B"):
        quantize(model_dirs["target"], tmp_path / "q")
    assert os.listdir(tmp_path) == []


def test_a_small_output_is_written_where_a_little_space_is_free(model_dirs, tmp_path, monkeypatch):
    # The tiny model's output is ~0.1 MiB: 2 MB free is plenty, whatever a big model needs.
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=2_000_000))
    quantize(model_dirs["target"], tmp_path / "q")
    specmlx.load(tmp_path / "q")


def quantize_cli_error(args: list[str], capsys) -> str:
    """The one line `specmlx quantize ARGS` says on stderr, having exited 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(["quantize", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: ") and "Traceback" not in err, err
    return err.strip()


@pytest.mark.parametrize("under", ["file/q", "file/deeper/q"])
def test_out_under_a_file_is_one_line_naming_the_file(model_dirs, tmp_path, capsys, under):
    (tmp_path / "file").write_text("not a directory")
    out = tmp_path / under
    said = quantize_cli_error([str(model_dirs["target"]), "-o", str(out)], capsys)
    assert said == (
        f"error: cannot write {out}: {tmp_path / 'file'} is a file, not a directory; "
        "pick an OUT that is not under a file"
    )
    assert os.listdir(tmp_path) == ["file"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0o555 directory anyway")
def test_out_in_a_directory_without_write_permission_is_one_line(model_dirs, tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    said = quantize_cli_error([str(model_dirs["target"]), "-o", str(locked / "q")], capsys)
    assert said.startswith(f"error: cannot write {locked / 'q'}: no permission to write in")
    assert os.listdir(locked) == []


@pytest.mark.parametrize(
    ("code", "says"),
    [
        (errno.EROFS, "is on a read-only file system; pick an OUT on a writable one"),
        (errno.EACCES, "no permission to write in"),
    ],
)
def test_out_the_file_system_refuses_is_one_line_and_leaves_nothing(
    model_dirs, tmp_path, capsys, monkeypatch, code, says
):
    # The OS call creating OUT's temp directory refuses it, as a read-only mount or a
    # directory of another user would (chmod cannot show it: the tests run as root).
    def refused(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(tempfile, "mkdtemp", refused)
    out = tmp_path / "new" / "q"
    said = quantize_cli_error([str(model_dirs["target"]), "-o", str(out)], capsys)
    assert said.startswith(f"error: cannot write {out}: ") and says in said, said
    assert os.listdir(tmp_path) == []


@pytest.fixture
def copy_of_target(model_dirs, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(model_dirs["target"], src)
    return src


def bad_input(src: Path, match: str, out: Path | None = None, **settings) -> None:
    out = out or src.parent / "q"
    before = set(os.listdir(src.parent))
    with pytest.raises(SpecmlxError, match=match):
        quantize(src, out, **settings)
    assert_nothing_left(src.parent, before)


def test_missing_config_is_refused(copy_of_target):
    (copy_of_target / "config.json").unlink()
    bad_input(copy_of_target, "has no config.json")


def test_config_that_is_not_json_is_refused(copy_of_target):
    (copy_of_target / "config.json").write_text("{not json")
    bad_input(copy_of_target, "config.json is not valid JSON")


def test_config_without_model_type_is_refused(copy_of_target):
    (copy_of_target / "config.json").write_text('{"hidden_size": 64}')
    bad_input(copy_of_target, "malformed: it has no model_type")


def test_unsupported_architecture_is_refused_with_the_supported_list(copy_of_target):
    config = json.loads((copy_of_target / "config.json").read_text())
    config["model_type"] = "mamba"
    (copy_of_target / "config.json").write_text(json.dumps(config))
    bad_input(copy_of_target, r"unsupported architecture 'mamba'; supported: llama, .*qwen2")


def test_already_quantized_source_is_refused(model_dirs, tmp_path):
    quantize(model_dirs["target"], tmp_path / "q")
    bad_input(tmp_path / "q", "already quantized", out=tmp_path / "again")


def test_truncated_safetensors_is_refused(copy_of_target):
    weights = copy_of_target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    bad_input(copy_of_target, "is truncated: tensor")


def test_corrupt_safetensors_header_is_refused(copy_of_target):
    weights = copy_of_target / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:40] = b"\x00garbage, not the JSON header.."
    weights.write_bytes(bytes(data))
    bad_input(copy_of_target, "corrupt safetensors header")


def test_tensors_not_matching_the_config_are_refused(copy_of_target):
    config = json.loads((copy_of_target / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (copy_of_target / "config.json").write_text(json.dumps(config))
    bad_input(copy_of_target, "missing model.layers.2")


@pytest.mark.parametrize("bits", [1, 5, 16])
def test_bits_outside_the_supported_set_are_refused(copy_of_target, bits):
    bad_input(copy_of_target, r"--bits must be one of 2, 3, 4, 6, 8", bits=bits)


@pytest.mark.parametrize("group_size", [16, 100, 256])
def test_group_size_outside_the_supported_set_are_refused(copy_of_target, group_size):
    bad_input(copy_of_target, r"--group-size must be one of 32, 64, 128", group_size=group_size)


def test_out_inside_src_is_refused(copy_of_target):
    before = set(os.listdir(copy_of_target))
    with pytest.raises(SpecmlxError, match="is inside the source"):
        quantize(copy_of_target, copy_of_target / "int4")
    assert set(os.listdir(copy_of_target)) == before


def test_out_that_would_overwrite_src_is_refused_even_with_force(copy_of_target):
    bad_input(copy_of_target, "would overwrite the source", out=copy_of_target.parent, force=True)


def test_cli_prints_a_summary(model_dirs, tmp_path, capsys):
    main(["quantize", str(model_dirs["target"]), "-o", str(tmp_path / "q")])
    err = capsys.readouterr().err
    assert "wrote" in err and "bits/weight" in err and "M parameters" in err
    specmlx.load(tmp_path / "q")


def test_cli_bad_input_is_one_error_line_and_exit_2(model_dirs, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["quantize", str(model_dirs["target"]), "-o", str(tmp_path / "q"), "--bits", "5"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --bits must be one of") and "\n" not in err


def hub_cache_with(model_dir: Path, cache: Path, repo: str) -> None:
    """Lay out `model_dir` as huggingface_hub's cache holds a downloaded snapshot of `repo`."""
    root = cache / f"models--{repo.replace('/', '--')}"
    commit = "0" * 40
    shutil.copytree(model_dir, root / "snapshots" / commit)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)


def run_offline(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "specmlx", "quantize", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_hub_id_is_read_from_the_local_cache_when_offline(model_dirs, tmp_path):
    hub_cache_with(model_dirs["target"], tmp_path / "cache", "org/tiny")
    result = run_offline(["org/tiny", "-o", str(tmp_path / "q")], tmp_path / "cache")
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "q" / "specmlx.json").read_text())["source"] == "org/tiny"


def test_hub_id_missing_from_the_cache_when_offline_is_a_clear_error(tmp_path):
    result = run_offline(["org/absent", "-o", str(tmp_path / "q")], tmp_path / "cache")
    assert result.returncode == 2
    assert result.stderr.startswith("error: org/absent is not in the local hub cache")
    assert "HF_HUB_OFFLINE is set" in result.stderr and result.stderr.count("\n") == 1
    assert not (tmp_path / "q").exists()
