"""Train a small GPT on a corpus, or fetch it from the checkpoint cache.

    python -m evictlab.train model=gpt_small dataset=pydoc_topics

Reads top to bottom: the n-gram baselines, the training loop (learning-rate schedule, optimizer, the
steps), resumable progress (a killed or interrupted training continues where it stopped, bit-identically),
then the training record. The checkpoint store (checkpoints.py `get_checkpoint`) calls `train_model` on a
miss and keeps the model with its meta; `python -m evictlab.train` is the store's entry point. Training
windows come from data/sampler.py.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from evictlab.config import Config, TrainConfig
from evictlab.data.dataset import Corpus, TokenSplit
from evictlab.data.sampler import WindowSampler
from evictlab.errors import DivergedError, TrainingInterrupted
from evictlab.models.gpt import GPT
from evictlab.perf import build_info, matmul_flops_per_s, pinned_threads
from evictlab.store import atomic_path, to_jsonable

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------- baselines


def ngram_bits_per_byte(train: TokenSplit, val: TokenSplit, vocab_size: int, order: int) -> float:
    """Val bits/byte of an add-one-smoothed unigram (order 1) or bigram (order 2) model fit on train."""
    if order == 1:
        counts = np.bincount(train.ids, minlength=vocab_size).astype(np.float64) + 1
        nll = -np.log(counts / counts.sum())[val.ids].sum()
    elif order == 2:

        def pairs(s: TokenSplit) -> np.ndarray:  # bigrams inside documents only
            codes = s.ids[:-1] * vocab_size + s.ids[1:]
            inside = np.ones(len(codes), dtype=bool)
            inside[s.offsets[1:-1] - 1] = False
            return codes[inside]

        uniq, cnt = np.unique(pairs(train), return_counts=True)
        ctx = np.bincount(uniq // vocab_size, weights=cnt, minlength=vocab_size)
        v = pairs(val)
        idx = np.clip(np.searchsorted(uniq, v), 0, len(uniq) - 1)
        joint = np.where(uniq[idx] == v, cnt[idx], 0)
        nll = -np.log((joint + 1) / (ctx[v // vocab_size] + vocab_size)).sum()
        nll += -np.log(1 / vocab_size) * val.n_docs  # first token of each document: uniform
    else:
        raise ValueError("order must be 1 or 2")
    return float(nll / math.log(2) / val.n_bytes)


# ------------------------------------------------------------------------------------ training


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay from lr to min_lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(model: GPT, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on 2-D weights (matmuls, embeddings) only; norms are not decayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=True)


@torch.no_grad()
def mean_loss(model: GPT, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    total, count = 0.0, 0
    for x, y in batches:
        _, loss = model(x, y)
        n = int((y >= 0).sum())
        total, count = total + float(loss) * n, count + n
    model.train()
    return total / max(1, count)


def fixed_batches(
    sampler: WindowSampler, cfg: TrainConfig, device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [tuple(t.to(device) for t in sampler.batch(cfg.batch_size)) for _ in range(cfg.eval_batches)]


def train_step(
    model: GPT, opt, tc: TrainConfig, sampler: WindowSampler, step: int, device
) -> tuple[float, float]:
    """One optimizer step at the scheduled learning rate (clipped gradients); returns (lr, its loss)."""
    lr = lr_at(step, tc)
    for group in opt.param_groups:
        group["lr"] = lr
    x, y = (t.to(device) for t in sampler.batch(tc.batch_size))
    _, loss = model(x, y)
    value = float(loss.detach())
    if not math.isfinite(value):
        raise DivergedError(
            f"training diverged: loss {value} at step {step + 1} (lr {lr:.3g}); nothing was "
            "cached. Lower train.lr or check the model settings"
        )
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if tc.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
    opt.step()
    return lr, value


def optimize(
    model: GPT,
    tc: TrainConfig,
    sampler: WindowSampler,
    val_batches,
    name: str,
    after_step: Callable[[int], None] | None = None,
    progress: Progress | None = None,
) -> tuple[list[dict], float]:
    """The training loop: AdamW with the lr schedule, gradient clipping and a validation loss every
    eval_interval steps; returns the history (one row per step) and the seconds spent training (over every
    resumed part). With `progress`, it starts from the saved state if there is one, saves the state every
    `train.save_every_s` seconds, and on Ctrl-C saves it at the end of the step and raises
    TrainingInterrupted. `after_step(steps done)`, if given, runs after each step (benchmarks/recipe_probe.py
    measures the model there)."""
    device = next(model.parameters()).device
    opt = make_optimizer(model, tc)
    history: list[dict[str, float]] = []
    done, spent = 0, 0.0
    if progress is not None and (state := progress.load()) is not None:
        done, history, spent = state.restore(model, opt, sampler)
    bar = tqdm(
        range(done, tc.steps),
        desc=f"train {name}",
        disable=not tc.progress,
        unit="step",
        file=sys.stderr,
        initial=done,
        total=tc.steps,
    )
    start, resumed = time.perf_counter() - spent, time.perf_counter()
    model.train()
    with stop_requests() as stop:
        for step in bar:
            lr, value = train_step(model, opt, tc, sampler, step, device)
            row: dict[str, float] = {"step": step + 1, "lr": lr, "train_loss": value}
            if (step + 1) % tc.eval_interval == 0 or step + 1 == tc.steps:
                row["val_loss"] = mean_loss(model, val_batches)
            history.append(row)
            if step % 10 == 0 or "val_loss" in row:
                tok_s = (step + 1 - done) * tc.batch_size * tc.seq_len / (time.perf_counter() - resumed)
                post = {"loss": f"{row['train_loss']:.3f}", "tok/s": f"{tok_s:,.0f}"}
                if "val_loss" in row:
                    post["val"] = f"{row['val_loss']:.3f}"
                bar.set_postfix(post, refresh=False)
            if after_step is not None:
                after_step(step + 1)
            if progress is not None and step + 1 < tc.steps:
                if stop.is_set() or time.perf_counter() - progress.last_save >= tc.save_every_s:
                    progress.save(TrainState.capture(model, opt, sampler, history, start))
                if stop.is_set():
                    bar.close()
                    raise TrainingInterrupted(
                        f"training interrupted after step {step + 1} of {tc.steps}; its progress is saved in "
                        f"{progress.path}: run the same command to continue"
                    )
    model.eval()
    return history, time.perf_counter() - start


# ------------------------------------------------------------------------------ resumable progress


@dataclass
class TrainState:
    """Everything a training needs to continue bit-identically: the weights, AdamW's moments and step
    counts, the sampler's generator and batch count (the curriculum), the history and the time spent.
    (The model has no dropout, so torch's generator is not part of it.)"""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    info: dict[str, Any] = field(default_factory=dict)  # steps, sampler, history, seconds (JSON)

    @classmethod
    def capture(
        cls, model: GPT, opt, sampler: WindowSampler, history: list[dict], start: float
    ) -> TrainState:
        info = {
            "steps": len(history),
            "sampler": {"rng": sampler.rng.bit_generator.state, "batches": sampler.batches},
            "history": history,
            "seconds": time.perf_counter() - start,
        }
        return cls(model.state_dict(), opt.state_dict(), info)

    def restore(self, model: GPT, opt, sampler: WindowSampler) -> tuple[int, list[dict], float]:
        model.load_state_dict(self.model)
        opt.load_state_dict(self.optimizer)
        sampler.rng.bit_generator.state = self.info["sampler"]["rng"]
        sampler.batches = self.info["sampler"]["batches"]
        return self.info["steps"], list(self.info["history"]), self.info["seconds"]


class Progress:
    """A training's saved progress, `<checkpoints>/.progress/<name>-<key>.pt`: written atomically every
    train.save_every_s seconds (and when Ctrl-C stops it), read back by the next training under the same key,
    removed once the checkpoint is written. Only the process that holds the checkpoint's lock touches it."""

    def __init__(self, path: Path, key: str):
        self.path, self.key, self.last_save = path, key, time.perf_counter()

    def load(self) -> TrainState | None:
        if not self.path.exists():
            return None
        try:
            raw = torch.load(self.path, map_location="cpu", weights_only=True)
            info = json.loads(raw["info"])
            if info.get("key") != self.key:
                raise ValueError(f"it belongs to key {info.get('key')!r}")
            state = TrainState(raw["model"], raw["optimizer"], info)
        except Exception as e:  # noqa: BLE001 - any unreadable file: start again, and say so
            log.warning("saved training progress %s is unusable (%s); training from step 0", self.path, e)
            return None
        log.info("resuming training from step %d (saved progress %s)", info["steps"], self.path)
        return state

    def save(self, state: TrainState) -> None:
        info = json.dumps(to_jsonable(state.info | {"key": self.key}))
        with atomic_path(self.path) as tmp:
            torch.save({"model": state.model, "optimizer": state.optimizer, "info": info}, tmp)
        self.last_save = time.perf_counter()

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)


