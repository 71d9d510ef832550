"""What specmlx.stepwise costs: a verify pass of a tiny Mamba-2 model over 4 and 8 tokens,
mlx-lm's chunked form against token by token, and the MLX ops one mixer adds.

Each architecture's tiny float32 model (specmlx.tiny) prefills a prompt; then a pass over
k tokens is timed with stepping off and on, interleaved, the cache rewound after each,
and the medians printed. The op counts are the primitives of one mixer's pass over k
tokens (mx.export_to_dot of its lazy graph), what a real model's mixer adds per verify as
well: the arrays grow with the model, the count does not.

No real Mamba-2 checkpoint is at hand offline, so the second table times one mixer layer
at real models' shapes (random weights, INT4 g64 on the native kernel, as a loaded
checkpoint runs; the cache holds a 64-token prompt's state): a pass over k tokens chunked
and stepped, and a one-token step. A whole model adds its other layers (MLPs, attention,
the head) to both sides unchanged.

    python bench/stepwise_cost.py [--repeats 41]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import tempfile
import time

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.mamba2 import Mamba2Block, ModelArgs

import specmlx
from specmlx import stepwise
from specmlx.caches import checkpoint, make_cache, prefill, rewind
from specmlx.cpu import quantized
from specmlx.tiny import build_tiny_model

ARCHS = ("mamba2", "granitemoehybrid", "falcon_h1")
PROMPT = (
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\nThe quick brown fox jumps over the lazy dog."
)
SIZES = (4, 8)
# Mixer shapes (hidden size, heads, head size, state size, groups) from the published
# configs: state-spaces/mamba2-370m and mamba2-2.7b (expand 2, head 64, state 128).
REAL_SHAPES = {
    "mamba2-370m": (1024, 32, 64, 128, 1),
    "mamba2-2.7b": (2560, 80, 64, 128, 1),
}


def timed(model: specmlx.Model, cache: list, tokens: list[int]) -> float:
    saved = checkpoint(cache)
    start = time.perf_counter()
    mx.eval(model.module(mx.array([tokens], mx.uint32), cache=cache))
    seconds = time.perf_counter() - start
    rewind(model, cache, saved, [], len(tokens))
    return seconds


def mixer_ops(model: specmlx.Model, cache: list, k: int, root: str) -> collections.Counter:
    """The primitives of the first mixer's pass over k tokens (random input), by name."""
    mixer = stepwise.mixers(model.module)[0]
    layer_cache = cache[0].caches[0] if hasattr(cache[0], "caches") else cache[0]
    saved = checkpoint(cache)
    x = mx.random.normal((1, k, mixer.hidden_size))
    mx.eval(x, layer_cache.cache)
    out = mixer(x, cache=layer_cache, mask=None)
    path = os.path.join(root, "mixer.dot")
    mx.export_to_dot(path, out, *[a for a in layer_cache.cache if a is not None])
    mx.eval(out)
    rewind(model, cache, saved, [], k)
    with open(path) as f:
        return collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', f.read()))


def real_shape_mixer(hidden: int, heads: int, head_dim: int, state: int, groups: int):
    """A Mamba-2 mixer of that shape, INT4 on the native kernel, stepped (patched)."""
    args = ModelArgs(
        model_type="mamba2",
        num_heads=heads,
        head_dim=head_dim,
        vocab_size=1,
        hidden_size=hidden,
        intermediate_size=heads * head_dim,
        state_size=state,
        num_hidden_layers=1,
        layer_norm_epsilon=1e-5,
        conv_kernel=4,
        n_groups=groups,
        use_bias=False,
        use_conv_bias=True,
        tie_word_embeddings=True,
        time_step_limit=(0.0, float("inf")),
        time_step_rank="auto",
    )
    mx.random.seed(0)
    mixer = Mamba2Block(args, 0)
    mixer.update(nn.utils.tree_map(lambda p: 0.02 * mx.random.normal(p.shape), mixer.parameters()))
    nn.quantize(mixer, group_size=64, bits=4)
    quantized.patch_model(mixer)
    stepwise.patch_model(mixer)
    mx.eval(mixer.parameters())
    return mixer


def time_mixer(mixer: nn.Module, cache: ArraysCache, x: mx.array) -> float:
    saved = list(cache.cache)
    start = time.perf_counter()
    mx.eval(mixer(x, None, cache), cache.cache)
    seconds = time.perf_counter() - start
    cache.cache = saved
    return seconds


def real_shapes(repeats: int) -> None:
    print()
    print("| mixer shape | k | chunked ms | stepwise ms | ratio | one-token step ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, shape in REAL_SHAPES.items():
        mixer = real_shape_mixer(*shape)
        cache = ArraysCache(2)
        mx.eval(mixer(mx.random.normal((1, 64, shape[0])), None, cache), cache.cache)
        one = mx.random.normal((1, 1, shape[0]))
        for k in SIZES:
            x = mx.random.normal((1, k, shape[0]))
            times: dict[str, list[float]] = {"chunked": [], "stepwise": [], "step": []}
            for variant in [*times] * (repeats + 1):  # the first round warms up
                stepwise.set_enabled(variant != "chunked")
                times[variant].append(time_mixer(mixer, cache, one if variant == "step" else x))
            stepwise.set_enabled(True)
            off, on, step = (statistics.median(t[1:]) * 1e3 for t in times.values())
            print(f"| {name} | {k} | {off:.2f} | {on:.2f} | {on / off:.2f} | {step:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=41, help="timed passes per variant")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="stepwise-cost-")
    print("| architecture | k | chunked ms | stepwise ms | ratio | mixer ops chunked | stepwise |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for arch in ARCHS:
        model = specmlx.load(build_tiny_model(f"{root}/{arch}", arch=arch, seed=0))
        cache = make_cache(model.module)
        prefill(model, cache, model.tokenizer.encode(PROMPT))
        for k in SIZES:
            tokens = [(5 + 37 * i) % 200 for i in range(k)]
            times: dict[bool, list[float]] = {False: [], True: []}
            ops = {}
            for on in (False, True):
                stepwise.set_enabled(on)
                ops[on] = sum(mixer_ops(model, cache, k, root).values())
                timed(model, cache, tokens)  # warm-up
            for _ in range(args.repeats):
                for on in (False, True):
                    stepwise.set_enabled(on)
                    times[on].append(timed(model, cache, tokens))
            stepwise.set_enabled(True)
            off, on = (statistics.median(times[v]) * 1e3 for v in (False, True))
            print(
                f"| {arch} | {k} | {off:.2f} | {on:.2f} | {on / off:.2f} | "
                f"{ops[False]} | {ops[True]} |"
            )
    real_shapes(args.repeats)


if __name__ == "__main__":
    main()
