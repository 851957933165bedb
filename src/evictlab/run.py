"""One evaluation run: a trained model streamed under one policy at one budget, with one seed.

    python -m evictlab.run strategy=h2o budget=b128 model=gpt_small
    python -m evictlab.run -m +experiment=default hydra/launcher=local     # a sweep (make sweep)

A run lives in ``outputs/runs/<group>/<strategy>-<budget>-<key>/``; the key hashes the resolved config
minus paths and logging. Files: ``config.yaml``, ``run_info.json``, ``per_token.parquet`` and, last and
atomically, ``metrics.json`` with ``status`` ok or failed. A run whose metrics.json says ok is skipped.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from filelock import FileLock

from evictlab.config import Config, to_objects
from evictlab.data.dataset import load_corpus
from evictlab.data.recall import recall_streams
from evictlab.errors import ConfigError
from evictlab.eval.evaluate import eval_streams, evaluate, greedy_divergence, recall_accuracy
from evictlab.perf import set_threads
from evictlab.store import (
    git_info,
    package_versions,
    read_json,
    stable_hash,
    to_jsonable,
    write_atomic,
    write_json,
)
from evictlab.train import drop_neutral, get_checkpoint

log = logging.getLogger(__name__)
RUN_FORMAT = 2  # 2: the full cache reports budget = scored stream length
# Config that cannot change a run's numbers (where and how it is logged or shown) stays out of the key.
NON_RESULT_KEYS = ("paths", "logger", "group", "skip_invalid")


def run_key(cfg: Config) -> str:
    d = to_jsonable(cfg)
    for k in NON_RESULT_KEYS:
        d.pop(k)
    for k in ("threads", "progress", "device", "batch_size"):
        d["eval"].pop(k)
    for k in ("threads", "progress", "device"):
        d["train"].pop(k)
    d["train"] = drop_neutral(d["train"])  # as in the checkpoint key: older run keys stay valid
    if not cfg.strategy.build().evicts:  # the full cache ignores the budget: one run serves them all
        d.pop("budget")
    return stable_hash({"config": d, "format": RUN_FORMAT})


def run_dir(cfg: Config, key: str | None = None) -> Path:
    key = key or run_key(cfg)
    budget = "all" if not cfg.strategy.build().evicts else cfg.budget.name
    return cfg.outputs / "runs" / cfg.group / f"{cfg.strategy.name}-{budget}-{key}"


def is_done(path: Path) -> bool:
    try:
        return read_json(path / "metrics.json").get("status") == "ok"
    except (OSError, ValueError):
        return False


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def run_info(cfg: Config) -> dict[str, Any]:
    from hydra.core.hydra_config import HydraConfig

    job = None
    if HydraConfig.initialized():
        hc = HydraConfig.get()
        job = {"num": hc.job.get("num"), "override_dirname": hc.job.override_dirname}
    return {
        "git": git_info(),
        "packages": package_versions(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_array_task_id": os.environ.get("SLURM_ARRAY_TASK_ID"),
        "hydra_job": job,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "torch_threads": torch.get_num_threads(),
        "device": cfg.eval.device,
    }


def per_token_frame(per_token: dict[str, np.ndarray]) -> pd.DataFrame:
    """Long format: one row per (stream, predicted position) with every per-token metric."""
    N, n = per_token["nll"].shape
    cols: dict[str, np.ndarray] = {
        "stream": np.repeat(np.arange(N), n),
        "position": np.tile(np.arange(1, n + 1), N),  # position of the predicted token in the stream
    }
    for name, arr in per_token.items():
        if arr.ndim == 2:
            cols[name] = arr.reshape(-1)
        else:  # [N, n, L] per layer
            cols[f"{name}_mean"] = arr.mean(-1).reshape(-1)
            for layer in range(arr.shape[-1]):
                cols[f"{name}_l{layer}"] = arr[..., layer].reshape(-1)
    return pd.DataFrame(cols)


def run(cfg: Config) -> dict[str, Any]:
    """Evaluate one configuration; returns its metrics. Skips work whose metrics.json says ok."""
    key = run_key(cfg)
    out = run_dir(cfg, key)
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if is_done(out):
            log.info("already done: %s", out)
            return {**read_json(out / "metrics.json"), "skipped": True}
        out.mkdir(exist_ok=True)
        (out / "metrics.json").unlink(missing_ok=True)  # a stale failed record goes; a new one comes last
        from omegaconf import OmegaConf

        yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
        write_atomic(out / "config.yaml", lambda p: p.write_text(yaml))
        write_json(out / "run_info.json", run_info(cfg))
        start = time.perf_counter()
        try:
            metrics = _evaluate(cfg, key, out)
            metrics["wall_s"] = time.perf_counter() - start
        except BaseException as e:
            write_json(
                out / "metrics.json",
                {
                    "status": "failed",
                    "run_key": key,
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc(),
                    "wall_s": time.perf_counter() - start,
                },  # fmt: skip
            )
            raise
        write_json(out / "metrics.json", metrics)
        return metrics


def _evaluate(cfg: Config, key: str, out: Path) -> dict[str, Any]:
    from evictlab import tracking

    seed_everything(cfg.seed)
    corpus = load_corpus(cfg.dataset, cfg.tokenizer, cfg.outputs, min_tokens=cfg.train.seq_len + 1)
    ck = get_checkpoint(cfg, corpus)
    if not ck.cached:
        tracking.log_training(cfg, ck.meta, ck.path)
    set_threads(cfg.eval.threads)
    seed_everything(cfg.seed)
    device = torch.device(cfg.eval.device)
    model = ck.model.to(device=device, dtype=getattr(torch, cfg.model.dtype)).eval()
    mc = model.cfg
    if mc.pos_emb.value == "learned" and cfg.eval.stream_len > mc.block_size:
        raise ConfigError(f"eval.stream_len={cfg.eval.stream_len} is longer than the model's learned "
                          f"position table ({mc.block_size})")  # fmt: skip
    if mc.pos_emb.value == "learned" and cfg.eval.position_mode.value == "cache":
        raise ConfigError(
            "eval.position_mode=cache needs RoPE; this checkpoint has learned absolute positions"
        )
    recall = None
    if cfg.eval.task.value == "recall":
        recall = recall_streams(corpus, cfg.eval.recall_per_depth, cfg.eval.stream_len, cfg.model.sink_token,
                                tuple(cfg.eval.recall_depths), cfg.seed, cfg.eval.split)  # fmt: skip
        tokens = recall.tokens.to(device)
    else:
        tokens = eval_streams(corpus, cfg.eval.n_streams, cfg.eval.stream_len, cfg.model.sink_token,
                              cfg.eval.stream_source, cfg.eval.split, seed=cfg.seed).to(device)  # fmt: skip
    policy = cfg.strategy.build()
    res = evaluate(
        model, tokens, policy, cfg.resolved_budget,
        position_mode=cfg.eval.position_mode, allocation=cfg.eval.allocation.value,
        batch_size=cfg.eval.batch_size, diagnostics=cfg.eval.diagnostics, force_loop=cfg.eval.force_loop,
        progress=cfg.eval.progress,
    )  # fmt: skip
    frame = per_token_frame(res.per_token)
    write_atomic(out / "per_token.parquet", lambda p: frame.to_parquet(p, index=False))
    if res.attention_by_key is not None:
        L, n = res.attention_by_key.shape
        attn = pd.DataFrame({"layer": np.repeat(np.arange(L), n), "key_position": np.tile(np.arange(n), L),
                             "attention": res.attention_by_key.reshape(-1)})  # fmt: skip
        write_atomic(out / "attention.parquet", lambda p: attn.to_parquet(p, index=False))
    metrics = {
        "status": "ok",
        "run_key": key,
        "run_format": RUN_FORMAT,
        "group": cfg.group,
        "model": cfg.model.name,
        "dataset": cfg.dataset.name,
        "budget_name": cfg.budget.name,
        "seed": cfg.seed,
        "variant": cfg.variant,
        "n_layer": mc.n_layer,
        "n_head": mc.n_head,
        "checkpoint": ck.path.name,
        "train_wall_s": ck.meta.get("wall_s"),
        "checkpoint_val_bpb": ck.meta.get("val_bpb"),
        **res.summary,
    }
    if recall is not None:
        rec = recall_accuracy(model, recall, policy, cfg.resolved_budget,
                              position_mode=cfg.eval.position_mode, allocation=cfg.eval.allocation.value,
                              batch_size=cfg.eval.batch_size, result=res)  # fmt: skip
        write_atomic(out / "recall.parquet", lambda p: rec.to_parquet(p, index=False))
        by_depth = rec.groupby("depth")
        metrics |= {
            "recall_depths": [float(d) for d in by_depth.groups],
            "recall_token_accuracy": float(rec["token_accuracy"].mean()),
            "recall_exact_teacher_forced": float(rec["exact_teacher_forced"].mean()),
            "recall_exact_teacher_forced_by_depth": by_depth["exact_teacher_forced"].mean().tolist(),
        }
        if "exact_greedy" in rec:
            metrics |= {
                "recall_exact_greedy": float(rec["exact_greedy"].mean()),
                "recall_exact_greedy_by_depth": by_depth["exact_greedy"].mean().tolist(),
            }
    generations = None
    if cfg.eval.generate_tokens and not policy.needs_future:  # the oracle cannot generate (no future)
        g = greedy_divergence(
            model, tokens, policy, cfg.resolved_budget, cfg.eval.generate_tokens,
            position_mode=cfg.eval.position_mode, allocation=cfg.eval.allocation.value,
            batch_size=cfg.eval.batch_size,
        )  # fmt: skip
        decode = corpus.tokenizer.decode
        generations = pd.DataFrame({
            "stream": np.arange(len(g["agreement"])), "first_divergence": g["first_divergence"],
            "agreement": g["agreement"], "text_full": [decode(r) for r in g["full_tokens"]],
            "text_policy": [decode(r) for r in g["policy_tokens"]],
        })  # fmt: skip
        write_atomic(out / "generations.parquet", lambda p: generations.to_parquet(p, index=False))
        metrics |= {
            "generate_tokens": cfg.eval.generate_tokens,
            "gen_first_divergence_mean": float(g["first_divergence"].mean()),
            "gen_agreement": float(g["agreement"].mean()),
        }
    curve = frame.groupby("position", as_index=False)[
        ["nll", *(["nll_full"] if "nll_full" in frame else [])]
    ].mean()
    tracking.log_eval(cfg, key, to_jsonable(cfg), metrics, curve, generations)
    return metrics


def summary_line(m: dict[str, Any]) -> str:
    head = f"{m['strategy_label']} budget={m['budget']} seed={m['seed']} {m['position_mode']}"
    if m.get("skipped"):
        return f"{head}: already done (ppl {m['ppl']:.3f})"
    extra = f", KL {m['kl_mean']:.4f}, top-1 agreement {m['agreement']:.3f}" if "kl_mean" in m else ""
    return f"{head}: ppl {m['ppl']:.3f} (full {m.get('ppl_full', float('nan')):.3f}){extra} [{m['path']}]"


def main() -> None:
    import hydra
    from omegaconf import DictConfig

    from evictlab.config import CONF_DIR

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
    def _main(dcfg: DictConfig) -> None:
        try:
            cfg = to_objects(dcfg)
        except ConfigError as e:
            if dcfg.get("skip_invalid"):  # a grid that crosses e.g. learned positions with cache mode
                print(f"skipped (not a valid combination): {e}", file=sys.stderr)
                return
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        try:
            metrics = run(cfg)
        except ConfigError as e:  # data-dependent checks (e.g. streams longer than the documents)
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        print(summary_line(metrics))

    _main()


if __name__ == "__main__":
    main()