@contextmanager
def stop_requests() -> Iterator[threading.Event]:
    """While training in the main thread, Ctrl-C sets the yielded event instead of raising mid-step (the
    loop saves its progress at the end of the step, then stops); a second Ctrl-C interrupts at once."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = signal.getsignal(signal.SIGINT)

    def request(signum, frame) -> None:
        stop.set()
        signal.signal(signal.SIGINT, previous)
        print("\nstopping after this training step (Ctrl-C again to stop now)", file=sys.stderr)

    signal.signal(signal.SIGINT, request)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def training_record(model: GPT, corpus: Corpus, tc: TrainConfig, losses: tuple[float, float], wall: float):
    """What meta.json records about a training: final losses in nats and bits per byte, n-gram
    baselines, throughput against the machine's matmul rate."""
    train_loss, val_loss = losses
    ln2, tokens = math.log(2), tc.steps * tc.batch_size * tc.seq_len
    flops_per_token = model.flops_per_token(tc.seq_len)
    matmul = matmul_flops_per_s() if next(model.parameters()).device.type == "cpu" else None
    splits, vocab = corpus.splits, corpus.tokenizer.vocab_size
    return {
        "train_loss": train_loss,
        "val_loss": val_loss,
        "train_bpb": train_loss / ln2 / splits["train"].bytes_per_token,
        "val_bpb": val_loss / ln2 / splits["val"].bytes_per_token,
        "baselines": {
            f"{name}_val_bpb": ngram_bits_per_byte(splits["train"], splits["val"], vocab, order)
            for name, order in (("unigram", 1), ("bigram", 2))
        },
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "params": model.num_params(),
        "flops_per_token": flops_per_token,
        "matmul_flops_per_s": matmul,
        "floor_fraction": tokens / wall * flops_per_token / matmul if matmul else None,
    }


