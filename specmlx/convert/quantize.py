"""Any supported checkpoint → an MLX affine-quantized directory in mlx-lm's exact format.

The model is never held in memory: the target architecture's mlx-lm class is built
lazily only to learn parameter names, shapes and which layers quantize; then each
tensor is read a chunk of rows at a time, cast, quantized with `mx.quantize` (the call
mlx-lm's `nn.quantize` makes, so the packed bits are identical) and streamed into a
pre-planned shard. Everything lands in a temp dir beside OUT that is renamed into place
only when complete, so an error or Ctrl-C leaves no partial OUT behind.

A checkpoint's MTP layer (specmlx.heads.mtp), which mlx-lm's convert drops, is kept: in
MLX's layout, quantized as the model's layers are, under its upstream names, in its own
file (heads.mtp.MTP_FILE), so that `--draft mtp` still finds it in the converted model.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..errors import SpecmlxError
from . import shards
from .output import atomic_directory, check_free_space, check_output, check_writable
from .source import Source, SourceTensor

BITS = (2, 3, 4, 6, 8)
GROUP_SIZES = (32, 64, 128)
KEEP = 16  # --embed-bits 16: leave embedding and head unquantized, in --dtype
OUTPUT_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
# Architectures whose mlx-lm `sanitize` computes tensors (stacks experts, shifts norms): it
# runs on lazily loaded arrays, and what it computes is evaluated one tensor at a time
# (`through`). The others' only drops or renames tensors, so it runs on their descriptions.
COMPUTED_ARCHS = ("qwen3_next",)
SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", *COMPUTED_ARCHS)
MAX_SHARD_BYTES = 5 << 30  # mlx-lm's MAX_FILE_SIZE_GB
CHUNK_ELEMENTS = 1 << 23  # rows read per step: ~32 MB of float32, whatever the tensor
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.json",
    "chat_template.jinja",
    "generation_config.json",
)


@dataclass
class Progress:
    tensor: str
    tensors_done: int
    tensors_total: int
    bytes_done: int
    bytes_total: int


@dataclass
class Summary:
    out: Path
    source: str
    parameters: int
    size_bytes: int
    bits_per_weight: float
    seconds: float
    shards: int
    unquantized: list[str] = field(default_factory=list)


@dataclass
class _Spec:
    """What happens to one source tensor: its outputs and, if quantized, how."""

    name: str
    outputs: list[shards.Planned]
    tensor: SourceTensor
    bits: int | None = None
    group_size: int | None = None


def check_settings(bits: int, group_size: int, embed_bits: int, dtype: str | None) -> None:
    if bits not in BITS:
        raise SpecmlxError(f"--bits must be one of {', '.join(map(str, BITS))}, got {bits}")
    if group_size not in GROUP_SIZES:
        raise SpecmlxError(
            f"--group-size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}"
        )
    if embed_bits not in (*BITS, KEEP):
        raise SpecmlxError(
            f"--embed-bits must be one of {', '.join(map(str, BITS))} or {KEEP} (unquantized), "
            f"got {embed_bits}"
        )
    if dtype is not None and dtype not in OUTPUT_DTYPES:
        raise SpecmlxError(f"--dtype must be one of {', '.join(OUTPUT_DTYPES)}, got {dtype!r}")


def open_source(src: str | Path) -> Source:
    """A .gguf file, a Hugging Face safetensors directory, or a hub id (fetched if needed)."""
    from ..loading import resolve_path

    path = Path(src).expanduser()
    if path.suffix.lower() == ".gguf" or path.is_file():
        from .gguf import open_gguf

        if not path.exists():
            raise SpecmlxError(f"GGUF file {path} does not exist")
        return open_gguf(path)
    try:
        return open_safetensors_dir(resolve_path(src), str(src))
    except SpecmlxError:
        from huggingface_hub import constants

        if path.exists() or not constants.HF_HUB_OFFLINE:
            raise
        raise SpecmlxError(
            f"{src} is not in the local hub cache and HF_HUB_OFFLINE is set: "
            "unset it to download, or pass a local directory"
        ) from None


def open_safetensors_dir(path: Path, location: str) -> Source:
    config = read_model_config(path)
    check_arch(config.get("model_type"))
    index_file = path / "model.safetensors.index.json"
    if index_file.exists():
        try:
            files = sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError):
            raise SpecmlxError(f"{index_file} is corrupt: no valid weight_map") from None
        weight_files = [path / name for name in files]
        missing = [f.name for f in weight_files if not f.exists()]
        if missing:
            raise SpecmlxError(f"{path} is incomplete: {', '.join(missing)} listed but absent")
    else:
        weight_files = sorted(path.glob("model*.safetensors"))
    if not weight_files:
        raise SpecmlxError(
            f"{path} has no model*.safetensors weights (PyTorch .bin checkpoints are not read)"
        )
    digest = hashlib.sha256((path / "config.json").read_bytes())
    if index_file.exists():
        digest.update(index_file.read_bytes())
    tensors = {}
    for file in weight_files:
        stored, raw_header = shards.read_header(file)
        digest.update(raw_header)
        for name, t in stored.items():
            array = partial(_lazy, file, name)
            tensors[name] = SourceTensor(t.shape, t.nbytes, t.read_rows, array=array)
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise SpecmlxError(f"{path} has no tokenizer (tokenizer.json, tokenizer.model, vocab.json)")

    def copy_tokenizer(out: Path) -> None:
        for name in TOKENIZER_FILES:
            if (path / name).exists():
                shutil.copy(path / name, out / name)
        for file in path.glob("*.tiktoken"):
            shutil.copy(file, out / file.name)

    return Source(
        location,
        path,
        "safetensors",
        config,
        tensors,
        digest.hexdigest(),
        "config.json, model.safetensors.index.json and the safetensors headers",
        copy_tokenizer,
    )


def read_model_config(path: Path) -> dict:
    from ..loading import read_config

    config = read_config(path)
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise SpecmlxError(f"{path / 'config.json'} is malformed: it has no model_type")
    if "quantization" in config or "quantization_config" in config:
        raise SpecmlxError(
            f"{path} is already quantized; quantize its original float checkpoint instead"
        )
    return config


def check_arch(model_type: str | None) -> None:
    if model_type not in SUPPORTED_ARCHS:
        raise SpecmlxError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(SUPPORTED_ARCHS)}"
        )


def build_skeleton(config: dict) -> nn.Module:
    """The mlx-lm model with lazy, never-evaluated random weights: names and shapes only."""
    from mlx_lm.utils import _get_classes

    try:
        model_class, args_class = _get_classes(config)
        return model_class(args_class.from_dict(config))
    except (ValueError, TypeError, KeyError) as e:
        raise SpecmlxError(f"config.json does not describe a valid model: {e}") from None


def plan(
    source: Source, bits: int, group_size: int, embed_bits: int, dtype: str
) -> tuple[list[_Spec], dict, list[str], list[_Spec]]:
    """Per tensor: outputs and bits; the config's `quantization` entry; unquantized layers;
    and the specs of the MTP layer kept in its own file ([] where there is none).

    Which layers quantize follows mlx-lm's `quantize_model`: every module that can
    (`to_quantized`) and whose input dimension divides into groups, with the settings the
    model's `quant_predicate` gives it where it has one.
    """
    from ..heads import mtp

    model = build_skeleton(source.config)
    aside = set(mtp.mtp_keys(source.config, source.tensors))
    tensors = {name: t for name, t in source.tensors.items() if name not in aside}
    if hasattr(model, "sanitize"):
        if source.config["model_type"] in COMPUTED_ARCHS:
            tensors = through(model.sanitize, tensors)
        else:
            tensors = model.sanitize(dict(tensors))
    expected = dict(tree_flatten(model.parameters()))
    check_names(source.path, "tensors", expected, tensors)
    quantization: dict = {"group_size": group_size, "bits": bits, "mode": "affine"}
    predicate = getattr(model, "quant_predicate", None)
    settings, unquantized = layer_settings(
        model, predicate, quantization, bits, group_size, embed_bits
    )
    type_name = shards.NAMES[OUTPUT_DTYPES[dtype]]
    specs = [
        _spec(name, tensors[name], param.shape, settings, type_name, source.path)
        for name, param in expected.items()
    ]
    kept = plan_mtp(model, predicate, source, aside, bits, group_size, type_name)
    return specs, quantization, unquantized, kept


def plan_mtp(
    model: nn.Module,
    predicate: Callable | None,
    source: Source,
    aside: set[str],
    bits: int,
    group_size: int,
    type_name: str,
) -> list[_Spec]:
    """The first MTP layer among the tensors set `aside`: in MLX's layout (the model's own
    sanitize stacks its experts, shifts its norms), its layers quantized as the model's,
    under its upstream names. Refused in one line where it is incomplete."""
    from ..heads import mtp

    config = source.config
    found = mtp.find(config, aside)
    if not found.keys:
        return []
    missing = found.missing()
    if missing:
        raise SpecmlxError(
            f"{source.path}: its MTP layer is incomplete ({', '.join(missing)} missing); "
            "re-download the checkpoint"
        )
    head = mtp.skeleton(model, config)
    tensors = through(
        lambda arrays: mtp.head_weights(model, config, arrays),
        {name: source.tensors[name] for name in found.keys},
    )
    expected = dict(tree_flatten(head.parameters()))
    check_names(source.path, "MTP tensors", expected, tensors)
    settings, _ = layer_settings(head, predicate, {}, bits, group_size, bits)
    stored = partial(mtp.stored_name, config)
    return [
        _spec(name, tensors[name], param.shape, settings, type_name, source.path, stored)
        for name, param in expected.items()
    ]


def check_names(path: Path, what: str, expected: dict, tensors: dict) -> None:
    """Refuse, in one line, tensors that are not the ones the config's architecture has."""
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        problems = []
        if missing:
            problems.append(f"missing {', '.join(missing[:4])}{' …' if len(missing) > 4 else ''}")
        if extra:
            problems.append(f"unexpected {', '.join(extra[:4])}{' …' if len(extra) > 4 else ''}")
        raise SpecmlxError(
            f"{path}: {what} do not match the config's architecture ({'; '.join(problems)})"
        )


