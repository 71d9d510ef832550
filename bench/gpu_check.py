"""On a GPU: the cost curve T(k)/T(1) and what speculation and auto γ make of it.

Random-init Qwen2.5-1.5B (target) and 0.5B (draft) shapes, INT4 g64 (MLX's affine
format), in the backend's fast dtype, run through specmlx's engine. Random weights
give near-uniform distributions, so acceptance here says nothing about real models;
what this measures is the cost curve of verifying k tokens in one pass and what the
auto-γ policy does with it. With `--compiled both` (the default) everything is measured
twice, the runs interleaved setting by setting: as MLX runs the modules, and with the
norms, RoPEs and MLPs `mx.compile`d (specmlx.compiled, which the engine applies on the
CPU only). Prints a table a setting and writes JSON.

    python -m bench gpu_check --json OUT.json            # on the device (MLX CUDA/Metal)
    python -m bench gpu_check --small --json /tmp/x.json  # smoke test on a CPU
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen2
from mlx_lm.models.cache import trim_prompt_cache
from mlx_lm.tokenizer_utils import load as load_tokenizer

import specmlx
from bench.timing import eval_seconds, median
from specmlx import compiled
from specmlx.caches import make_cache
from specmlx.loading import Model
from specmlx.tiny import build_tiny_model

QWEN = {  # Qwen2.5-1.5B and -0.5B, as in their config.json
    "target": dict(hidden_size=1536, num_hidden_layers=28, intermediate_size=8960,
                   num_attention_heads=12, num_key_value_heads=2),
    "draft": dict(hidden_size=896, num_hidden_layers=24, intermediate_size=4864,
                  num_attention_heads=14, num_key_value_heads=2),
}  # fmt: skip
SMALL = {
    "target": dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                   num_attention_heads=4, num_key_value_heads=2),
    "draft": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                  num_attention_heads=4, num_key_value_heads=2),
}  # fmt: skip


def random_model(shape: dict, vocab: int, dtype, tokenizer, seed: int) -> Model:
    config = dict(model_type="qwen2", rms_norm_eps=1e-6, vocab_size=vocab, rope_theta=1e6,
                  max_position_embeddings=32768, tie_word_embeddings=True, **shape)  # fmt: skip
    mx.random.seed(seed)
    module = qwen2.Model(qwen2.ModelArgs.from_dict(config))
    module.set_dtype(dtype)
    nn.quantize(module, group_size=64, bits=4)
    mx.eval(module.parameters())
    config["quantization"] = {"group_size": 64, "bits": 4}
    name = "qwen2-random-" + str(shape["hidden_size"])
    return Model(module, tokenizer, config, Path(name), len(tokenizer), str(dtype).split(".")[-1])


def target_step_times(
    model: Model, ks: list[int], context: int, reps: int, grow: bool = False
) -> dict[int, float]:
    """Median seconds of one target pass with k new tokens after `context` cached ones;
    with `grow`, one of the k is kept each time, so every pass sees a new KV length (as
    decoding does). Caches as the engine makes them (specmlx.caches)."""
    cache = make_cache(model.module)
    mx.eval(model.module(mx.arange(context)[None] % 300, cache=cache))
    times: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(reps):
        for k in ks:  # interleaved, so drift hits every k alike
            x = (mx.arange(k)[None] + 7) % 300  # lazy: evaluated with the pass, as before
            times[k].append(eval_seconds(lambda x=x: model.module(x, cache=cache)))
            trim_prompt_cache(cache, k - 1 if grow else k)
    return {k: median(v) for k, v in times.items()}


def curves(target: Model, draft: Model) -> dict:
    """The target's cost curve, at a repeated and at a growing KV length, and a draft step,
    at the compile setting now in force."""
    ks = [1, 2, 3, 4, 5, 6, 7, 9]
    return {
        "target_step_s": target_step_times(target, ks, context=128, reps=5),
        "target_step_growing_s": target_step_times(target, ks, context=128, reps=5, grow=True),
        "draft_step_s": target_step_times(draft, [1], context=128, reps=5)[1],
    }


def run_modes(target: Model, modes: list, runs: dict, tokens: int, seed: int) -> None:
    """One generation (T = 1) a (name, draft, γ) of `modes`, its stats added to `runs`."""
    prompt = list(range(40, 80))
    for name, d, g in modes:
        gen = specmlx.generate(target, prompt, draft=d, num_draft=g, seed=seed,
                               max_tokens=tokens, temperature=1.0).run()  # fmt: skip
        runs[name].append(gen.stats.to_dict())


def report(setting: str, m: dict) -> None:
    curve, growing, ks = m["target_step_s"], m["target_step_growing_s"], list(m["target_step_s"])
    print(f"-- modules {setting}")
    print("T(k)/T(1): " + "  ".join(f"k={k}: {curve[k] / curve[1]:.2f}" for k in ks))
    print("at new KV lengths, T(k) ms: " + "  ".join(f"k={k}: {growing[k] * 1e3:.1f}" for k in ks))
    print(f"T(1) = {curve[1] * 1e3:.2f} ms, draft step = {m['draft_step_s'] * 1e3:.2f} ms")
    base = median(r["decode_tps"] for r in m["runs"]["target alone"])
    print(f"{'mode':16} {'tok/s':>8} {'speedup':>8} {'alpha':>6} {'tau':>5}  gamma used")
    for name, rs in m["runs"].items():
        tps = median(r["decode_tps"] for r in rs)
        alpha = median(r["acceptance"] for r in rs)
        tau = median(r["tokens_per_pass"] for r in rs)
        used = rs[-1]["rounds_by_gamma"]
        print(f"{name:16} {tps:8.1f} {tps / base:8.2f} {alpha:6.2f} {tau:5.2f}  {used}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes, for a CPU smoke test")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compiled", choices=["both", "off", "on"], default="both")
    args = ap.parse_args(argv)
    shapes = SMALL if args.small else QWEN
    vocab = 151936
    dtype = mx.float32 if mx.default_device() == mx.cpu else mx.float16
    tmp = Path(tempfile.mkdtemp())
    tokenizer = load_tokenizer(build_tiny_model(tmp / "tok", layers=1, hidden=32))
    tokenizer.eos_token_ids = set()  # random weights: time fixed-length runs
    target = random_model(shapes["target"], vocab, dtype, tokenizer, 0)
    draft = random_model(shapes["draft"], vocab, dtype, tokenizer, 1)
    modes = [("target alone", None, 0), ("γ=2", draft, 2), ("γ=4", draft, 4), ("γ=6", draft, 6),
             ("auto", draft, "auto"), ("self-draft γ=4", target, 4)]  # fmt: skip
    settings = ["off", "on"] if args.compiled == "both" else [args.compiled]
    if "on" in settings:
        patched = [compiled.patch_model(m.module, cpu_only=False) for m in (target, draft)]
        print(f"compiled modules: {patched[0]} in the target, {patched[1]} in the draft")
    was = compiled.enabled()
    by_setting: dict[str, dict] = {}
    try:
        for setting in settings:  # the curves: each a median of interleaved passes
            compiled.set_enabled(setting == "on")
            # compile and allocate outside the timings
            run_modes(target, modes, defaultdict(list), 16, 0)
            by_setting[setting] = {**curves(target, draft), "runs": defaultdict(list)}
        for rep in range(args.reps):  # the runs: settings interleaved, rep by rep
            for setting in settings:
                compiled.set_enabled(setting == "on")
                run_modes(target, modes, by_setting[setting]["runs"], args.tokens, rep)
    finally:
        compiled.set_enabled(was)
    out = {
        "device": str(mx.default_device()),
        "machine": platform.node(),
        "mlx": mx.__version__,
        "dtype": str(dtype),
        "shapes": shapes,
        "kv_cache": type(make_cache(target.module)[0]).__name__,
        "modules": by_setting,
    }
    print(f"device {out['device']}  mlx {mx.__version__}  dtype {dtype}")
    print(f"KV cache: {out['kv_cache']}")
    for setting, m in by_setting.items():
        report(setting, m)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))
