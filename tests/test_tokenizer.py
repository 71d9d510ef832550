"""specmlx.tokenizer (the light tokenizer over `tokenizers`) against mlx-lm's wrapper over
transformers' tokenizer, and the light start it is for: `specmlx generate` that never
imports transformers (specmlx.mlxlm).

The tiny models run everywhere (several architectures, ChatML and a template that uses
what transformers' jinja environment adds); the real Qwen and Gemma tokenizers in
~/.cache/specmlx/models are checked too when they are there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import specmlx
from specmlx import mlxlm
from specmlx.tiny import build_tiny_model
from specmlx.tokenizer import (
    QWEN2_SPLIT,
    TRANSFORMERS_CLASSES,
    load_light,
    transformers_class,
)

REAL = Path(os.environ.get("SPECMLX_REAL_HOME", "~/.cache/specmlx")).expanduser() / "models"
REAL_MODELS = ["qwen2.5-coder-1.5b-instruct-int4", "gemma3-270m-int4"]
# Tiny architectures whose tokenizer transformers reads from tokenizer.json as it is.
LIGHT_ARCHS = ["llama", "gemma3_text", "qwen3", "phi3"]

TEXTS = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)",
    "Écrire du code, c'est penser deux fois. 数据 和 模型. Ünïcödé and emoji 🙂🙂",
    "<|im_start|>user\nhi<|im_end|>\n<bos>x<eos>",
    "    indented    text   with   runs   of   spaces\tand\ttabs\n\n",
    " a leading space",
    "",
]
SYSTEM = {"role": "system", "content": "You answer in one line."}
CONVERSATIONS = {
    "single": [{"role": "user", "content": "Write quicksort."}],
    "multi-turn": [
        SYSTEM,
        {"role": "user", "content": "hi 🙂"},
        {"role": "assistant", "content": "Hello! 数据"},
        {"role": "user", "content": "and now?"},
    ],
    "system": [SYSTEM, {"role": "user", "content": "hi"}],
}
# What transformers' chat-template environment adds to plain jinja2: trim_blocks and
# lstrip_blocks (the indented blocks below leave no whitespace), loop controls, its
# tojson (no HTML escaping), raise_exception, namespace() and the special-token variables.
FEATURE_TEMPLATE = """
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message['role']) }}
    {%- endif %}
    {%- if message['role'] == 'system' %}{% continue %}{% endif %}
    {%- set ns.turns = ns.turns + 1 %}
    <|im_start|>{{ message['role'] }} {{ message | tojson }}
    {{ message['content'] }}<|im_end|>
    {% if ns.turns > 3 %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant [{{ eos_token }}|{{ pad_token }}]
{% endif %}
{%- if enable_thinking is defined and enable_thinking %}<think>{% endif %}"""


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    dirs = {arch: build_tiny_model(root / arch, arch=arch, layers=2) for arch in LIGHT_ARCHS}
    featured = build_tiny_model(root / "featured", arch="llama", seed=1)
    config_file = featured / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = FEATURE_TEMPLATE
    config_file.write_text(json.dumps(config))
    dirs["llama, template with jinja extras"] = featured
    # Tokens only tokenizer_config.json lists are added to the vocabulary, by transformers
    # and the light tokenizer alike; these make mlx-lm pass enable_thinking=True.
    thinking = build_tiny_model(root / "thinking", arch="llama", seed=2)
    config_file = thinking / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    size = len(json.loads((thinking / "tokenizer.json").read_text())["model"]["vocab"])
    for i, token in enumerate(["<think>", "</think>"]):
        config["added_tokens_decoder"][str(size + i)] = {"content": token, "special": False}
    config["chat_template"] = FEATURE_TEMPLATE
    config_file.write_text(json.dumps(config))
    dirs["llama, thinking tokens in the config"] = thinking
    return dirs


def real_dir(name: str) -> Path:
    path = REAL / name
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"real model {name} is not in {REAL}")
    return path


def pair(path: Path):
    """(light tokenizer, mlx-lm's load_tokenizer) for one model directory."""
    from mlx_lm.utils import load_config, load_tokenizer

    config = load_config(path)
    light, why = load_light(path, config, config.get("eos_token_id"))
    assert light is not None, why
    return light, load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))


@pytest.fixture(
    scope="module",
    params=[
        *LIGHT_ARCHS,
        "llama, template with jinja extras",
        "llama, thinking tokens in the config",
        *REAL_MODELS,
    ],
)
def tokenizers(request, tiny_dirs):
    """(light, mlx-lm's) for each tiny model, and each real one that is present."""
    name = request.param
    return pair(tiny_dirs[name] if name in tiny_dirs else real_dir(name))


@pytest.mark.parametrize("special", [True, False])
def test_encode_matches_transformers(tokenizers, special):
    light, reference = tokenizers
    for text in TEXTS:
        assert light.encode(text, add_special_tokens=special) == reference.encode(
            text, add_special_tokens=special
        ), text


