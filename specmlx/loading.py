"""Resolve a model path or hub id, and load it into mlx-lm's model class.

Weights are mapped where they can be: on the CPU-only build with the native extension,
each safetensors tensor becomes an MLX array over a read-only mapping of the file
(specmlx/cpu/_native/mapped.cpp), so the weights stay in the page cache, shared by every
process on the same model, and a warm start copies nothing. A file whose tensors are not
8-byte aligned (what mx.save_safetensors writes) is mapped through an aligned copy kept in
$SPECMLX_HOME/mapped (specmlx.aligned); tensors the dtype policy converts are copied and
counted. Elsewhere (Metal, CUDA, no extension, SPECMLX_MMAP=0) they are
read by mx.load, lazily: each tensor copied into MLX's memory when first used. The model
is mlx-lm's class for its architecture, built without importing mlx-lm's loader (or
transformers) where specmlx.mlxlm can; the tokenizer is specmlx.tokenizer's over
`tokenizers` where it is exactly transformers', else mlx-lm's wrapper; and a dtype
policy picks the activation precision that is fast on the backend at hand.
"""

from __future__ import annotations

import filecmp
import glob
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from . import cpu, distributed, exactness, mlxlm, stepwise
from .errors import SpecmlxError
from .safetensors import Header, read_header
from .wording import counted, human_bytes

# Files a model needs; everything else in a hub repo (READMEs, GGUFs, ONNX) is skipped.
HUB_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
]

# Files the tokenizer is read from (beside tokenizer.model / *.tiktoken, which are binary).
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
FIX = "re-download or re-convert the model"

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

# The MLX dtype each safetensors dtype's bytes are read as, as mx.load reads them (the F8
# kinds as raw uint8, which is how quantized checkpoints use them).
SAFETENSORS_DTYPES = {
    "BOOL": mx.bool_,
    "U8": mx.uint8,
    "I8": mx.int8,
    "F8_E4M3": mx.uint8,
    "F8_E8M0": mx.uint8,
    "U16": mx.uint16,
    "I16": mx.int16,
    "F16": mx.float16,
    "BF16": mx.bfloat16,
    "U32": mx.uint32,
    "I32": mx.int32,
    "F32": mx.float32,
    "U64": mx.uint64,
    "I64": mx.int64,
    "C64": mx.complex64,
}


@dataclass
class Model:
    """A loaded model: mlx-lm module, tokenizer wrapper, config and where it came from."""

    module: nn.Module
    tokenizer: Any  # specmlx.tokenizer.LightTokenizer or mlx-lm's TokenizerWrapper
    config: dict
    path: Path
    vocab_size: int  # tokens the tokenizer can produce; logits beyond it are padding
    dtype: str = "float32"
    info: dict = field(default_factory=dict)
    # "int4", "fp32" (INT4 expanded at load for a fast BLAS, specmlx.cpu) or "dense"; and why
    weights: str = ""
    weights_why: str = ""
    # Split over the ranks of `group` (specmlx.distributed): "tensor" or "pipeline"; "" and
    # None in one process.
    shard: str = ""
    group: Any = None

    @property
    def quantization(self) -> dict | None:
        return self.config.get("quantization")

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def split(self) -> str:
        """How the model is split over ranks, for keys of what it costs ("" whole)."""
        return f"@{self.shard}x{self.group.size()}" if self.shard else ""

    def describe(self) -> str:
        q = self.quantization
        bits = f"INT{q['bits']} g{q['group_size']}" if q else "dense"
        if self.weights == "fp32":
            bits += " expanded to fp32"
        if self.shard:
            bits += f", {self.shard}-parallel over {self.group.size()} ranks"
        return f"{self.name} ({self.config.get('model_type')}, {bits}, {self.dtype})"


def backend() -> str:
    """'gpu' when MLX runs on Metal or CUDA, else 'cpu'."""
    return "gpu" if mx.default_device() == mx.gpu else "cpu"


