"""Peak memory of `specmlx quantize` on a synthetic ~1 GB float16 llama checkpoint.

    python -m bench quantize_peak_rss [--layers 8] [--keep DIR]

Writes a random float16 model (hidden 2048, vocab 32000, ~0.98 GB with 8 layers),
quantizes it to INT4 in a child process, and reports the child's peak RSS above its
baseline after imports (Linux: the peak is reset through /proc/self/clear_refs). The
issue's bar: under 0.5 GB above baseline for a ~1 GB model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.timing import timed

ROOT = Path(__file__).resolve().parent.parent  # the checkout: `bench` imports from here


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(src: str, out: str) -> None:
    from specmlx.convert import quantize

    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    baseline = rss_kib("VmRSS")
    summary = quantize(src, out)
    peak = rss_kib("VmHWM")
    print(
        json.dumps(
            {
                "baseline_mib": baseline / 1024,
                "peak_mib": peak / 1024,
                "peak_above_baseline_mib": (peak - baseline) / 1024,
                "seconds": summary.seconds,
                "parameters": summary.parameters,
                "output_mib": summary.size_bytes / 2**20,
            }
        )
    )


def write_synthetic(path: Path, layers: int) -> int:
    """A random float16 llama in the hub layout, written tensor by tensor; returns bytes."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from specmlx.convert import shards
    from specmlx.tiny import build_tiny_model

    build_tiny_model(path)  # tokenizer files and a config to adapt
    (path / "model.safetensors").unlink()
    config = json.loads((path / "config.json").read_text())
    config.update(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=32000,
        torch_dtype="float16",
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))
    model_class, args_class = _get_classes(config)
    params = tree_flatten(model_class(args_class.from_dict(config)).parameters())
    planned = [[shards.Planned(name, "F16", tuple(p.shape))] for name, p in params]
    writer = shards.ShardWriter(path, shards.plan_shards(planned, 5 << 30))
    rng = np.random.default_rng(0)
    for name, p in params:
        rows_per_chunk = max(1, (1 << 22) // max(1, p.size // p.shape[0]))
        for start in range(0, p.shape[0], rows_per_chunk):
            rows = min(p.shape[0], start + rows_per_chunk) - start
            chunk = 0.02 * rng.standard_normal((rows, *p.shape[1:]), dtype=np.float32)
            writer.write_rows(name, start, mx.array(chunk.astype(np.float16)))
    writer.close()
    return sum(t.nbytes for group in planned for t in group)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--keep", type=Path, help="Build the model here and keep it.")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        src, out = root / "synthetic-f16", root / "synthetic-int4"
        size, took = timed(lambda: write_synthetic(src, args.layers))
        print(f"wrote {size / 1e9:.2f} GB float16 in {took:.1f} s", flush=True)
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        result = subprocess.run(
            [sys.executable, "-m", "bench", "quantize_peak_rss", "--child", str(src), str(out)],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": path},
        )
        figures = json.loads(result.stdout.strip().splitlines()[-1])
        figures["source_gb"] = size / 1e9
        print(json.dumps(figures, indent=2))