@pytest.mark.parametrize("skip", [False, True])
def test_decode_matches_transformers(tokenizers, skip):
    light, reference = tokenizers
    for text in TEXTS:
        ids = reference.encode(text)
        assert light.decode(ids, skip_special_tokens=skip) == reference.decode(
            ids, skip_special_tokens=skip
        )


def test_special_tokens_and_vocabulary_match_transformers(tokenizers):
    light, reference = tokenizers
    assert light.eos_token_ids == reference.eos_token_ids
    assert (light.bos_token, light.eos_token_id) == (reference.bos_token, reference.eos_token_id)
    assert len(light) == len(reference)
    assert light.get_vocab() == reference.get_vocab()
    assert {i: (t.content, t.special) for i, t in light.added_tokens_decoder.items()} == {
        i: (t.content, t.special) for i, t in reference.added_tokens_decoder.items()
    }
    assert light.has_chat_template == reference.has_chat_template
    assert light.has_thinking == reference.has_thinking


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=list(CONVERSATIONS))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_renders_as_transformers(tokenizers, conversation, generation_prompt):
    light, reference = tokenizers
    if not reference.has_chat_template:
        pytest.skip("no chat template (gemma3-270m is a base model)")
    messages = CONVERSATIONS[conversation]
    kwargs = {"add_generation_prompt": generation_prompt}
    text = light.apply_chat_template(messages, tokenize=False, **kwargs)
    assert text == reference.apply_chat_template(messages, tokenize=False, **kwargs)
    assert light.apply_chat_template(messages, **kwargs) == list(
        reference.apply_chat_template(messages, **kwargs)
    )


def test_thinking_tokens_turn_enable_thinking_on_as_in_mlx_lm(tiny_dirs):
    light, reference = pair(tiny_dirs["llama, thinking tokens in the config"])
    assert light.has_thinking and reference.has_thinking
    text = light.apply_chat_template(CONVERSATIONS["single"], tokenize=False)
    assert text.endswith("<think>")
    assert text == reference.apply_chat_template(CONVERSATIONS["single"], tokenize=False)


def test_template_variables_reach_the_template(tiny_dirs):
    light, reference = pair(tiny_dirs["llama, template with jinja extras"])
    messages = CONVERSATIONS["single"]
    text = light.apply_chat_template(messages, tokenize=False, enable_thinking=True)
    assert text.endswith("<think>")  # a caller's kwarg beats mlx-lm's default
    assert text == reference.apply_chat_template(messages, tokenize=False, enable_thinking=True)


def test_template_raise_exception_raises_as_in_transformers(tiny_dirs):
    import jinja2

    light, _ = pair(tiny_dirs["llama, template with jinja extras"])
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role tool"):
        light.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def stream(tokenizer, ids: list[int]) -> list[str]:
    """The segments a generation streams for `ids`, with the flush at the end."""
    detokenizer = tokenizer.detokenizer
    segments = []
    for token in ids:
        detokenizer.add_token(token)
        segments.append(detokenizer.last_segment)
    detokenizer.finalize()
    return [*segments, detokenizer.last_segment]


def test_streamed_text_is_the_full_decode(tokenizers):
    light, reference = tokenizers
    for text in TEXTS:
        ids = reference.encode(text, add_special_tokens=False)
        assert "".join(stream(light, ids)) == reference.decode(ids)


def test_streamed_text_matches_mlx_lm_s_detokenizer_but_keeps_a_leading_space(tokenizers):
    # mlx-lm's BPE detokenizer drops a space the first token starts with; the full decode,
    # which the light one streams, keeps it.
    light, reference = tokenizers
    for text in TEXTS:
        ids = reference.encode(text, add_special_tokens=False)
        mlx_lm_text = "".join(stream(reference, ids))
        light_text = "".join(stream(light, ids))
        assert light_text in (mlx_lm_text, " " + mlx_lm_text)


def test_a_character_split_across_tokens_streams_once_whole(tiny_dirs):
    light, _ = pair(tiny_dirs["llama"])
    ids = light.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # byte-level: the emoji's four bytes are several tokens
    segments = stream(light, ids)
    assert "".join(segments) == "🙂" and "\ufffd" not in "".join(segments)
    assert segments[-2:] == ["🙂", ""]  # nothing until its last byte arrives


def test_an_unfinished_character_is_flushed_as_decode_gives_it(tiny_dirs):
    light, _ = pair(tiny_dirs["llama"])
    ids = light.encode("ok 🙂", add_special_tokens=False)[:-1]
    assert "".join(stream(light, ids)) == light.decode(ids)
    assert light.decode(ids).endswith("\ufffd")


def test_each_detokenizer_is_fresh(tiny_dirs):
    light, _ = pair(tiny_dirs["llama"])
    first = light.detokenizer
    first.add_token(light.encode("hello")[0])
    assert light.detokenizer.text == "" and light.detokenizer.tokens == []


def test_qwen2_model_type_whose_tokenizer_json_transformers_rebuilds_falls_back(model_dirs):
    # tiny.py's byte-level pipeline is not Qwen2Tokenizer's (no NFC, GPT-2 split): for
    # model_type qwen2 transformers builds its own, so the light tokenizer refuses.
    model = specmlx.load(model_dirs["target"])
    assert model.info["tokenizer"].startswith("transformers: Qwen2Tokenizer rebuilds")
    assert type(model.tokenizer).__name__ == "TokenizerWrapper"


