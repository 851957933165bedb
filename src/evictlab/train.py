"""Train a small GPT on a corpus, or fetch it from the checkpoint cache.

    python -m evictlab.train model=gpt_small dataset=pydoc_topics

A checkpoint lives in ``outputs/checkpoints/<key>/`` (``model.safetensors`` + ``meta.json``); the
key hashes everything that determines the weights. Concurrent callers train once (file lock);
a checkpoint is written under a temp name and renamed; a damaged one is retrained with a warning.
"""

from __future__ import annotations

import logging
import math
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_model, save_model
from tqdm.auto import tqdm

from evictlab.config import Config, TrainConfig, hydra_entry, key_dict
from evictlab.data.dataset import Corpus, TokenSplit, load_corpus
from evictlab.errors import ConfigError, DivergedError
from evictlab.eval.sinks import sink_metrics
from evictlab.models.gguf import is_gguf
from evictlab.models.gpt import GPT, GPTConfig
from evictlab.perf import build_info, matmul_flops_per_s, pinned_threads
from evictlab.store import (
    file_lock,
    file_sha256,
    git_info,
    package_versions,
    raise_if_disk_full,
    read_json,
    stable_hash,
    to_jsonable,
    write_json,
)

log = logging.getLogger(__name__)
CHECKPOINT_FORMAT = 2  # bump when training semantics or the file layout change
# 2: training at an explicit thread count (train.threads, in the key); format 1 keys mixed thread counts


@dataclass
class Checkpoint:
    path: Path
    model: GPT
    meta: dict[str, Any]
    cached: bool  # True when loaded from the cache, False when trained by this call


# ---------------------------------------------------------------------------------------- data