def layer_settings(
    model: nn.Module,
    predicate: Callable | None,
    quantization: dict,
    bits: int,
    group_size: int,
    embed_bits: int,
) -> tuple[dict[str, tuple[int, int]], list[str]]:
    """(bits, group size) of each layer that quantizes, and the layers that do not; the
    per-layer settings that differ from the defaults are added to `quantization`."""
    settings: dict[str, tuple[int, int]] = {}
    unquantized = []
    for path, module in model.named_modules():
        if not hasattr(module, "to_quantized"):
            continue
        is_embedding = isinstance(module, nn.Embedding) or path.split(".")[-1] == "lm_head"
        chosen = True if predicate is None else predicate(path, module)
        if module.weight.shape[-1] % group_size != 0:
            unquantized.append(path)
        elif is_embedding and embed_bits == KEEP:
            unquantized.append(path)
        elif is_embedding and embed_bits != bits:
            settings[path] = (embed_bits, group_size)
            quantization[path] = {"group_size": group_size, "bits": embed_bits, "mode": "affine"}
        elif chosen is False:
            unquantized.append(path)
        elif isinstance(chosen, dict):
            settings[path] = (chosen["bits"], chosen["group_size"])
            quantization[path] = chosen
        else:
            settings[path] = (bits, group_size)
    return settings, unquantized