def resolve_path(path_or_repo: str | Path) -> Path:
    """A local model directory, or a hub repo id fetched into the hub cache."""
    path = Path(path_or_repo).expanduser()
    if path.exists():
        if not path.is_dir():
            raise SpecmlxError(
                f"model path {path} is a file, not a model directory "
                "(for a .gguf file run `specmlx quantize FILE -o DIR` first)"
            )
        return path
    text = str(path_or_repo)
    if text.count("/") != 1 or text.startswith((".", "/", "~")):
        raise SpecmlxError(
            f"model not found: {text} is neither a directory nor a hub id like 'org/name'"
        )
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(text, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # the hub client raises many types; all mean "could not get it"
        raise SpecmlxError(
            f"model not found: no directory {text!r} and the hub download failed "
            f"({type(e).__name__}); pass a local model directory"
        ) from e


def read_config(path: Path) -> dict:
    """config.json as a dict; SpecmlxError if it is missing or corrupt."""
    config_file = path / "config.json"
    if not config_file.exists():
        raise SpecmlxError(f"{path} has no config.json: not a Hugging Face / MLX model directory")
    return read_json_object(config_file)


def read_json(file: Path) -> Any:
    """The value a JSON file holds; SpecmlxError naming the file when it is not JSON."""
    try:
        return json.loads(file.read_bytes())
    except json.JSONDecodeError as e:
        problem = str(e)
    except UnicodeDecodeError:
        problem = "not UTF-8 text"
    except RecursionError:
        problem = "nested too deeply"
    raise SpecmlxError(f"{file} is not valid JSON ({problem}); {FIX}")


def read_json_object(file: Path) -> dict:
    """read_json, refusing anything but an object (a dict)."""
    value = read_json(file)
    if not isinstance(value, dict):
        kind = "null" if value is None else type(value).__name__
        raise SpecmlxError(f"{file} holds a JSON {kind}, not an object; {FIX}")
    return value


def model_classes(config: dict, config_file: Path) -> tuple[type, type]:
    """mlx-lm's model and args classes for config's model_type; SpecmlxError if it has none."""
    try:
        return mlxlm.model_classes(config)
    except ValueError:  # mlx-lm's "Model type X not supported."
        raise SpecmlxError(
            f"{config_file}: model_type {config['model_type']!r} is not an architecture "
            f"mlx-lm {mlxlm.mlx_lm_version()} knows; upgrade mlx-lm (pip install -U mlx-lm) "
            "or pick another model"
        ) from None


def one_line(error: Exception, limit: int = 300) -> str:
    """An exception's message on one line, cut when long (mlx-lm lists missing weights)."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def pick_dtype(config: dict, requested: str = "auto") -> str:
    """The dtype that floating weights (and so activations) should have.

    MLX's CPU kernels are fast only in float32 (INT4 with bf16 activations is ~8x
    slower on x86, fp16 ~40x), so on the CPU everything floating becomes float32.
    Metal and CUDA keep the checkpoint's own dtype.
    """
    if requested != "auto":
        if requested not in DTYPES:
            raise SpecmlxError(f"unknown dtype {requested!r}; use one of auto, {', '.join(DTYPES)}")
        return requested
    if backend() == "cpu":
        return "float32"
    return config.get("torch_dtype") if config.get("torch_dtype") in DTYPES else "float16"


def cast_floating(module: nn.Module, dtype: str) -> None:
    """Cast every floating parameter (weights, scales, biases, norms) to `dtype`.

    Packed integer weights are left alone. Parameters are still lazy here, so the
    cast fuses with the read from disk and no second copy of the model is kept.
    """
    target = DTYPES[dtype]

    def cast(x: mx.array) -> mx.array:
        # The same object where nothing changes: a mapped tensor stays recognisably mapped.
        if x.dtype == target or not mx.issubdtype(x.dtype, mx.floating):
            return x
        return x.astype(target)

    module.update(tree_map(cast, module.parameters()))


def load(
    path_or_repo: str | Path,
    dtype: str = "auto",
    lazy: bool = True,
    native: bool = True,
    cpu_weights: str = "auto",
    tokenizer_from: Model | None = None,
    group: Any = None,
    shard: str = "auto",
) -> Model:
    """Load a model directory or hub id (dense or MLX-quantized) for generation.

    With `native`, INT4 layers run on specmlx's CPU kernel where it applies (see
    specmlx.cpu.quantized; everything else, and the GPU, keeps mx.quantized_matmul).
    `tokenizer_from`: a loaded model whose tokenizer is reused when this one ships a
    byte-identical tokenizer.json (a draft of the same family); loading a 150k-token
    tokenizer takes a quarter of a second (more through transformers), and a draft's
    tokenizer only serves its vocabulary.
    `cpu_weights` "fp32" expands INT4 weights to float32 for a fast BLAS, "int4" keeps
    them, "auto" keeps them where the native kernel runs (specmlx.cpu.fp32).
    `group`: an MLX distributed group of several ranks (specmlx.distributed.group()) to
    split the model over, each rank calling load alike: `shard` "tensor" (the model
    class's shard()), "pipeline" (its model.pipeline()) or "auto" (tensor where it has
    it); refused in one line where mlx-lm's class has neither. None: the whole model.
    """
    path = resolve_path(path_or_repo)
    if glob.escape(str(path)) != str(path):  # mlx-lm finds the weights with a glob pattern
        raise SpecmlxError(
            f"model path {path} has one of * ? [ ] in it, which mlx-lm reads as a file "
            "pattern; rename the directory (or link to it from a plain path)"
        )
    config = read_config(path)
    if not isinstance(config.get("model_type"), str):  # mlx-lm would raise a bare KeyError
        raise SpecmlxError(
            f"{path / 'config.json'} has no model_type naming its architecture; {FIX}"
        )
    weight_files = sorted(path.glob("model*.safetensors"))
    if not weight_files:
        raise SpecmlxError(f"{path} has no model*.safetensors weights")
    t0 = time.perf_counter()
    # Headers only: mx.load trusts them, a truncated file included, and a mapping needs them.
    headers = [read_header(file) for file in weight_files]
    unavailable = mapping_unavailable()
    by_file: dict[str, dict[str, mx.array]] = {}
    mapped: list[mx.array] = []
    for header in [] if unavailable else headers:
        tensors, in_place, unavailable = map_weights(header)
        if unavailable:  # one file that cannot be mapped: mx.load reads them all
            by_file, mapped = {}, []
            break
        by_file[str(header.path)] = tensors
        mapped += in_place
    try:
        classes = partial(model_classes, config_file=path / "config.json")
        config = mlxlm.load_config(path)  # as mlx-lm reads it (generation_config's EOS)
        weights: dict[str, mx.array] = {}
        for file in weight_files:
            weights.update(by_file.get(str(file)) or mx.load(str(file)))
        if mlxlm.buildable(config, weights):
            module = mlxlm.build_model(config, weights, classes)
        else:  # a layout mlx-lm's loader converts (AWQ, FP8, ...): it reads the files again
            del weights
            from mlx_lm.utils import load_model

            with weights_for_mlx_lm(by_file):
                module, config = load_model(path, lazy=True, get_model_classes=classes)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
        # Raised by mlx-lm building the model from config.json's values and the weights'
        # names and shapes: what it says is about the directory's files.
        raise SpecmlxError(
            f"cannot build the model in {path} from its config.json and weights "
            f"({type(e).__name__}: {one_line(e)}); {FIX}"
        ) from e
    # Split before anything reads the weights (each rank reads its part only) and before
    # the CPU patches, which then take the layers they recognise (specmlx.distributed).
    how = distributed.shard(module, shard, group, path.name) if group is not None else ""
    chosen = pick_dtype(config, dtype)
    stored = dict(tree_flatten(module.parameters()))  # the kernel's layers keep their halves
    cast_floating(module, chosen)
    stepwise.patch_model(module)  # before prepare, which asks whether passes are exact
    weights, weights_why = cpu.prepare(
        module,
        cpu_weights,
        backend(),
        use_native=native,
        stored=stored,
        passes_exact=exactness.passes_exact,
    )
    del stored
    reading = count_in_place(module, mapped, unavailable)
    del mapped  # the model holds what it uses; the rest (e.g. a dropped tied head) is freed
    if not lazy:
        mx.async_eval(module.parameters())  # read the weights while the tokenizer loads
    t1 = time.perf_counter()
    if tokenizer_from is not None and same_file(path, tokenizer_from.path, "tokenizer.json"):
        tokenizer = tokenizer_from.tokenizer
        tokenizer_kind = f"{tokenizer_from.info['tokenizer']}, the target's"
    else:
        tokenizer, tokenizer_kind = read_tokenizer(path, config)
    t2 = time.perf_counter()
    if not lazy:
        mx.eval(module.parameters())
    t3 = time.perf_counter()
    # Multimodal wrappers (Qwen3.5, Gemma 3) keep the language model's config nested.
    logits_dim = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    vocab_size = min(len(tokenizer), logits_dim)
    # weights_s: building the model, plus the part of reading (lazy=False only) that the
    # tokenizer load did not hide.
    info = {
        "weights_s": (t1 - t0) + (t3 - t2),
        "tokenizer_s": t2 - t1,
        "reading": reading,
        "tokenizer": tokenizer_kind,
    }
    return Model(
        module, tokenizer, config, path, vocab_size, chosen, info, weights, weights_why, how, group
    )


def mapping_unavailable() -> str:
    """Why weights cannot be mapped here ('' when they can)."""
    if os.environ.get("SPECMLX_MMAP", "1") == "0":
        return "SPECMLX_MMAP=0"
    if mx.metal.is_available() or mx.cuda.is_available():
        # Their allocators' buffers are device buffers, not [size][data] in host memory;
        # Metal would need page-aligned no-copy buffers (README, "Loading").
        return "a GPU build of mlx, whose own loader is kept"
    from .cpu import native

    if not native.available():
        return f"native extension unavailable: {native.reason()}"
    unsupported = native.op("mapping_unsupported")
    if unsupported is None:
        return "the native extension was built before mapping existed; reinstall specmlx"
    return unsupported()


@contextmanager
def weights_for_mlx_lm(by_file: dict[str, dict[str, mx.array]]) -> Iterator[None]:
    """While mlx-lm's load_model runs, its mx.load of a file in `by_file` returns those
    arrays: mlx-lm builds, sanitizes (once: some models' sanitize changes the model, e.g.
    drops a tied head) and checks the model with them exactly as with its own reads. Only
    mlx_lm.utils' name for mlx.core is swapped, for the call, and only `load` differs."""
    import mlx_lm.utils

    if not by_file:
        yield
        return

    def load(file, *args, **kwargs):
        if not args and not kwargs and str(file) in by_file:
            return dict(by_file[str(file)])
        return mx.load(file, *args, **kwargs)

    core = SimpleNamespace(**{name: getattr(mx, name) for name in dir(mx)})
    core.load = load
    mlx_lm.utils.mx = core
    try:
        yield
    finally:
        mlx_lm.utils.mx = mx