def train_model(cfg: Config, corpus: Corpus, progress: Progress | None = None) -> tuple[GPT, dict[str, Any]]:
    """Train with the config's seed at exactly train.threads threads (restored after), from scratch or from
    `progress`'s saved state; returns the model and its training record."""
    with pinned_threads(cfg.train.threads):
        return _train_model(cfg, corpus, progress)


def _train_model(cfg: Config, corpus: Corpus, progress: Progress | None) -> tuple[GPT, dict[str, Any]]:
    tc, mc = cfg.train, cfg.model
    device = torch.device(tc.device)
    torch.manual_seed(tc.seed)
    model = GPT(mc).to(device)
    train_s = WindowSampler.for_training(corpus, tc, mc.sink_token)
    # Fixed evaluation windows, drawn from their own generators so they never move the training stream.
    val_s = WindowSampler(corpus.splits["val"], corpus, tc.seq_len, mc.sink_token, seed=10_000 + tc.seed)
    fixed_train = WindowSampler(
        corpus.splits["train"], corpus, tc.seq_len, mc.sink_token, seed=20_000 + tc.seed
    )
    val_batches, train_batches = fixed_batches(val_s, tc, device), fixed_batches(fixed_train, tc, device)
    history, wall = optimize(model, tc, train_s, val_batches, mc.name, progress=progress)
    losses = mean_loss(model, train_batches), mean_loss(model, val_batches)
    record = training_record(model, corpus, tc, losses, wall) | {"build": build_info(), "history": history}
    return model, record


# python -m evictlab.train: the store trains on a miss (checkpoints.get_checkpoint, its entry point)
if __name__ == "__main__":
    from evictlab.checkpoints import main

    main()