def _spec(
    name: str,
    tensor: SourceTensor,
    shape: tuple[int, ...],
    settings: dict[str, tuple[int, int]],
    type_name: str,
    path: Path,
    stored: Callable[[str], str] = str,
) -> _Spec:
    """The outputs of tensor `name` (written under `stored(name)`), quantized where its
    layer is in `settings`."""
    if tuple(tensor.shape) != tuple(shape):
        raise SpecmlxError(
            f"{path}: tensor {name} has shape {tuple(tensor.shape)}, "
            f"the config implies {tuple(shape)}"
        )
    module_path, _, leaf = name.rpartition(".")
    setting = settings.get(module_path) if leaf == "weight" else None
    if setting is None:
        return _Spec(stored(name), [shards.Planned(stored(name), type_name, tuple(shape))], tensor)
    bits, size = setting
    *outer, cols = shape
    outputs = [
        shards.Planned(stored(name), "U32", (*outer, cols * bits // 32)),
        shards.Planned(stored(f"{module_path}.scales"), type_name, (*outer, cols // size)),
        shards.Planned(stored(f"{module_path}.biases"), type_name, (*outer, cols // size)),
    ]
    return _Spec(stored(name), outputs, tensor, bits, size)


def _lazy(file: Path, name: str) -> mx.array:
    """Tensor `name` of `file` as a lazy array. mx.load is called per tensor, not once per
    file, so that no dict outlives the call holding arrays already evaluated."""
    return mx.load(str(file))[name]


def through(
    transform: Callable[[dict], dict], tensors: dict[str, SourceTensor]
) -> dict[str, SourceTensor]:
    """`transform` (a sanitize) run on `tensors` as lazy arrays: what it passes through,
    renamed or not, is still read a chunk of rows at a time; what it computes (stacked
    experts, shifted norms) is evaluated whole at its first read and let go at its last."""
    arrays = {name: t.array() for name, t in tensors.items()}
    origin = {id(array): tensors[name] for name, array in arrays.items()}
    out = transform(arrays)
    return {name: origin[id(v)] if id(v) in origin else _computed(v) for name, v in out.items()}


def _computed(array: mx.array) -> SourceTensor:
    held = [array]

    def read_rows(start: int, stop: int) -> mx.array:
        whole = held[0]
        mx.eval(whole)
        if stop == whole.shape[0]:
            held.clear()  # its last rows: nothing keeps it once they are written
        return whole[start:stop]

    return SourceTensor(tuple(array.shape), array.nbytes, read_rows)


def _stream_tensor(
    writer: shards.ShardWriter,
    spec: _Spec,
    dtype: mx.Dtype,
    advance: Callable[[int], None],
) -> None:
    tensor = spec.tensor
    rows = tensor.shape[0]
    row_elems = int(np.prod(tensor.shape[1:], dtype=np.int64))
    align = tensor.row_align
    step = max(align, CHUNK_ELEMENTS // max(row_elems, 1) // align * align)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        x = tensor.read_rows(start, stop).astype(dtype)
        if spec.bits is None:
            arrays = [x]
        else:
            arrays = list(mx.quantize(x, spec.group_size, spec.bits))  # weight, scales, biases
        mx.eval(arrays)
        for planned, array in zip(spec.outputs, arrays, strict=True):
            writer.write_rows(planned.name, start, array)
        advance(tensor.nbytes * (stop - start) // rows)
        del x, arrays


def quantize(
    src: str | Path,
    out: str | Path,
    bits: int = 4,
    group_size: int = 64,
    embed_bits: int = 6,
    dtype: str | None = None,
    force: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    on_progress: Callable[[Progress], None] | None = None,
) -> Summary:
    """Convert `src` (HF dir, hub id or .gguf) into an MLX quantized directory at `out`.

    `embed_bits` applies to the embedding and output head (16 keeps them unquantized; 6,
    the default, costs +0.1% NLL against 8 bits and reads 3/4 of their bytes:
    bench/results/ARCHIVE.md, "6-bit embedding and head");
    `dtype` is that of scales, biases and unquantized tensors (default: the source's
    float16/bfloat16, else float16).
    """
    from .. import __version__
    from ..heads.mtp import MTP_FILE

    t_start = time.perf_counter()
    check_settings(bits, group_size, embed_bits, dtype)
    out = Path(out).expanduser().absolute()
    check_writable(out)
    source = open_source(src)
    check_output(out, source.path, force)
    if dtype is None:
        torch_dtype = source.config.get("torch_dtype")
        dtype = torch_dtype if torch_dtype in ("float16", "bfloat16") else "float16"
    specs, quantization, unquantized, kept = plan(source, bits, group_size, embed_bits, dtype)
    planned_shards = shards.plan_shards((s.outputs for s in specs), max_shard_bytes)
    size_bytes = sum(t.nbytes for shard in planned_shards for t in shard)
    parameters = sum(int(np.prod(s.tensor.shape)) for s in specs)
    kept_outputs = [t for s in kept for t in s.outputs]
    kept_bytes = sum(t.nbytes for t in kept_outputs)
    check_free_space(out, size_bytes + kept_bytes + _tokenizer_bytes(source))

    bytes_total = sum(s.tensor.nbytes for s in specs + kept)
    done = {"bytes": 0, "tensors": 0}
    count = len(specs) + len(kept)

    def advance(nbytes: int, name: str) -> None:
        done["bytes"] += nbytes
        if on_progress is not None:
            on_progress(Progress(name, done["tensors"], count, done["bytes"], bytes_total))

    previous_cache_limit = mx.set_cache_limit(0)  # freed chunks go back to the OS at once
    try:
        with atomic_directory(out) as tmp:
            writer = shards.ShardWriter(tmp, planned_shards)
            aside = shards.ShardWriter(tmp, [kept_outputs], [MTP_FILE])
            try:
                for to, group in ((writer, specs), (aside, kept)):
                    for spec in group:
                        _stream_tensor(
                            to,
                            spec,
                            OUTPUT_DTYPES[dtype],
                            lambda n, name=spec.name: advance(n, name),
                        )
                        done["tensors"] += 1
                        advance(0, spec.name)
            finally:
                writer.close()
                aside.close()
            _write_metadata(tmp, source, writer, quantization, dtype, size_bytes, parameters)
            bits_per_weight = size_bytes * 8 / parameters
            info = {
                "source": source.location,
                "source_format": source.format,
                "source_sha256": source.fingerprint,
                "source_sha256_of": source.fingerprint_of,
                "bits": bits,
                "group_size": group_size,
                "embed_bits": embed_bits,
                "dtype": dtype,
                "bits_per_weight": round(bits_per_weight, 4),
                "parameters": parameters,
                "unquantized": unquantized,
                "created_with": f"specmlx {__version__} (mlx {mx.__version__})",
            }
            (tmp / "specmlx.json").write_text(json.dumps(info, indent=2) + "\n")
    finally:
        mx.set_cache_limit(previous_cache_limit)
    return Summary(
        out,
        source.location,
        parameters,
        size_bytes,
        bits_per_weight,
        time.perf_counter() - t_start,
        len(planned_shards),
        unquantized,
    )


def _tokenizer_bytes(source: Source) -> int:
    """What the tokenizer files copied from a safetensors directory take. A GGUF's
    tokenizer is only known once written: a disk that fills then is still said in one
    line (see `disk_full`)."""
    if source.format != "safetensors":
        return 0
    files = [source.path / name for name in TOKENIZER_FILES]
    files += source.path.glob("*.tiktoken")
    return sum(f.stat().st_size for f in files if f.is_file())


def _write_metadata(
    tmp: Path,
    source: Source,
    writer: shards.ShardWriter,
    quantization: dict,
    dtype: str,
    size_bytes: int,
    parameters: int,
) -> None:
    """config.json, the shard index and the tokenizer, as mlx-lm's `save` writes them."""
    from mlx_lm.utils import save_config

    config = dict(source.config)
    config["quantization"] = quantization
    config["torch_dtype"] = dtype
    save_config(config, tmp / "config.json")
    weight_map = {name: writer.names[writer.location[name][0]] for name in sorted(writer.location)}
    index = {
        "metadata": {"total_size": size_bytes, "total_parameters": parameters},
        "weight_map": weight_map,
    }
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    source.write_tokenizer(tmp)