def test_remote_code_tokenizer_falls_back(tiny_dirs, tmp_path):
    import shutil

    path = shutil.copytree(tiny_dirs["llama"], tmp_path / "remote")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["x.Tok", None]}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer, why = load_light(path, {"model_type": "llama"})
    assert tokenizer is None and why == "tokenizer_config.json sets auto_map"


def test_light_model_load_reports_its_tokenizer(tiny_dirs):
    model = specmlx.load(tiny_dirs["llama"])
    assert model.info["tokenizer"] == "tokenizers"
    assert type(model.tokenizer).__name__ == "LightTokenizer"


def test_transformers_tokenizer_on_request(tiny_dirs, monkeypatch):
    monkeypatch.setenv("SPECMLX_TOKENIZER", "transformers")
    model = specmlx.load(tiny_dirs["llama"])
    assert model.info["tokenizer"] == "transformers: SPECMLX_TOKENIZER=transformers"


def test_a_generation_is_the_same_with_either_tokenizer(tiny_dirs, monkeypatch):
    path = tiny_dirs["qwen3"]
    light = specmlx.load(path)
    monkeypatch.setenv("SPECMLX_TOKENIZER", "transformers")
    heavy = specmlx.load(path)
    for model in (light, heavy):
        model.tokenizer.eos_token_ids = set()  # random weights: a fixed length
    prompt = light.tokenizer.apply_chat_template(CONVERSATIONS["multi-turn"], tokenize=False)
    runs = [specmlx.generate(m, prompt, max_tokens=24, temperature=0) for m in (light, heavy)]
    for gen in runs:
        list(gen)
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].text == light.tokenizer.decode(runs[0].tokens)
    assert runs[0].text in (runs[1].text, " " + runs[1].text)  # mlx-lm's drops a first space


@pytest.mark.parametrize("model_type", sorted(TRANSFORMERS_CLASSES))
def test_transformers_class_table_is_transformers_own(model_type):
    from transformers.models.auto import tokenization_auto as auto

    registered, overridden = TRANSFORMERS_CLASSES[model_type]
    assert auto.TOKENIZER_MAPPING_NAMES.get(model_type) == registered
    assert (model_type in auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS) == overridden


@pytest.mark.parametrize("arch", [*LIGHT_ARCHS, "qwen2"])
def test_transformers_class_is_the_class_auto_tokenizer_builds(arch, tiny_dirs, model_dirs):
    from transformers import AutoTokenizer

    path = model_dirs["target"] if arch == "qwen2" else tiny_dirs[arch]
    built = type(AutoTokenizer.from_pretrained(path)).__name__
    assert transformers_class(arch, "PreTrainedTokenizerFast") == built


def test_qwen2_split_is_qwen2_tokenizer_s():
    from transformers.models.qwen2 import tokenization_qwen2

    assert QWEN2_SPLIT == tokenization_qwen2.PRETOKENIZE_REGEX


def test_model_remapping_is_mlx_lm_s():
    import mlx_lm.utils

    assert mlxlm.MODEL_REMAPPING == mlx_lm.utils.MODEL_REMAPPING
    assert mlxlm.MODEL_ARCHITECTURE_REMAPPING == mlx_lm.utils.MODEL_ARCHITECTURE_REMAPPING


def test_built_model_is_mlx_lm_s(tiny_dirs):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    path = tiny_dirs["gemma3_text"]
    config = mlxlm.load_config(path)
    weights = mx.load(str(path / "model.safetensors"))
    built = mlxlm.build_model(config, weights)
    reference, reference_config = load_model(path, lazy=True)
    assert config == reference_config
    ours, theirs = (
        dict(tree_flatten(built.parameters())),
        dict(tree_flatten(reference.parameters())),
    )
    assert ours.keys() == theirs.keys()
    assert all(mx.array_equal(ours[k], theirs[k]).item() for k in ours)


def run_python(code: str) -> str:
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_generate_on_a_light_model_never_imports_transformers(tiny_dirs):
    code = f"""
import runpy, sys
sys.argv = ["specmlx", "generate", "-m", {str(tiny_dirs["llama"])!r}, "--no-draft", "-n", "4",
            "-q", "hello"]
try:
    runpy.run_module("specmlx", run_name="__main__")
except SystemExit as e:
    assert not e.code, e.code
print("transformers" in sys.modules, "mlx_lm.utils" in sys.modules)
"""
    assert run_python(code).splitlines()[-1] == "False False"


def test_mlx_lm_s_own_names_still_work_after_specmlx_is_imported():
    code = """
import specmlx, sys
import mlx_lm.models.qwen2, mlx_lm.models.cache
before = "transformers" in sys.modules
import mlx_lm
print(before, callable(mlx_lm.load), mlx_lm.__version__ == mlx_lm._version.__version__)
"""
    assert run_python(code) == "False True True"
