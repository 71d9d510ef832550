#!/bin/bash
# Short real-model check: Qwen2.5-Coder 0.5B INT4 vs fp32-expanded, greedy, same prompt.
cd . && . .venv/bin/activate
M=~/.cache/specmlx/models/qwen2.5-coder-0.5b-instruct-int4
for w in fp32 int4 fp32 int4; do
  SPECMLX_THREADS=1 python -m specmlx generate -m $M --no-draft -n 24 --cpu-weights $w --json \
    -p "Write a Python function that returns the n-th Fibonacci number." |
  python -c "import json,sys; d=json.load(sys.stdin); s=d['stats']; t=d['timings']; print('$w', d['settings']['cpu_weights']['target'], d['settings']['blas']['name'], 'threads', d['settings']['blas']['threads'], 'decode tok/s %.2f' % s['decode_tps'], 'prefill s %.2f for %d tok' % (t['prefill_s'], s['prefill_tokens']), 'tokens', d['tokens'][:24])"
done