def map_weights(header: Header) -> tuple[dict[str, mx.array], list[mx.array], str]:
    """Every tensor of the file: over a read-only mapping where its offset allows, else
    read by mx.load (lazily, so only those are copied). A file with unaligned tensors
    (mx.save_safetensors') is mapped through its aligned copy in $SPECMLX_HOME/mapped
    (specmlx.aligned), made on its first load. Returns (weights, the mapped arrays, ''),
    or ({}, [], why) when the file cannot be mapped (mx.load reads it all)."""
    from . import aligned
    from .cpu import native, packing

    source, no_copy = header, ""
    if aligned.needs_copy(header):
        copy, no_copy = aligned.aligned_copy(header)
        header = copy or header
    names = list(header.tensors)
    entries = [
        (t.begin, list(t.shape), SAFETENSORS_DTYPES[t.dtype]) for t in header.tensors.values()
    ]
    try:
        arrays = native.op("map_tensors")(str(header.path), entries)
    except ValueError as e:  # open/mmap refused, or the file changed since its header
        read_header(source.path)  # a file cut short since is one line, not a fallback
        return {}, [], f"mapping {header.path.name} failed ({one_line(e, 120)})"
    mapped = [a for a in arrays if a is not None]
    if not mapped:
        return {}, [], f"no tensor lies at an 8-byte-aligned offset, and no aligned copy: {no_copy}"
    unaligned = mx.load(str(source.path)) if len(mapped) < len(arrays) else {}
    weights = {n: unaligned[n] if a is None else a for n, a in zip(names, arrays, strict=True)}
    file = aligned.identity(source.path)
    for name, array in zip(names, arrays, strict=True):
        if array is not None:  # its bytes are the file's: what it packs to can be cached
            packing.note_source(array, file, name)
    return weights, mapped, ""