class WindowSampler:
    """Random training windows: prefix (<sink>?, <bos>) + a slice of the split's token stream.

    The stream joins documents with <bos>; <bos>/<sink> targets are masked out of the loss, so the
    loss counts text tokens only (and converts exactly to bits per byte).
    """

    def __init__(
        self,
        split: TokenSplit,
        corpus: Corpus,
        seq_len: int,
        sink_token: bool,
        seed: int,
        recall_share: float = 0.0,
        recall_queries: int = 1,
        synthetic_share: float = 0.0,
        synthetic_kind: str = "events",
        synthetic_warmup: int = 0,
    ):
        self.prefix = np.asarray(corpus.prefix(sink_token), dtype=np.int64)
        self.stream = split.stream(corpus.tokenizer.bos_id if corpus.bos else None)
        self.body = seq_len + 1 - len(self.prefix)  # tokens taken from the stream per sample
        if self.body < 2 or len(self.stream) < self.body:
            raise ConfigError(
                f"train.seq_len={seq_len} does not fit: the split has {len(self.stream)} tokens "
                f"and the prefix takes {len(self.prefix)}"
            )
        self.specials = [corpus.tokenizer.bos_id, corpus.tokenizer.sink_id]
        self.rng = np.random.default_rng(seed)
        self.recall_share, self.recall_queries = recall_share, recall_queries
        self.synthetic_share = synthetic_share
        self.synthetic_kind = synthetic_kind  # "events" | "copy" (a SyntheticKind compares equal to its name)
        self.synthetic_warmup, self.batches = synthetic_warmup, 0  # batches drawn so far (= training steps)
        self.split, self.tok, self.seq_len = split, corpus.tokenizer, seq_len

    @classmethod
    def for_training(cls, corpus: Corpus, tc: TrainConfig, sink_token: bool) -> WindowSampler:
        """The training stream of `tc`: its seed, and its mix of pass-key and synthetic documents."""
        mix = ("recall_share", "recall_queries", "synthetic_share", "synthetic_kind", "synthetic_warmup")
        split = corpus.splits["train"]
        return cls(split, corpus, tc.seq_len, sink_token, tc.seed, **{k: getattr(tc, k) for k in mix})

    def batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y: [batch_size, seq_len] int64; y = -1 where the target is a special token."""
        starts = self.rng.integers(0, len(self.stream) - self.body + 1, size=batch_size)
        rows = [np.concatenate((self.prefix, self.stream[s : s + self.body])) for s in starts]
        if self.recall_share > 0:  # replace a share of the samples by pass-key documents (data/recall.py)
            from evictlab.data.recall import make_recall_sequence

            for i in np.flatnonzero(self.rng.random(batch_size) < self.recall_share):
                depth = float(self.rng.random())
                rows[i] = make_recall_sequence(
                    self.tok,
                    self.prefix,
                    self.split.ids,
                    self.seq_len + 1,
                    depth,
                    self.rng,
                    queries=self.recall_queries,
                )[0]
        warm = self.batches < self.synthetic_warmup  # the curriculum's first steps: synthetic only
        self.batches += 1
        if self.synthetic_share > 0 or warm:  # replace a share by synthetic in-context documents
            from evictlab.data.synthetic import make_copy_sequence, make_synthetic_sequence

            share = 1.0 if warm else self.synthetic_share
            for i in np.flatnonzero(self.rng.random(batch_size) < share):
                args = (self.tok, self.prefix, self.split.ids, self.seq_len + 1, self.rng)
                if self.synthetic_kind == "copy":
                    rows[i] = make_copy_sequence(*args, filler_max=0 if warm else 48)
                else:
                    rows[i] = make_synthetic_sequence(*args)
        seq = torch.from_numpy(np.stack(rows))
        x, y = seq[:, :-1], seq[:, 1:].clone()
        y[torch.isin(y, torch.tensor(self.specials))] = -1
        return x, y


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


def optimize(
    model: GPT,
    tc: TrainConfig,
    sampler: WindowSampler,
    val_batches,
    name: str,
    after_step: Callable[[int], None] | None = None,
) -> list[dict]:
    """The training loop: AdamW with the lr schedule, gradient clipping and a validation loss every
    eval_interval steps; returns the history (one row per step). `after_step(steps done)`, if given, runs
    after each step (benchmarks/recipe_probe.py measures the model there)."""
    device = next(model.parameters()).device
    opt = make_optimizer(model, tc)
    history: list[dict[str, float]] = []
    bar = tqdm(range(tc.steps), desc=f"train {name}", disable=not tc.progress, unit="step", file=sys.stderr)
    start = time.perf_counter()
    model.train()
    for step in bar:
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
        row: dict[str, float] = {"step": step + 1, "lr": lr, "train_loss": value}
        if (step + 1) % tc.eval_interval == 0 or step + 1 == tc.steps:
            row["val_loss"] = mean_loss(model, val_batches)
        history.append(row)
        if step % 10 == 0 or "val_loss" in row:
            tok_s = (step + 1) * tc.batch_size * tc.seq_len / (time.perf_counter() - start)
            post = {"loss": f"{row['train_loss']:.3f}", "tok/s": f"{tok_s:,.0f}"}
            if "val_loss" in row:
                post["val"] = f"{row['val_loss']:.3f}"
            bar.set_postfix(post, refresh=False)
        if after_step is not None:
            after_step(step + 1)
    model.eval()
    return history


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


def train_model(cfg: Config, corpus: Corpus) -> tuple[GPT, dict[str, Any]]:
    """Train from scratch with the config's seed at exactly train.threads threads (restored after); returns
    the model and its training record."""
    with pinned_threads(cfg.train.threads):
        return _train_model(cfg, corpus)


def _train_model(cfg: Config, corpus: Corpus) -> tuple[GPT, dict[str, Any]]:
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
    start = time.perf_counter()
    history = optimize(model, tc, train_s, val_batches, mc.name)
    wall = time.perf_counter() - start
    losses = mean_loss(model, train_batches), mean_loss(model, val_batches)
    record = training_record(model, corpus, tc, losses, wall) | {"build": build_info(), "history": history}
    return model, record


# ---------------------------------------------------------------------------------- checkpoints


def checkpoint_key(cfg: Config, corpus: Corpus) -> str:
    """Hash of everything that determines the weights (config.py marks the train settings that do not)."""
    model_cfg = {**key_dict(cfg.model), "vocab_size": corpus.tokenizer.vocab_size}  # (no neutral fields)
    return stable_hash(
        {
            "model": model_cfg,
            "train": key_dict(cfg.train, weights=True),
            "data_hash": corpus.data_hash,
            "tokenizer": corpus.tokenizer.spec,
            "bos": corpus.bos,
            "format": CHECKPOINT_FORMAT,
        }
    )


def load_checkpoint(path: str | Path) -> tuple[GPT, dict[str, Any]]:
    """Load and verify a checkpoint folder; raises ValueError if it is missing, truncated or altered."""
    path = Path(path)
    try:
        meta = read_json(path / "meta.json")
        weights = path / "model.safetensors"
        if file_sha256(weights) != meta["weights_sha256"]:
            raise ValueError("weights hash does not match meta.json")
        model = GPT(GPTConfig(**meta["model"]))
        load_model(model, str(weights))
    except (OSError, KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"checkpoint {path} is unusable: {e}") from e
    model.eval()
    return model, meta


def check_settings(meta: dict[str, Any], cfg: Config, key: str) -> None:
    """A cached checkpoint is what its key says: the model and training settings its meta.json records are
    the requested ones (an edited meta.json would load other weights' settings under this key). Raises
    ValueError naming the first setting that differs."""
    if meta.get("key") != key:
        raise ValueError(f"checkpoint meta.json says key {meta.get('key')!r}, its folder {key!r}")
    # both sides as the key sees them, so a field added later (at its neutral value) matches an older meta
    try:
        stored_model = key_dict(GPTConfig(**meta.get("model", {})))
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint meta.json has unreadable model settings ({e})") from None
    try:
        stored_train = key_dict(TrainConfig(**meta.get("train", {})), weights=True)
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint meta.json has unreadable train settings ({e})") from None
    stored = {f"model.{k}": v for k, v in stored_model.items()}
    wanted = {f"model.{k}": v for k, v in key_dict(cfg.model).items()}
    stored |= {f"train.{k}": v for k, v in stored_train.items()}
    wanted |= {f"train.{k}": v for k, v in key_dict(cfg.train, weights=True).items()}
    for name in sorted(set(stored) | set(wanted)):
        if stored.get(name) != wanted.get(name):
            have, want = stored.get(name), wanted.get(name)
            raise ValueError(f"checkpoint meta.json records {name}={have!r}, but {want!r} was asked for")


def warn_if_other_build(path: Path, meta: dict[str, Any]) -> None:
    """One warning line when a checkpoint was made under another torch build or CPU capability: its weights
    are what they are, but training again here would not give the same bits."""
    made, here = meta.get("build") or {}, build_info()
    differ = [
        f"{k} {made[k]} (here {here[k]})"
        for k in ("torch", "cpu_capability")
        if made.get(k, here[k]) != here[k]
    ]
    if differ:
        log.warning(
            "checkpoint %s was made under %s: retraining it here would not give the same bits",
            path.name,
            ", ".join(differ),
        )


def save_checkpoint(dest: Path, model: GPT, meta: dict[str, Any]) -> None:
    """Write into a temp folder beside dest, then rename it into place (readers never see half)."""
    tmp = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        save_model(model, str(tmp / "model.safetensors"))
        meta = {**meta, "weights_sha256": file_sha256(tmp / "model.safetensors")}
        write_json(tmp / "meta.json", meta)
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    except Exception as e:
        raise_if_disk_full(e, dest / "model.safetensors")
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def cached_checkpoint(
    dest: Path,
    check: Callable[[dict[str, Any]], None],
    build: Callable[[], tuple[GPT, dict[str, Any]]],
    remake: str = "retraining it",
) -> Checkpoint:
    """The checkpoint folder `dest`: loaded when present, intact and accepted by `check(meta)` (which
    raises ValueError otherwise), else made by `build()` -> (model, meta) once, under a file lock (other
    processes wait and load it), and written atomically. An unusable one is made again with a warning
    that ends with `remake`."""

    def try_load() -> Checkpoint | None:
        if not dest.exists():
            return None
        try:
            model, meta = load_checkpoint(dest)
            check(meta)
            warn_if_other_build(dest, meta)
            return Checkpoint(dest, model, meta, cached=True)
        except ValueError as e:
            log.warning("%s; %s", e, remake)
            return None

    if (hit := try_load()) is not None:
        return hit
    dest.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(dest):
        if (hit := try_load()) is not None:  # another process made it while we waited
            return hit
        model, meta = build()
        save_checkpoint(dest, model, meta)
        return Checkpoint(dest, model.eval(), read_json(dest / "meta.json"), cached=False)


def get_checkpoint(cfg: Config, corpus: Corpus | None = None) -> Checkpoint:
    """The model for cfg: a trained one from the cache when present and intact, else trained (once); a
    GGUF file converted once (`gguf_checkpoint`); a Hugging Face checkpoint mapped at each load."""
    if is_gguf(cfg.model.name_or_path):
        return gguf_checkpoint(cfg)
    corpus = corpus or load_corpus(cfg.dataset, cfg.tokenizer, cfg.outputs, min_tokens=cfg.train.seq_len + 1)
    if cfg.model.name_or_path:  # a pretrained checkpoint: nothing to train
        return pretrained(cfg)
    cfg = replace(
        cfg, model=replace(cfg.model, vocab_size=corpus.tokenizer.vocab_size)
    )  # caller's cfg untouched
    key = checkpoint_key(cfg, corpus)

    def build() -> tuple[GPT, dict[str, Any]]:
        log.info("training %s (checkpoint key %s)", cfg.model.name, key)
        model, record = train_model(cfg, corpus)
        sink, layers = sink_metrics(model, corpus, cfg.train.seq_len, cfg.model.sink_token)
        last = layers[layers["metric"] == "last_query_first_mass"].sort_values("layer")["value"]
        record |= sink | {"last_query_first_mass": last.tolist()}
        meta = {
            "key": key,
            "model": to_jsonable(cfg.model),
            "tokenizer": corpus.tokenizer.spec,
            "dataset": to_jsonable(cfg.dataset),
            "data_hash": corpus.data_hash,
            "split_hashes": corpus.split_hashes,
            "train": to_jsonable(cfg.train),
            "seed": cfg.train.seed,
            **record,
            "git": git_info(),
            "packages": package_versions(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        return model, meta

    return cached_checkpoint(
        cfg.outputs / "checkpoints" / f"{cfg.model.name}-{key}", lambda m: check_settings(m, cfg, key), build
    )


def gguf_checkpoint(cfg: Config) -> Checkpoint:
    """A GGUF file (models/gguf.py) dequantised and converted into evictlab's checkpoint cache on first use,
    keyed by the file's sha256; later uses load the converted weights (float32; cast to model.dtype
    by the caller)."""
    from evictlab.models import gguf
    from evictlab.models.hf import config_from_hf, map_weights

    file = gguf.locate(cfg.model.name_or_path)
    key = stable_hash(
        {"gguf_sha256": file.sha256, "converter": gguf.CONVERTER_VERSION, "format": CHECKPOINT_FORMAT}
    )

    def check(meta: dict[str, Any]) -> None:
        if meta.get("key") != key:
            raise ValueError(f"checkpoint meta.json says key {meta.get('key')!r}, its folder {key!r}")

    def build() -> tuple[GPT, dict[str, Any]]:
        log.info("converting %s (sha256 %s...) into the checkpoint cache", file.path, file.sha256[:12])
        start = time.perf_counter()
        contents = gguf.read_contents(file)
        model_cfg = config_from_hf(contents.config, cfg.model.name)
        model = GPT(model_cfg)
        model.load_state_dict(map_weights("llama", contents.state_dict, model_cfg))
        meta = {
            "key": key,
            "source": "gguf",
            "label": contents.label,
            "model": to_jsonable(model_cfg),
            "hf_config": contents.config,
            **gguf.describe(file),
            "build": build_info(),
            "params": model.num_params(),
            "val_bpb": None,
            "convert_s": time.perf_counter() - start,
            "git": git_info(),
            "packages": package_versions(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        return model, meta

    dest = cfg.outputs / "checkpoints" / f"{cfg.model.name}-{key}"
    return cached_checkpoint(dest, check, build, remake="converting it again")


def pretrained(cfg: Config) -> Checkpoint:
    """A Hugging Face checkpoint mapped onto evictlab's GPT (models/hf.py)."""
    from evictlab.models.hf import load_hf_model

    model, info = load_hf_model(cfg.model.name_or_path, cfg.model.dtype)
    weights = Path(info["path"]) / "model.safetensors"  # (a sharded checkpoint has no single hash: None)
    meta = {
        "key": stable_hash(
            {"hf": cfg.model.name_or_path, "dtype": cfg.model.dtype, "format": CHECKPOINT_FORMAT}
        ),
        "source": "hf",
        "model": to_jsonable(model.cfg),
        "model_type": info["model_type"],
        "weights_sha256": file_sha256(weights) if weights.is_file() else None,
        "params": model.num_params(),
        "val_bpb": None,
    }
    return Checkpoint(Path(info["path"]), model, meta, cached=True)


