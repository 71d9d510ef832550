"""Training a feature head on the target's own features: `specmlx head train`.

Four steps, each resumable from the work dir beside the output (HEAD.partial/,
corpus.work_dir); the first two are specmlx.heads.corpus's:

1. collect: the data as documents of the target's tokens: text files (folders walked,
   globs expanded) and JSONL prompts the target answers itself first (greedy, at most
   ANSWER_TOKENS a turn), so that the head learns the replies it will draft. Documents
   go to a held-out slice by a hash of their tokens, never trained on; each slice is cut
   into sequences of --seq-len tokens.
2. cache_features: one pass of the target over each sequence keeps its feature at every
   position (its normed last hidden state, float16 on disk) and, on the held-out slice,
   its greedy token. The teacher's distribution is recomputed from the features through
   the target's own output rows, so only features are stored.
3. train_loop: self-distillation. At position i the head reads the feature at i and the
   embedding of token i + 1; its loss is KL(teacher at i + 1 || head) over the head's
   output rows plus a small smooth-L1 pull of its output feature towards the target's at
   i + 1 (EAGLE's), and the same again for a second draft step fed its own first output
   ("training-time test", EAGLE-3), so that drafts past the first do not collapse.
4. evaluate: the greedy acceptance per draft position on the held-out slice: how often
   the head's argmax is the target's own greedy token.

A run that stops (Ctrl-C, --minutes, a crash) resumes from its last checkpoint; data order
and everything random are functions of (seed, step), so an interrupted-and-resumed run
ends with the weights an uninterrupted one does.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..cpu.fp32 import dequantized
from ..errors import SpecmlxError
from ..lm_head import cuttable
from ..loading import Model
from .corpus import Data, Report, Sources, cache_features, prepare, work_dir, write_json
from .feature import new_head, text_args
from .head import head_vocab, target_rows
from .store import save_head, weights_id

FORMAT = 1  # of the work dir; a change makes old ones start over
# the feature term's weight beside the KL, which acceptance follows (EAGLE weighs them
# the other way round: L_reg + 0.1 L_cls)
REGRESSION = 0.1
STEP_WEIGHTS = (1.0, 0.8)  # draft steps 1 and 2 (EAGLE-3 weighs step k by 0.8^k)
CLIP_NORM = 1.0
WEIGHT_DECAY = 0.01
EVAL_TOKENS = 4096  # of the held-out slice read for the estimate shown while training
CURVE_POINTS = 100  # of the loss curve kept (each the mean loss since the last)

RUN = "run.json"
CHECKPOINT = "checkpoint.safetensors"


@dataclass(frozen=True)
class Settings:
    steps: int = 2000
    minutes: float = 25.0  # of training; collecting and caching come before
    seq_len: int = 256
    batch: int = 4
    lr: float = 3e-4
    held_out: float = 0.05  # of the tokens, by document
    max_tokens: int = 100_000
    seed: int = 0
    checkpoint_every: int = 100  # steps; the held-out estimate is refreshed as often


def check_settings(s: Settings) -> None:
    """Refuse, in one line each, settings no run could use."""
    rules = [
        (s.steps >= 1, f"--steps must be at least 1, got {s.steps}"),
        (s.minutes > 0, f"--minutes must be above 0, got {s.minutes}"),
        (s.seq_len >= 4, f"--seq-len must be at least 4, got {s.seq_len}"),
        (s.batch >= 1, f"--batch must be at least 1, got {s.batch}"),
        (0 < s.lr < 1, f"--lr must be in (0, 1), got {s.lr}"),
        (0 < s.held_out <= 0.5, f"--held-out must be in (0, 0.5], got {s.held_out}"),
        (
            s.max_tokens >= 2 * s.seq_len,
            f"--max-tokens must be at least twice --seq-len ({s.seq_len}), got {s.max_tokens}",
        ),
        (s.checkpoint_every >= 1, "checkpoints must be at least a step apart"),
    ]
    for ok, why in rules:
        if not ok:
            raise SpecmlxError(why)


# -- training -----------------------------------------------------------------------------


class _Pass:
    """Stands in for the head layer's KV cache in a training pass, where no cache is kept:
    positions count from 0, and with `first` (the first draft step's pass) the attention
    reads that pass's keys and values before its own. Its mask: causal in the first pass;
    in the second, row i sees the first pass's rows before i and its own, as a second
    draft step sees the rows of the target's features before it and itself."""

    offset = 0

    def __init__(self, first: _Pass | None = None):
        self.first = first
        self.keys = self.values = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys, self.values = keys, values
        if self.first is None:
            return keys, values
        return (
            mx.concatenate([self.first.keys, keys], axis=2),
            mx.concatenate([self.first.values, values], axis=2),
        )

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        if self.first is None:
            return "causal"
        rows, cols = mx.arange(n)[:, None], mx.arange(2 * n)[None]
        return mx.where(cols < n, cols < rows, cols - n == rows)


def plain(module: nn.Module) -> None:
    """Put every layer back on MLX's own ops: the CPU's native ones (specmlx.cpu) and
    compiled calls (specmlx.compiled) have no gradient, and a compiled norm copied from
    the target would run the target's own."""
    for layer in module.modules():
        cls = next(
            c
            for c in type(layer).__mro__
            if issubclass(c, nn.Module)
            and not c.__module__.startswith(("specmlx.cpu", "specmlx.compiled"))
        )
        if cls is not type(layer):
            layer.__class__ = cls
            layer.__dict__.pop("_compiled", None)


def output_rows(target: Model) -> tuple[mx.array, mx.array]:
    """(the head's output rows as one float32 matrix (N, D), their token ids (N,)): the
    target's output head cut to the head's sub-vocabulary (target_rows), dequantized
    once so that the training's matmuls run on the BLAS (and have a gradient, which the
    native kernel's do not); rows past the tokenizer's vocabulary (padding) left out."""
    rows, _, ids = target_rows(target, head_vocab(target))
    weight = dequantized(rows)
    ids = mx.arange(weight.shape[0], dtype=mx.uint32) if ids is None else ids
    real = np.flatnonzero(np.array(ids) < target.vocab_size)
    weight = weight[mx.array(real)]
    ids = ids[mx.array(real)]
    mx.eval(weight, ids)
    return weight, ids


def draft_passes(module: nn.Module, embedded: mx.array, features: mx.array) -> list[tuple]:
    """[(fed back, read by the output rows)] of draft steps 1 and 2 over (B, L, D) rows:
    row i of step 1 reads the target's feature at i, row i of step 2 the head's own
    step-1 output of row i - 1 (row 0 has none: it is left out of the loss)."""
    first = _Pass()
    fed1, read1 = module(embedded, features, first)
    fed_back = mx.concatenate([features[:, :1], fed1[:, :-1]], axis=1)
    fed2, read2 = module(embedded, fed_back, _Pass(first))
    return [(fed1, read1), (fed2, read2)]


def loss(
    module: nn.Module,
    embedded: mx.array,
    features: mx.array,
    targets: mx.array,
    teacher: mx.array,
    masks: list[mx.array],
    rows: mx.array,
) -> mx.array:
    """KL(teacher || head) plus REGRESSION x smooth L1 to the target's next feature,
    averaged over the positions in `masks` (per draft step), steps weighed by
    STEP_WEIGHTS. teacher: log-probabilities (B, L, N) over the output rows."""
    p = mx.exp(teacher)
    total = mx.array(0.0)
    for (fed, read), mask, weight in zip(
        draft_passes(module, embedded, features), masks, STEP_WEIGHTS, strict=True
    ):
        logq = nn.log_softmax(read @ rows.T, axis=-1)
        kl = (p * (teacher - logq)).sum(axis=-1)
        pull = nn.losses.smooth_l1_loss(fed, targets, reduction="none").mean(axis=-1)
        # at least 1: a batch of two-token sequences has no row for a second step
        count = mx.maximum(mask.sum(), 1)
        total = total + weight * ((kl + REGRESSION * pull) * mask).sum() / count
    return total


@lru_cache(maxsize=4)
def permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def batch_indices(seed: int, step: int, n: int, batch: int) -> list[int]:
    """The training sequences of step `step`: a permutation per epoch, seeded by (seed,
    epoch) and read in order, so any step's batch is known without the steps before."""
    out = []
    for k in range(step * batch, (step + 1) * batch):
        epoch, at = divmod(k, n)
        out.append(int(permutation(seed, epoch, n)[at]))
    return out


def batch_arrays(target: Model, data: Data, features: np.ndarray, index: list[int]) -> tuple:
    """(embedded, features in, features next, valid for step 1, valid for step 2) of
    sequences `index`: row i pairs the feature at i with token i + 1's embedding and
    predicts position i + 1."""
    tokens = mx.array(data.tokens[index])
    feats = mx.array(np.asarray(features[index], np.float32))
    # the target's own embedding, as Head.embed reads it (shared, never trained)
    embedded = text_args(target)[0].model.embed_tokens(tokens[:, 1:]).astype(mx.float32)
    positions = mx.arange(tokens.shape[1] - 1)[None]
    valid = positions + 1 < mx.array(data.lengths[index])[:, None]
    return (
        embedded,
        feats[:, :-1],
        feats[:, 1:],
        valid.astype(mx.float32),
        (valid & (positions >= 1)).astype(mx.float32),
    )


def teacher_of(targets: mx.array, rows: mx.array) -> mx.array:
    return nn.log_softmax(targets @ rows.T, axis=-1)


def schedule(settings: Settings):
    """Linear warmup over the first tenth of the steps (at most 100), then a cosine down
    to a tenth of the rate."""
    warmup = max(1, min(100, settings.steps // 10))
    return optim.join_schedules(
        [
            optim.linear_schedule(0.0, settings.lr, warmup),
            optim.cosine_decay(settings.lr, max(1, settings.steps - warmup), settings.lr / 10),
        ],
        [warmup],
    )


@dataclass
class Outcome:
    step: int = 0
    seconds: float = 0.0  # of training, over every run that resumed
    curve: list = field(default_factory=list)  # [step, mean loss since the last point]
    alphas: list = field(default_factory=list)  # [step, alpha 1, alpha 2] on EVAL_TOKENS
    recent: list = field(default_factory=list)  # losses since the last curve point
    stopped: str = ""  # "steps", "minutes" or "interrupted"


def save_checkpoint(
    work: Path, module: nn.Module, optimizer: optim.Optimizer, run: Outcome
) -> None:
    """The head, the optimizer's state and the run so far in one file, atomically."""
    arrays = {f"head.{k}": v for k, v in tree_flatten(module.parameters())}
    arrays.update({f"optimizer.{k}": v for k, v in tree_flatten(optimizer.state)})
    state = {k: v for k, v in asdict(run).items() if k != "stopped"}
    tmp = work / f".{CHECKPOINT}.tmp.safetensors"
    mx.save_safetensors(str(tmp), arrays, metadata={"run": json.dumps(state)})
    os.replace(tmp, work / CHECKPOINT)


def load_checkpoint(work: Path, module: nn.Module, optimizer: optim.Optimizer) -> Outcome:
    arrays, metadata = mx.load(str(work / CHECKPOINT), return_metadata=True)
    module.load_weights(prefixed(arrays, "head."), strict=True)
    optimizer.state = tree_unflatten(prefixed(arrays, "optimizer."))
    return Outcome(**json.loads(metadata["run"]))


def prefixed(arrays: dict[str, mx.array], prefix: str) -> list[tuple[str, mx.array]]:
    return [(k[len(prefix) :], v) for k, v in arrays.items() if k.startswith(prefix)]


def evaluate(
    module: nn.Module,
    target: Model,
    data: Data,
    features: np.ndarray,
    greedy: np.ndarray,
    rows: mx.array,
    ids: mx.array,
    batch: int,
    limit: int | None = None,
) -> list[float]:
    """Greedy acceptance at draft positions 1 and 2 on the held-out slice (its first
    `limit` tokens or all): how often the head's argmax is the target's own greedy next
    token, drafting from the target's features (1) and from its own first output (2)."""
    hits, counts = np.zeros(2), np.zeros(2)
    held = list(range(data.n_train, len(data.lengths)))
    if limit is not None:
        sizes = np.cumsum(data.lengths[data.n_train :])
        held = held[: max(1, int(np.searchsorted(sizes, limit)) + 1)]
    for at in range(0, len(held), batch):
        index = held[at : at + batch]
        embedded, f_in, _, *masks = batch_arrays(target, data, features, index)
        truth = mx.array(greedy[np.array(index) - data.n_train][:, 1:])
        for k, ((_, read), mask) in enumerate(
            zip(draft_passes(module, embedded, f_in), masks, strict=True)
        ):
            drafted = ids[mx.argmax(read @ rows.T, axis=-1)]
            hits[k] += float(((drafted == truth) * mask).sum())
            counts[k] += float(mask.sum())
    return [float(h / max(c, 1)) for h, c in zip(hits, counts, strict=True)]


def train_loop(
    module: nn.Module,
    target: Model,
    data: Data,
    features: np.ndarray,
    greedy: np.ndarray,
    settings: Settings,
    work: Path,
    report: Report,
    stop: Callable[[int], bool],
) -> Outcome:
    """Train `module` from the work dir's checkpoint (or from its start) until --steps,
    --minutes, or `stop(step)` (Ctrl-C): checkpointed every `checkpoint_every` steps and
    where it stops."""
    rows, ids = output_rows(target)
    optimizer = optim.AdamW(learning_rate=schedule(settings), weight_decay=WEIGHT_DECAY)
    run = load_checkpoint(work, module, optimizer) if (work / CHECKPOINT).is_file() else Outcome()
    step_loss = nn.value_and_grad(module, lambda *args: loss(module, *args, rows))
    every = max(1, settings.steps // CURVE_POINTS)
    start, before = time.perf_counter(), run.seconds

    def estimate() -> None:
        alpha = evaluate(
            module, target, data, features, greedy, rows, ids, settings.batch, EVAL_TOKENS
        )
        run.alphas.append([run.step, *alpha])

    if not run.alphas:
        estimate()  # the untrained head's, for the curve's start
    while run.step < settings.steps:
        embedded, f_in, f_next, *masks = batch_arrays(
            target,
            data,
            features,
            batch_indices(settings.seed, run.step, data.n_train, settings.batch),
        )
        value, grads = step_loss(embedded, f_in, f_next, teacher_of(f_next, rows), masks)
        grads, _ = optim.clip_grad_norm(grads, CLIP_NORM)
        optimizer.update(module, grads)
        mx.eval(module.parameters(), optimizer.state, value)
        run.step += 1
        run.recent.append(float(value))
        if run.step % every == 0 or run.step == settings.steps:
            run.curve.append([run.step, round(float(np.mean(run.recent)), 5)])
            run.recent = []
        run.seconds = before + time.perf_counter() - start
        if run.step % settings.checkpoint_every == 0 and run.step < settings.steps:
            estimate()
            save_checkpoint(work, module, optimizer, run)
        step, *alpha = run.alphas[-1]
        report.progress(
            "training", run.step, settings.steps, loss=float(value), alpha=alpha, alpha_step=step
        )
        if stop(run.step):
            run.stopped = "interrupted"
            break
        if time.perf_counter() - start >= settings.minutes * 60:  # this call's own time
            run.stopped = "minutes"
            break
    run.stopped = run.stopped or "steps"
    save_checkpoint(work, module, optimizer, run)
    return run


class Interrupts:
    """Ctrl-C while training asks the loop to stop at the end of its step (it then saves
    a checkpoint); a second Ctrl-C stops at once. Elsewhere Ctrl-C is as usual (what
    collecting and caching did is kept as it goes)."""

    def __init__(self):
        self.asked = False
        self.previous = None

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, *_args) -> None:
        if self.asked:
            raise KeyboardInterrupt
        self.asked = True

    def __exit__(self, *_exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


# -- the whole run ------------------------------------------------------------------------


def fingerprints(target: Model, sources: Sources, settings: Settings) -> dict:
    """What the work dir's contents depend on: the data (target, files, how they are
    collected and cut) and, beyond it, the training (--minutes only says when to stop)."""
    _, _, ids = target_rows(target, head_vocab(target))
    vocab = None if ids is None else hashlib.sha256(np.array(ids).tobytes()).hexdigest()
    data = {
        "format": FORMAT,
        "target": weights_id(target.path),
        "files": sources.signature,
        "items": len(sources.items),
        **{k: getattr(settings, k) for k in ("seq_len", "held_out", "max_tokens")},
    }
    training = {k: getattr(settings, k) for k in ("steps", "batch", "lr", "seed")}
    return {"data": data, "training": {**training, "vocab": vocab}}


def open_work(work: Path, marks: dict, resume: bool | None, report: Report) -> None:
    """Make the work dir ready: kept where it matches (unless resume is False), its
    checkpoint dropped where only the training settings changed, else started anew."""
    said = json.loads((work / RUN).read_text()) if (work / RUN).is_file() else None
    if work.exists() and said is None:
        raise SpecmlxError(
            f"{work} exists and is not a training work dir; move it away or pick another -o"
        )
    if resume and (said is None or said.get("data") != marks["data"]):
        raise SpecmlxError(f"nothing to resume in {work} for this target, data and settings")
    if said is not None and (resume is False or said.get("data") != marks["data"]):
        shutil.rmtree(work)
        said = None
        if resume is None:
            report.note(f"the target, data or settings changed: {work} started anew")
    elif said is not None and said.get("training") != marks["training"]:
        (work / CHECKPOINT).unlink(missing_ok=True)
        report.note("training settings changed: training starts over on the cached features")
    elif said is not None:
        report.note(f"resuming from {work}")
    work.mkdir(parents=True, exist_ok=True)
    write_json(work / RUN, marks)


@dataclass
class Result:
    outcome: Outcome
    trained: dict  # what the head's config says of its training
    out: Path
    work: Path


def run(
    target: Model,
    sources: Sources,
    out: Path,
    settings: Settings,
    resume: bool | None = None,
    report: Report | None = None,
    stop: Callable[[int], bool] | None = None,
) -> Result:
    """Collect, cache, train and evaluate; write the head to `out` unless interrupted.
    The work dir is removed once --steps are done; where training stopped before (Ctrl-C,
    --minutes) it keeps the checkpoint that the same call resumes from."""
    report = report or Report()
    check_settings(settings)
    if not cuttable(target):
        arch = target.config.get("model_type", "this architecture")
        raise SpecmlxError(
            f"a head reads the target's features, which specmlx cannot take from {arch}"
        )
    started = time.perf_counter()
    work = work_dir(out)
    open_work(work, fingerprints(target, sources, settings), resume, report)
    data = prepare(
        target, sources, work, settings.seq_len, settings.held_out, settings.max_tokens, report
    )
    features, greedy = cache_features(target, data, work, report)
    module = new_head(target, settings.seed)
    plain(module)
    with Interrupts() as interrupts:
        asked = lambda step: interrupts.asked or (stop is not None and stop(step))  # noqa: E731
        outcome = train_loop(module, target, data, features, greedy, settings, work, report, asked)
    trained = {}
    if outcome.stopped != "interrupted":
        rows, ids = output_rows(target)
        alpha = evaluate(module, target, data, features, greedy, rows, ids, settings.batch)
        # the curve ends on the whole held-out slice's figure (the others read its start)
        outcome.alphas = [a for a in outcome.alphas if a[0] != outcome.step]
        outcome.alphas.append([outcome.step, *alpha])
        trained = {
            "data": data.description,
            "tokens": data.tokens_in,
            "steps": outcome.step,
            "stopped_by": outcome.stopped,
            "held_out_alpha": {"1": alpha[0], "2": alpha[1]},
            "loss_curve": outcome.curve,
            "alpha_curve": outcome.alphas,
            "settings": asdict(settings),
            "seconds": round(time.perf_counter() - started, 1),
            "training_seconds": round(outcome.seconds, 1),
        }
        save_head(module, target, out, trained)
        write_curve(out, outcome)
    if outcome.stopped == "steps":  # else the checkpoint is kept, to train on from
        del features, greedy  # the maps, before their files go
        shutil.rmtree(work)
    return Result(outcome, trained, out, work)


def write_curve(out: Path, outcome: Outcome) -> None:
    """training_curve.csv in the head's directory (loss, and the held-out estimate where
    it was taken), and training_curve.png beside it where matplotlib is installed."""
    alphas = {int(a[0]): a[1:] for a in outcome.alphas}
    lines = ["step,loss,alpha_1,alpha_2"]
    points = sorted({int(s) for s, _ in outcome.curve} | set(alphas))
    losses = {int(s): v for s, v in outcome.curve}
    for s in points:
        loss_text = f"{losses[s]:.6g}" if s in losses else ""
        alpha = ",".join(f"{a:.4f}" for a in alphas[s]) if s in alphas else ","
        lines.append(f"{s},{loss_text},{alpha}")
    (out / "training_curve.csv").write_text("\n".join(lines) + "\n")
    try:  # a Figure of its own, not pyplot's: no backend is chosen for the process
        from matplotlib.figure import Figure
    except ImportError:
        return
    figure = Figure(figsize=(7, 6))
    top, bottom = figure.subplots(2, 1, sharex=True)
    if outcome.curve:
        top.plot(*zip(*outcome.curve, strict=True))
    top.set_ylabel("loss")
    steps = sorted(alphas)
    for k in range(2):
        bottom.plot(steps, [alphas[s][k] for s in steps], marker="o", label=f"position {k + 1}")
    bottom.set_ylabel("held-out greedy α")
    bottom.set_xlabel("step")
    bottom.legend()
    figure.tight_layout()
    figure.savefig(out / "training_curve.png", dpi=100)
