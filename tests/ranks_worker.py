"""One rank of tests/test_distributed.py's two: run as a process with MLX_RANK and
MLX_HOSTFILE set (what mlx.launch sets), `python ranks_worker.py SPEC.json`.

For each config of the spec (a target split over the ranks; its draft model or MTP head
whole), it writes what the test compares: greedy tokens of the target alone and of
speculation (auto γ, a fixed γ, trees, prompt lookup), coupled samples at T = 1 with and
without drafts, a rejection-sampled reply, and on rank 0 the target's logits over the
prompt; and for the spec's "chi" entry, the counts of the first two tokens over many
seeded two-token generations under rejection sampling. Every rank writes its own rank{r}.json.
"""

from __future__ import annotations

import json
import sys
from itertools import islice
from pathlib import Path

import mlx.core as mx
import numpy as np

import specmlx
from specmlx import distributed

PROMPT = "def fibonacci(n):\n    a, b = 0, 1"


def tokens(target, draft=None, **kw) -> list[int]:
    return specmlx.generate(target, PROMPT, draft, max_tokens=kw.pop("n", 24), **kw).run().tokens


def run_config(config: dict, world, out: Path) -> dict:
    target = specmlx.load(config["target"], group=world, shard=config["shard"])
    if config["draft"] == "mtp":  # the MTP layer the target's checkpoint ships: a head
        from specmlx.heads.mtp import load_mtp

        draft = load_mtp(target)
    else:
        draft = specmlx.load(config["draft"])
    ids = target.tokenizer.encode(PROMPT)
    logits = target.module(mx.array(ids)[None])
    mx.eval(logits)
    if world.rank() == 0:
        np.save(out / f"{config['name']}-logits.npy", np.array(logits))
    coupled = dict(temperature=1.0, seed=7)
    return {
        "shard": target.shard,
        "alone": tokens(target),
        "auto": tokens(target, draft),
        "fixed": tokens(target, draft, num_draft=3, tree="off"),
        "tree": tokens(target, draft, num_draft=3, tree=6),
        "lookup": tokens(target, draft, draft_mode="lookup", num_draft=4),
        "coupled_alone": tokens(target, **coupled),
        "coupled": tokens(target, draft, **coupled),
        "rejection": tokens(target, draft, num_draft=2, sampling="rejection", **coupled),
    }


def chi_counts(chi: dict, world) -> list[list[int]]:
    """Counts of (first, second) token over `runs` seeds, rejection sampling at T = 1."""
    target = specmlx.load(chi["target"], group=world, shard=chi["shard"])
    draft = specmlx.load(chi["draft"])
    target.tokenizer.eos_token_ids = set()
    session = specmlx.Session(target, draft)
    v = target.vocab_size
    counts = np.zeros((v, v), np.int64)
    for seed in range(chi["runs"]):
        gen = specmlx.generate(
            target,
            chi["prompt"],
            draft,
            num_draft=2,
            max_tokens=2,
            temperature=1.0,
            sampling="rejection",
            seed=seed,
            session=session,
        )
        a, b = (step.token for step in islice(gen, 2))
        gen.close()  # at the same step on every rank, as the CLI's stop strings do
        counts[a, b] += 1
    return counts.tolist()


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    world = distributed.group()
    results = {"rank": world.rank(), "size": world.size(), "configs": {}}
    for config in spec["configs"]:
        results["configs"][config["name"]] = run_config(config, world, out)
    if spec.get("chi"):
        results["chi"] = chi_counts(spec["chi"], world)
    (out / f"rank{world.rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
