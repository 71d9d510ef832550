"""What auto's per-round policy work costs where it decodes plainly: the target alone
against auto forced to plan γ = 0 every round (its plan and observe still run, the
confidence read included), and against that without the confidence read. Interleaved,
5 repeats of 48 tokens after one warm-up each, medians of decode ms per token.

    python bench/policy_overhead.py
"""

import os
import statistics

import specmlx
from specmlx.bench import encode
from specmlx.policy import auto as auto_mod
from specmlx.policy.choice import Choice, Scheduler

M = os.path.expanduser("~/.cache/specmlx/models")  # the offline pair (quantize/README.md)
target = specmlx.load(f"{M}/qwen2.5-coder-1.5b-instruct-int4")
draft = specmlx.load(f"{M}/qwen2.5-coder-0.5b-instruct-int4")
prompt = encode(target, "Write a short story about a lighthouse keeper who finds a message in a bottle.", chat_template=True)
orig_choose, orig_top = Scheduler.choose, auto_mod.top_probability
def run(mode):
    Scheduler.choose = (lambda self, remaining=None: Choice(0)) if mode != "alone" else orig_choose
    auto_mod.top_probability = (lambda *a, **k: 0.5) if mode == "plain-auto-notop" else orig_top
    if mode == "alone":
        g = specmlx.generate(target, prompt, max_tokens=48, num_draft=0)
    else:
        g = specmlx.generate(target, prompt, draft=draft, max_tokens=48)
    g.run()
    return g.stats.decode_time / g.stats.tokens * 1000
modes = ["alone", "plain-auto", "plain-auto-notop"]
res = {m: [] for m in modes}
for m in modes: run(m)
for i in range(5):
    for m in modes:
        res[m].append(run(m))
for m in modes:
    print(m, "median ms/token", round(statistics.median(res[m]), 2), [round(x, 1) for x in res[m]])