def summary(ck: Checkpoint, seconds: float) -> str:
    m = ck.meta
    if m.get("source") == "gguf":
        how = f"loaded in {seconds:.2f} s" if ck.cached else f"converted in {m['convert_s']:.0f} s"
        return f"{m['label']} ({m['params']:,} params) {how}\n  -> {ck.path}"
    if m.get("source") == "hf":
        return (
            f"{m['model_type']} checkpoint ({m['params']:,} params) loaded in {seconds:.2f} s\n  -> {ck.path}"
        )
    how = f"loaded from cache in {seconds:.2f} s" if ck.cached else f"trained in {m['wall_s']:.0f} s"
    base = m["baselines"]
    return (
        f"{m['model']['name']} ({m['params']:,} params) {how}: val {m['val_bpb']:.3f} bits/byte "
        f"(unigram {base['unigram_val_bpb']:.3f}, bigram {base['bigram_val_bpb']:.3f}), "
        f"{m['tokens_per_s']:,.0f} train tok/s"
        + (f" = {100 * m['floor_fraction']:.2g}% of the FLOP floor" if m.get("floor_fraction") else "")
        + f"\n  -> {ck.path}"
    )


def main() -> None:
    def job(cfg: Config) -> str:
        start = time.perf_counter()
        ck = get_checkpoint(cfg)
        return summary(ck, time.perf_counter() - start)

    hydra_entry(job)


if __name__ == "__main__":
    main()
