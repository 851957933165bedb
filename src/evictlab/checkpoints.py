"""The checkpoint store: trained, converted and imported models under outputs/checkpoints/<name>-<key>/.

A checkpoint folder holds `model.safetensors` and `meta.json` (its key, the model and training settings,
the weights' sha256, provenance). `cached_checkpoint` loads one when present, intact and what its key says,
else makes it once under a file lock (other processes wait and load it) and writes it atomically; a damaged
one is made again with a warning. `get_checkpoint` is the one door: the model a config names, loaded from
the store, or made once on a miss (trained by train.py, converted from a GGUF file, mapped from a Hugging
Face folder), with the subject's facts a trained one carries in its meta (its sink metrics, eval/sinks.py).
`python -m evictlab.train` is this module's `main`.
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model

from evictlab import train
from evictlab.cli import hydra_entry
from evictlab.config import Config, TrainConfig, key_dict
from evictlab.data.dataset import Corpus, load_corpus
from evictlab.eval.sinks import sink_metrics
from evictlab.models.gguf import is_gguf
from evictlab.models.gpt import GPT, GPTConfig
from evictlab.perf import build_info
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
        with torch.device("meta"):  # no random init (1.8 s on SmolLM2): every weight comes from the file
            model = GPT(GPTConfig(**meta["model"]))
        model.to_empty(device="cpu")
        if model.cfg.tie_embeddings:  # to_empty gave the head its own tensor
            model.lm_head.weight = model.wte.weight
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


def provenance() -> dict[str, Any]:
    """What every made checkpoint's meta says about where it was made: commit, packages, time."""
    return {
        "git": git_info(),
        "packages": package_versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


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
            **provenance(),
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


# ------------------------------------------------------------------------------ the one door


def get_checkpoint(cfg: Config, corpus: Corpus | None = None) -> Checkpoint:
    """The model for cfg: a trained one from the store when present and intact, else trained (once, resuming
    saved progress); a GGUF file converted once (`gguf_checkpoint`); a Hugging Face checkpoint mapped at
    each load (`pretrained`)."""
    if is_gguf(cfg.model.name_or_path):
        return gguf_checkpoint(cfg)
    corpus = corpus or load_corpus(cfg.dataset, cfg.tokenizer, cfg.outputs, min_tokens=cfg.corpus_min_tokens)
    if cfg.model.name_or_path:  # a pretrained checkpoint: nothing to train
        return pretrained(cfg)
    cfg = replace(cfg, model=replace(cfg.model, vocab_size=corpus.tokenizer.vocab_size))  # caller's untouched
    key = checkpoint_key(cfg, corpus)
    dest = cfg.outputs / "checkpoints" / f"{cfg.model.name}-{key}"
    progress = train.Progress(dest.parent / ".progress" / f"{dest.name}.pt", key)

    def build() -> tuple[GPT, dict[str, Any]]:
        log.info("training %s (checkpoint key %s)", cfg.model.name, key)
        model, record = train.train_model(cfg, corpus, progress)
        return model, {**trained_meta(cfg, corpus, key), **record, **subject_facts(model, cfg, corpus)}

    ck = cached_checkpoint(dest, lambda m: check_settings(m, cfg, key), build)
    if not ck.cached:
        progress.discard()  # only once the checkpoint is written: a crash before resumes from it
    return ck


def trained_meta(cfg: Config, corpus: Corpus, key: str) -> dict[str, Any]:
    """What a trained checkpoint's meta says about its making: key, settings, data, provenance."""
    return {
        "key": key,
        "model": to_jsonable(cfg.model),
        "tokenizer": corpus.tokenizer.spec,
        "dataset": to_jsonable(cfg.dataset),
        "data_hash": corpus.data_hash,
        "split_hashes": corpus.split_hashes,
        "train": to_jsonable(cfg.train),
        "seed": cfg.train.seed,
        **provenance(),
    }


def subject_facts(model: GPT, cfg: Config, corpus: Corpus) -> dict[str, Any]:
    """The facts a trained subject carries in its meta: Gu et al.'s sink metrics over held-out windows of the
    training length, and the last query's attention on position 0 per layer (eval/sinks.py)."""
    sink, layers = sink_metrics(model, corpus, cfg.train.seq_len, cfg.model.sink_token)
    last = layers[layers["metric"] == "last_query_first_mass"].sort_values("layer")["value"]
    return sink | {"last_query_first_mass": last.tolist()}


def summary(ck: Checkpoint, seconds: float) -> str:
    """One line about the checkpoint a `python -m evictlab.train` made or loaded, and its folder."""
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
    """`python -m evictlab.train [KEY=VALUE ...]`: the checkpoint for a config, made once."""

    def job(cfg: Config) -> str:
        start = time.perf_counter()
        ck = get_checkpoint(cfg)
        return summary(ck, time.perf_counter() - start)

    hydra_entry(job)