def count_in_place(module: nn.Module, mapped: list[mx.array], unavailable: str) -> dict:
    """How the model's parameters were read: how many (and bytes) are the mapped arrays
    themselves, used in place, and how many are copies (read by mx.load, converted by the
    dtype policy, expanded, or changed by the model's sanitize)."""
    ids = {id(a) for a in mapped}
    params = [v for _, v in tree_flatten(module.parameters())]
    in_place = [v for v in params if id(v) in ids]
    copied = [v for v in params if id(v) not in ids]
    return {
        "how": "mapped" if mapped else "lazy-copy",
        "why": unavailable,
        "in_place": len(in_place),
        "in_place_bytes": sum(v.nbytes for v in in_place),
        "copied": len(copied),
        "copied_bytes": sum(v.nbytes for v in copied),
    }


def describe_reading(reading: dict) -> str:
    """One line's worth: how a model's weights were read (see count_in_place)."""
    tensors = counted(reading["copied"], "tensor")
    copied = f"{tensors} copied ({human_bytes(reading['copied_bytes'])})"
    if reading["how"] == "mapped":
        return f"mapped, {human_bytes(reading['in_place_bytes'])} in place, {copied}"
    return f"mx.load, {copied} ({reading['why']})"


# A tokenizer's vocabulary comes from one of these (tokenizer.json: `tokenizers` and
# transformers' fast tokenizers; the rest: transformers' slow ones). Without any,
# transformers still builds a tokenizer, one that encodes every text to no tokens.
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_tokenizer_files(path: Path) -> None:
    """Refuse, at load, a model directory with no vocabulary file, naming what it needs."""
    if any((path / name).is_file() for name in VOCABULARY_FILES) or any(path.glob("*.tiktoken")):
        return
    raise SpecmlxError(
        f"{path} has no tokenizer files: it needs tokenizer.json and tokenizer_config.json "
        "(or an older tokenizer's tokenizer.model, vocab.json, vocab.txt or *.tiktoken); "
        "copy them in from the model it was converted from, or re-download it"
    )


