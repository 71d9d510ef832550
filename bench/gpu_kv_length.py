"""Why speculation does not pay on MLX's CUDA backend (0.32.4): a forward pass with
several query tokens costs ~8 ms at a KV length it has seen before and ~70 ms at a new
one (kernels are built per shape), and a growing context is always a new length.

Random Qwen2.5-1.5B/0.5B shapes, INT4 g64, float16 (see gpu_check.py). Run on the
device with mlx-cuda installed:  python bench/gpu_kv_length.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import trim_prompt_cache
from mlx_lm.tokenizer_utils import load as load_tokenizer

import specmlx
from specmlx.caches import make_cache
from specmlx.sampling import SamplingParams
from specmlx.verify import make_verifier

sys.path.insert(0, str(Path(__file__).parent))
import gpu_check  # noqa: E402


def median_ms(fn, n: int = 30) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    shapes = gpu_check.SMALL if "--small" in sys.argv else gpu_check.QWEN
    dtype = mx.float32 if mx.default_device() == mx.cpu else mx.float16
    tok_dir = gpu_check.build_tiny_model(Path(tempfile.mkdtemp()) / "tok", layers=1, hidden=32)
    tokenizer = load_tokenizer(tok_dir)
    tokenizer.eos_token_ids = set()
    target = gpu_check.random_model(shapes["target"], 151936, dtype, tokenizer, 0)
    draft = gpu_check.random_model(shapes["draft"], 151936, dtype, tokenizer, 1)

    cache = make_cache(target.module)
    print("KV cache:", type(cache[0]).__name__)
    mx.eval(target.module(mx.arange(128)[None], cache=cache))
    x3 = mx.array([[5, 6, 7]])

    def pass_then_trim(k: int):
        def run():
            mx.eval(target.module(x3, cache=cache))
            trim_prompt_cache(cache, k)

        return run

    # Trimming 3 after a 3-token pass keeps the KV length fixed; 2 or 0 makes a new one.
    print("fwd3 trim3 ms", median_ms(pass_then_trim(3)))
    print("fwd3 trim2 ms", median_ms(pass_then_trim(2)))
    print("fwd3 trim0 ms", median_ms(pass_then_trim(0), 20))
    verify = make_verifier(SamplingParams(1.0), 300)
    logits = target.module(x3, cache=cache)[0]
    q = mx.softmax(mx.random.normal((2, 300)), -1)
    drafts = mx.array([3, 4], mx.uint32)
    mx.eval(logits, q)
    print("verify fn ms", median_ms(lambda: mx.eval(verify(logits, q, drafts, mx.random.key(0)))))

    prompt = list(range(40, 80))
    for g in (2, 0, 2):  # warm-up
        specmlx.generate(target, prompt, draft=draft, num_draft=g, max_tokens=16).run()
    for label, d, g in [("0", draft, 0), ("2", draft, 2), ("0", draft, 0), ("2", draft, 2),
                        ("self", target, 2)]:  # fmt: skip
        s = (
            specmlx.generate(target, prompt, draft=d, num_draft=g, max_tokens=64, temperature=1.0)
            .run()
            .stats
        )
        print(label, f"tps {s.decode_tps:.1f} passes {s.target_passes} draft {s.draft_time:.3f}",
              f"verify {s.verify_time:.3f} decode {s.decode_time:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
