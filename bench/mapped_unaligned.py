"""Private memory and load time of a model written as mlx_lm.convert writes one.

mx.save_safetensors starts the data section wherever the JSON header ends, so most of
its tensors lie at offsets that are not 8-byte aligned and cannot be mapped in place. This
builds such a file (random INT4 weights, Qwen2.5-1.5B's layer shapes, `--layers` layers,
bf16 scales and norms as mlx_lm.convert leaves them), then loads it in fresh processes and
reads each one's RssAnon before and after `specmlx.load(path, lazy=False)`, after a first
load of a tiny model has paid what any first load costs (imports, the tokenizer library):

- variant "copy": SPECMLX_MAPPED_CACHE_GB=0, the unaligned tensors read by mx.load;
- variant "cached": the default, an aligned copy in $SPECMLX_HOME/mapped, mapped. Its
  first process writes the copy (cold), the next ones find it (warm); the last of them
  loads while another process holds the model, as a second user would.

Each variant runs with the packed tiles on (the default where they run) and off
(SPECMLX_PACK=0). Usage: python -m bench mapped_unaligned [--layers 4] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.timing import median

CHILD = r"""
import gc, json, sys, time
from pathlib import Path

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

import mlx.core as mx
import specmlx
# A first load of a tiny model pays what any first load does (imports, the tokenizer
# library, the kernel's pool, compiled graphs): not the weights' memory.
specmlx.load(sys.argv[2], lazy=False)
gc.collect()
before = anon()
t0 = time.perf_counter()
model = specmlx.load(sys.argv[1], lazy=False)
loaded = time.perf_counter() - t0
gc.collect()
after = anon()
print(json.dumps({"before": before, "after": after, "load_s": loaded,
                  "reading": model.info["reading"]}), flush=True)
if len(sys.argv) > 3:  # hold the model until told to go
    sys.stdin.readline()
"""

QWEN_1_5B = {
    "model_type": "qwen2",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def build(path: Path, layers: int) -> Path:
    """A tiny tokenizer with a Qwen2.5-1.5B body: random INT4 weights (g64, bf16 scales)
    saved by mx.save_safetensors, as mlx_lm.convert saves them."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from specmlx.mlxlm import model_classes
    from specmlx.tiny import build_tiny_model

    build_tiny_model(path, arch="qwen2", layers=layers)  # tokenizer files and a config
    config = json.loads((path / "config.json").read_text())
    config.update(QWEN_1_5B, num_hidden_layers=layers)
    config["quantization"] = {"group_size": 64, "bits": 4}
    mx.random.seed(0)
    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=64, bits=4)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def tensor_bytes(path: Path) -> int:
    from specmlx.safetensors import read_header

    header = read_header(path / "model.safetensors")
    return sum(t.end - t.begin for t in header.tensors.values())


def run(model: Path, env: dict, hold: bool = False) -> subprocess.Popen:
    warmup = model.parent / "warmup"
    argv = [sys.executable, "-c", CHILD, str(model), str(warmup)] + (["hold"] if hold else [])
    return subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **env}
    )


def one(model: Path, env: dict) -> dict:
    p = run(model, env)
    out, _ = p.communicate()
    if p.returncode:
        raise SystemExit(f"a loading process failed ({p.returncode})")
    return json.loads(out)


def equal_to_mx_load(model: Path, home: Path) -> str:
    """How many of the file's tensors, mapped through the cached copy, equal mx.load's."""
    import mlx.core as mx

    from specmlx import loading
    from specmlx.safetensors import read_header

    os.environ["SPECMLX_HOME"] = str(home)
    file = model / "model.safetensors"
    weights, mapped, why = loading.map_weights(read_header(file))
    expected = mx.load(str(file))
    same = sum(
        weights[n].dtype == a.dtype and mx.array_equal(weights[n], a).item()
        for n, a in expected.items()
    )
    return f"{same}/{len(expected)} tensors equal to mx.load's, {len(mapped)} mapped {why}"


def growth(r: dict, weights: int) -> str:
    grown = r["after"] - r["before"]
    return f"{grown / 2**20:6.1f} MiB ({grown / weights:5.1%})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    from specmlx.tiny import build_tiny_model

    root = Path(tempfile.mkdtemp(prefix="mapped-unaligned-"))
    model = build(root / "model", args.layers)
    build_tiny_model(root / "warmup", arch="qwen2")
    weights = tensor_bytes(model)
    print(f"weights: {weights / 2**20:.1f} MiB in {model / 'model.safetensors'}")
    for pack in ("1", "0"):
        home = root / f"home-pack{pack}"
        base = {"SPECMLX_HOME": str(home), "SPECMLX_PACK": pack}
        rows: dict[str, list[dict]] = {"copy": [], "cached, cold": [], "cached, warm": []}
        for i in range(args.runs):  # interleaved, so a busy moment lands on all alike
            rows["copy"].append(one(model, {**base, "SPECMLX_MAPPED_CACHE_GB": "0"}))
            if i == 0:
                rows["cached, cold"].append(one(model, base))
            rows["cached, warm"].append(one(model, base))
        holder = run(model, base, hold=True)
        held = json.loads(holder.stdout.readline())
        second = one(model, base)
        holder.stdin.close()
        holder.wait()
        print(f"SPECMLX_PACK={pack}:")
        for name, results in rows.items():
            r = results[-1]
            load = median(x["load_s"] for x in results)
            reading = r["reading"]
            print(
                f"  {name:<13} private growth {growth(r, weights)} · load {load:.2f} s "
                f"(median of {len(results)}) · {reading['how']}, "
                f"{reading['copied']} copied ({reading['copied_bytes'] / 2**20:.1f} MiB)"
            )
        print(f"  two at once   first {growth(held, weights)} · second {growth(second, weights)}")
        print(f"  {equal_to_mx_load(model, home)}")


if __name__ == "__main__":
    main()
