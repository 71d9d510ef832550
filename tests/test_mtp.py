"""The MTP layers a checkpoint ships (specmlx/heads/mtp.py), read as a head: each layout's
weights land where the head reads them, drafting with them keeps the target alone's text
(greedy, and coupled at T = 1), a checkpoint without them (or with part of them) is
refused in one line, and `specmlx quantize` keeps them, quantized, in a model that still
loads as mlx-lm's convert writes it.

The tiny checkpoints are written in the hub's layout (specmlx.tiny, mtp=True): experts one
by one, Qwen3-Next's norms as weight - 1, DeepSeek's kv_b_proj whole, the MTP layer beside
the model's own, where mlx-lm's sanitize drops it when the target loads. Their MTP layers
are random: acceptance is near zero, which exactness does not need."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import specmlx
from specmlx.convert.quantize import quantize
from specmlx.errors import SpecmlxError
from specmlx.heads.mtp import MTP_FILE, has_mtp, load_mtp
from specmlx.tiny import build_tiny_model

PROMPT = "def fibonacci(n):\n    if n < 2:"
N = 24
ARCHS = ["qwen3_next", "deepseek_v3", "glm4_moe", "mimo"]
# Per layout, head parameters and what they must equal: (parameter, stored key, what the
# loader adds to it, the expert it is where the head stacks experts).
PLACES = {
    "qwen3_next": [
        ("enorm.weight", "mtp.pre_fc_norm_embedding.weight", 1.0, None),
        ("hnorm.weight", "mtp.pre_fc_norm_hidden.weight", 1.0, None),
        ("norm.weight", "mtp.norm.weight", 1.0, None),
        ("fc.weight", "mtp.fc.weight", 0.0, None),
        ("layer.input_layernorm.weight", "mtp.layers.0.input_layernorm.weight", 1.0, None),
        ("layer.self_attn.q_norm.weight", "mtp.layers.0.self_attn.q_norm.weight", 1.0, None),
        (
            "layer.mlp.switch_mlp.up_proj.weight",
            "mtp.layers.0.mlp.experts.2.up_proj.weight",
            0.0,
            2,
        ),
    ],
    "deepseek_v3": [
        ("enorm.weight", "model.layers.61.enorm.weight", 0.0, None),
        ("hnorm.weight", "model.layers.61.hnorm.weight", 0.0, None),
        ("norm.weight", "model.layers.61.shared_head.norm.weight", 0.0, None),
        ("fc.weight", "model.layers.61.eh_proj.weight", 0.0, None),
        ("layer.input_layernorm.weight", "model.layers.61.input_layernorm.weight", 0.0, None),
        (
            "layer.mlp.switch_mlp.down_proj.weight",
            "model.layers.61.mlp.experts.3.down_proj.weight",
            0.0,
            3,
        ),
    ],
    "glm4_moe": [
        ("fc.weight", "model.layers.2.eh_proj.weight", 0.0, None),
        ("norm.weight", "model.layers.2.shared_head.norm.weight", 0.0, None),
        (
            "layer.mlp.switch_mlp.gate_proj.weight",
            "model.layers.2.mlp.experts.1.gate_proj.weight",
            0.0,
            1,
        ),
    ],
    "mimo": [
        ("enorm.weight", "model.mtp_layers.0.token_layernorm.weight", 0.0, None),
        ("hnorm.weight", "model.mtp_layers.0.hidden_layernorm.weight", 0.0, None),
        ("fc.weight", "model.mtp_layers.0.input_proj.weight", 0.0, None),
        ("norm.weight", "model.mtp_layers.0.final_layernorm.weight", 0.0, None),
        ("layer.self_attn.q_proj.bias", "model.mtp_layers.0.self_attn.q_proj.bias", 0.0, None),
    ],
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """arch -> the directory of a tiny `arch` model with an MTP layer, built once."""
    root = tmp_path_factory.mktemp("mtp")
    made = {}

    def build(arch: str):
        if arch not in made:
            made[arch] = build_tiny_model(root / arch, arch=arch, seed=0, mtp=True)
        return made[arch]

    return build


@pytest.fixture(scope="module")
def loaded(built):
    """arch -> (the target, its MTP head), loaded once."""
    made = {}

    def load(arch: str):
        if arch not in made:
            target = specmlx.load(built(arch))
            target.tokenizer.eos_token_ids = set()  # every run decodes N tokens
            made[arch] = target, load_mtp(target)
        return made[arch]

    return load


def stored(path) -> dict[str, mx.array]:
    weights = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(mx.load(str(file)))
    return weights


@pytest.mark.parametrize("arch", ARCHS)
def test_the_head_holds_the_checkpoints_mtp_layer_in_mlx_layout(loaded, arch):
    target, head = loaded(arch)
    assert has_mtp(target.path)
    raw = stored(target.path)
    params = dict(tree_flatten(head.module.parameters()))
    for name, key, offset, expert in PLACES[arch]:
        value = params[name] if expert is None else params[name][expert]
        assert mx.array_equal(value, raw[key] + offset).item(), name


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("gamma", [3, "auto"])
def test_greedy_with_the_mtp_head_equals_the_target_alone(loaded, arch, gamma):
    target, head = loaded(arch)
    alone = specmlx.generate(target, PROMPT, max_tokens=N, num_draft=0).run()
    session = specmlx.Session(target, head=head)
    gen = specmlx.generate(
        target, PROMPT, max_tokens=N, num_draft=gamma, session=session, draft_mode="head"
    )
    assert gen.run().tokens == alone.tokens
    assert gamma == "auto" or gen.stats.rounds_by_source.get("head", 0) > N // 4


@pytest.mark.parametrize("arch", ["qwen3_next", "deepseek_v3"])
def test_coupled_sampling_with_the_mtp_head_equals_the_target_alone(loaded, arch):
    target, head = loaded(arch)
    kw = dict(max_tokens=N, temperature=1.0, sampling="coupled", seed=3)
    alone = specmlx.generate(target, PROMPT, num_draft=0, **kw).run()
    gen = specmlx.generate(target, PROMPT, head, num_draft=3, draft_mode="head", **kw).run()
    assert gen.tokens == alone.tokens
    assert gen.stats.drafted > 0


@pytest.mark.parametrize(
    "which, says",
    [
        ("qwen2", "specmlx reads the MTP layers of deepseek_v3, glm4_moe, mimo, qwen3_next"),
        ("qwen3_next", "has no MTP layers; load the original checkpoint"),
    ],
)
def test_a_target_without_mtp_layers_has_none_and_is_refused_in_one_line(
    which, says, model_dirs, tiny_pair
):
    path = model_dirs["target"] if which == "qwen2" else tiny_pair("qwen3_next")[0]
    assert not has_mtp(path)
    with pytest.raises(SpecmlxError, match=says) as refused:
        load_mtp(specmlx.load(path))
    assert "\n" not in str(refused.value) and "draft with a model or a head" in str(refused.value)


@pytest.mark.parametrize(
    "dropped, seen_in_headers",
    [("mtp.fc.weight", True), ("mtp.layers.0.self_attn.q_proj.weight", False)],
)
def test_an_incomplete_mtp_layer_is_refused_naming_what_is_missing(
    built, tmp_path, dropped, seen_in_headers
):
    path = tmp_path / "partial"
    shutil.copytree(built("qwen3_next"), path)
    weights = mx.load(str(path / "model.safetensors"))
    del weights[dropped]
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    assert has_mtp(path) is not seen_in_headers  # the headers show the head's own only
    target = specmlx.load(path)  # the rest of the MTP layer is dropped as ever
    with pytest.raises(SpecmlxError, match=f"MTP layer is incomplete: {dropped}") as refused:
        load_mtp(target)
    assert "\n" not in str(refused.value)


@pytest.fixture(scope="module")
def converted(built, tmp_path_factory):
    """The tiny Qwen3-Next with MTP, converted by `specmlx quantize` (INT4 g32)."""
    out = tmp_path_factory.mktemp("converted") / "q4"
    quantize(built("qwen3_next"), out, group_size=32, dtype="float32")
    return out


def test_quantize_keeps_the_mtp_layer_quantized_beside_the_model(converted):
    assert has_mtp(converted)
    kept = mx.load(str(converted / MTP_FILE))
    assert all(k.startswith("mtp.") for k in kept)
    assert not any(k.startswith("mtp.") for k in stored(converted) if k not in kept)
    config = json.loads((converted / "config.json").read_text())
    cols = config["hidden_size"] * 2  # fc reads the embedding beside the feature
    assert kept["mtp.fc.weight"].shape[-1] == cols * 4 // 32  # INT4, as the model's layers
    assert kept["mtp.fc.scales"].shape[-1] == cols // 32
    assert kept["mtp.layers.0.mlp.gate.weight"].shape[-1] == config["hidden_size"] * 8 // 32


def test_the_quantized_mtp_head_decodes_exactly(converted):
    target = specmlx.load(converted)
    target.tokenizer.eos_token_ids = set()
    head = load_mtp(target)
    assert head.weights == "int4"
    alone = specmlx.generate(target, PROMPT, max_tokens=N, num_draft=0).run()
    gen = specmlx.generate(target, PROMPT, head, max_tokens=N, num_draft=3, draft_mode="head")
    assert gen.run().tokens == alone.tokens
    assert gen.stats.rounds_by_source.get("head", 0) > N // 4


def test_the_converted_model_itself_is_what_mlx_lms_convert_writes(built, tmp_path):
    # Qwen3-Next's sanitize stacks experts and shifts norms: quantize runs it on lazy
    # arrays, and the model's files come out tensor for tensor as mlx-lm's.
    from mlx_lm.convert import convert

    source = built("qwen3_next")
    quantize(source, tmp_path / "ours", embed_bits=4, dtype="float16")
    convert(str(source), str(tmp_path / "theirs"), True, 64, 4, dtype="float16")
    ours = {k: v for k, v in stored(tmp_path / "ours").items() if not k.startswith("mtp.")}
    theirs = stored(tmp_path / "theirs")
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and mx.array_equal(ours[key], value).item(), key
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    reference = json.loads((tmp_path / "theirs" / "config.json").read_text())
    assert config["quantization"] == reference["quantization"]


def test_generate_drafts_with_the_mtp_layer_by_default_and_says_so(converted):
    def generate(*extra: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "specmlx", "generate", "-m", str(converted)]
        command += ["-p", "def", "-n", "8", *extra]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    done, plain = generate(), generate("--no-draft")
    assert done.returncode == 0, done.stderr
    assert f"the MTP layers in {converted.name}'s checkpoint" in done.stderr
    assert "MTP" not in plain.stderr and plain.stdout == done.stdout


def test_an_mtp_head_grows_trees_that_keep_greedy_output_the_target_alones(loaded):
    # DeepSeek-V3 is all attention: trees are judged whole (a hybrid target, Qwen3-Next,
    # verifies chains: a recurrent state per branch is not built)
    target, head = loaded("deepseek_v3")
    plain = specmlx.generate(target, PROMPT, max_tokens=N, num_draft=0).run()
    gen = specmlx.generate(
        target, PROMPT, head, max_tokens=N, num_draft=3, tree=6, draft_mode="head"
    )
    assert gen.run().tokens == plain.tokens and gen.stats.tree_rounds > 0
