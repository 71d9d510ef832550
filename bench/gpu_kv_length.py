"""Why speculation does not pay on MLX's CUDA backend (0.32.4): a forward pass with
several query tokens costs ~8 ms at a KV length it has seen before and ~70 ms at a new
one (kernels are built per shape), and a growing context is always a new length.

Random Qwen2.5-1.5B/0.5B shapes, INT4 g64, float16 (see gpu_check.py). Run on the
device with mlx-cuda installed:  python bench/gpu_kv_length.py
"""

import sys, time, tempfile, cProfile, pstats, statistics
sys.path.insert(0, 'bench')
import gpu_check as gc
import mlx.core as mx
from pathlib import Path
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
import specmlx
from specmlx.sampling import SamplingParams
from specmlx.verify import make_verifier
tmp = Path(tempfile.mkdtemp())
tok = load_tokenizer(gc.build_tiny_model(tmp / "tok", layers=1, hidden=32)); tok.eos_token_ids=set()
dt = mx.float16
T = gc.random_model(gc.QWEN["target"], 151936, dt, tok, 0)
D = gc.random_model(gc.QWEN["draft"], 151936, dt, tok, 1)
def timeit(f, n=30):
    ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return statistics.median(ts)*1e3
cache = make_prompt_cache(T.module); mx.eval(T.module(mx.arange(128)[None], cache=cache))
x3 = mx.array([[5,6,7]])
def fwd_trim(k):
    def f():
        mx.eval(T.module(x3, cache=cache)); trim_prompt_cache(cache, k)
    return f
# trim 3 after a 3-token pass: the same KV length every time; trim 2 or 0: a new one
print("fwd3 trim3 ms", timeit(fwd_trim(3)))
print("fwd3 trim2 ms", timeit(fwd_trim(2)))
print("fwd3 trim0 ms", timeit(fwd_trim(0), 20))
ver = make_verifier(SamplingParams(1.0), 300)
logits = T.module(x3, cache=cache)[0]; q = mx.softmax(mx.random.normal((2,300)), -1); dtk = mx.array([3,4], mx.uint32); mx.eval(logits, q)
print("verify fn ms", timeit(lambda: mx.eval(ver(logits, q, dtk, mx.random.key(0)))))
def full():
    def f():
        l = T.module(x3, cache=cache)[0]; n, t = ver(l, q, dtk, mx.random.key(1)); mx.eval(n, t); n.item(); trim_prompt_cache(cache, 2)
    return f
print("fwd3+verify+trim2 ms", timeit(full()))
prompt = list(range(40, 80))
for g in (2, 0, 2):
    specmlx.generate(T, prompt, draft=D, num_draft=g, max_tokens=16, temperature=1.0).run()
for g in (0, 2, 0, 2):
    gen = specmlx.generate(T, prompt, draft=D, num_draft=g, max_tokens=64, temperature=1.0).run(); s=gen.stats
    print(g, f"tps {s.decode_tps:.1f} passes {s.target_passes} draft {s.draft_time:.3f} verify {s.verify_time:.3f} decode {s.decode_time:.3f}")
gen = specmlx.generate(T, prompt, draft=T, num_draft=2, max_tokens=64, temperature=1.0).run(); s=gen.stats
print("self", f"tps {s.decode_tps:.1f} passes {s.target_passes} draft {s.draft_time:.3f} verify {s.verify_time:.3f} decode {s.decode_time:.3f}")
cProfile.run("specmlx.generate(T, prompt, draft=D, num_draft=2, max_tokens=64, temperature=1.0).run()", "/tmp/p2")
pstats.Stats("/tmp/p2").sort_stats("tottime").print_stats(15)