def read_tokenizer(path: Path, config: dict) -> tuple[Any, str]:
    """The tokenizer for `path`, and which it is: specmlx.tokenizer's over `tokenizers`
    where that is exactly what transformers would build ("tokenizers"), else mlx-lm's
    load_tokenizer ("transformers: why"; SPECMLX_TOKENIZER=transformers asks for it).
    SpecmlxError naming the file when it cannot be read."""
    from .tokenizer import load_light

    check_tokenizer_files(path)
    try:
        eos = config.get("eos_token_id")
        if os.environ.get("SPECMLX_TOKENIZER") == "transformers":  # to compare, or work around
            tokenizer, why = None, "SPECMLX_TOKENIZER=transformers"
        else:
            tokenizer, why = load_light(path, config, eos)
        if tokenizer is not None:
            return tokenizer, "tokenizers"
        from mlx_lm.utils import load_tokenizer

        return load_tokenizer(path, eos_token_ids=eos), f"transformers: {why}"
    except Exception as e:  # transformers, tokenizers (Rust) and json each raise their own
        # Which file is at fault is looked for only now: parsing a 10 MB tokenizer.json a
        # second time would cost every load ~0.1 s.
        for file in (path / name for name in TOKENIZER_FILES):
            if file.exists():
                read_json_object(file)
        present = " and ".join(name for name in TOKENIZER_FILES if (path / name).exists())
        raise SpecmlxError(
            f"cannot load the tokenizer ({present or 'no tokenizer files'}) in {path} "
            f"({type(e).__name__}: {one_line(e, 120)}); {FIX}"
        ) from e


def same_file(a: Path, b: Path, name: str) -> bool:
    """Whether directories a and b both hold file `name` with the same bytes."""
    return (a / name).is_file() and (b / name).is_file() and filecmp.cmp(a / name, b / name, False)


def check_pair(target: Model, draft: Model) -> None:
    """Refuse a draft whose tokenizer differs from the target's: its tokens mean other text."""
    # One tokenizer (load() shares it), or two read from the same bytes: models loaded
    # apart, as the Python API's users do, whose vocabularies' compare is slow and would
    # run at every generate() call that makes a Session.
    if draft.tokenizer is target.tokenizer or same_file(target.path, draft.path, "tokenizer.json"):
        return
    if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise SpecmlxError(
            f"draft {draft.path} has a different tokenizer from target {target.path} "
            f"({len(draft.tokenizer)} vs {len(target.tokenizer)} tokens); "
            "pick a draft from the same model family"
        )
