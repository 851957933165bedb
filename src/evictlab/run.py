"""One evaluation run: a trained model streamed under one policy at one budget, with one seed.

    python -m evictlab.run strategy=h2o budget=b128 model=gpt_small
    python -m evictlab.run -m +experiment=default hydra/launcher=local     # a sweep (make sweep)

A run lives in ``outputs/runs/<group>/<strategy>-<budget>-<key>/``; the key hashes the resolved config
minus the settings that cannot change a result (config.py: KEYLESS). Its files are listed in
evictlab/results.py; ``metrics.json`` comes last and atomically, with ``status`` ok or failed. A run
whose metrics.json says ok in the current run format is skipped.
"""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import socket
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from evictlab import results as R
from evictlab.checkpoints import Checkpoint, get_checkpoint
from evictlab.cli import hydra_entry
from evictlab.config import Config
from evictlab.data.dataset import Corpus, load_corpus
from evictlab.data.recall import RecallBatch, recall_streams
from evictlab.data.streams import eval_streams
from evictlab.data.tasks import TASKS, TaskBatch, task_streams
from evictlab.errors import DivergedError
from evictlab.eval.engine import Answers, DecodeClock
from evictlab.eval.evaluate import (
    EvalResult,
    evaluate,
    greedy_divergence,
    recall_accuracy,
    task_accuracy,
    task_answers,
)
from evictlab.eval.shared import SharedReferences
from evictlab.eval.sinks import PRETRAINED_CONTEXT, cached_sink_metrics
from evictlab.eval.spec import check_positions
from evictlab.identity import is_done, run_dir, run_key
from evictlab.models.gpt import GPT
from evictlab.perf import build_info, reset_peak_rss, set_threads
from evictlab.store import (
    file_lock,
    git_info,
    package_versions,
    read_json,
    tokens_sha256,
    write_atomic,
    write_json,
)

log = logging.getLogger(__name__)


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
        **build_info(),  # torch_threads: eval.threads, applied before this is written
        "device": cfg.eval.device,
    }


class Terminated(BaseException):
    """SIGTERM arrived (what SLURM sends a job before it kills it, what `kill` sends by default): the run
    stops where it is and is recorded as failed, so nothing half-done counts as done and a rerun redoes it."""


@contextmanager
def sigterm_stops_the_run() -> Iterator[None]:
    """While the block runs, SIGTERM raises Terminated (the caller's handler is restored after); outside the
    main thread signals cannot be handled and this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Terminated(f"terminated by {signal.Signals(signum).name} before the run finished")

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def run(cfg: Config) -> dict[str, Any]:
    """Evaluate one configuration; returns its metrics. Skips work whose metrics.json says ok."""
    key = run_key(cfg)
    out = run_dir(cfg, key)
    out.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(out):
        if is_done(out):
            log.info("already done: %s", out)
            return {**read_json(out / R.METRICS), "skipped": True}
        out.mkdir(exist_ok=True)
        (out / R.METRICS).unlink(missing_ok=True)  # a stale failed record goes; a new one comes last
        from omegaconf import OmegaConf

        yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
        write_atomic(out / R.CONFIG, lambda p: p.write_text(yaml))
        set_threads(cfg.eval.threads)
        write_json(out / R.RUN_INFO, run_info(cfg))
        start = time.perf_counter()
        try:
            with sigterm_stops_the_run():
                metrics = RunStages(cfg, key, out).run()
        except BaseException as e:
            failure = {"status": "failed", "run_key": key, "error": f"{type(e).__name__}: {e}"}
            write_json(
                out / R.METRICS,
                failure | {"traceback": traceback.format_exc(), "wall_s": time.perf_counter() - start},
            )
            raise
        metrics["wall_s"] = time.perf_counter() - start
        write_json(out / R.METRICS, metrics)
        return metrics


class StageClock:
    """Wall seconds of each stage of a run, recorded as `time_<stage>_s` in metrics.json (what a run costs
    beyond its compute: benchmarks/run_overhead.py)."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[stage] = time.perf_counter() - start

    def seconds(self) -> dict[str, float]:
        return {f"time_{stage}_s": s for stage, s in self.times.items()}


def _write_table(path: Path, frame: pd.DataFrame) -> None:
    write_atomic(path, lambda p: frame.to_parquet(p, index=False))


def reference_checkpoint(ck) -> str:
    """The checkpoint as the reference and subject stores name it: its folder and weights hash."""
    return f"{ck.path.name}:{ck.meta.get('weights_sha256', '')}"


@dataclass
class RunStages:
    """The stages of one run, in order: subject, streams, evaluation, its files, task metrics, tracking."""

    cfg: Config
    key: str
    out: Path

    def run(self) -> dict[str, Any]:
        reset_peak_rss()  # this run's peak, not an earlier run's in the same worker process
        clock = StageClock()
        with clock("subject"):  # corpus and checkpoint (loaded, or trained once)
            corpus, ck, model = self.subject()
        with clock("streams"):
            tokens, answers, documents = self.streams(corpus, model)
        self.record(model, documents)
        policy, budget, spec = self.cfg.strategy.build(), self.cfg.resolved_budget, self.cfg.eval.spec()
        checkpoint = reference_checkpoint(ck)
        shared = self.shared_references(ck)
        decoding = DecodeClock(fused=True)  # weight-free policies: the fused kernel's rate too
        writing = self.writing(tokens, answers, policy, decoding)
        with clock("evaluate"):  # (answers and continuations are written in the same pass: the answer path)
            res = evaluate(model, tokens, policy, budget, spec, shared, writing)
        if not math.isfinite(res.summary["ppl"]):
            bad = int((~np.isfinite(res.per_token["nll"])).sum())
            ppl = res.summary["ppl"]
            raise DivergedError(f"the evaluation's NLL is not finite at {bad} positions (ppl {ppl})")
        with clock("sink"):
            sink, sink_layers = self.sink(model, corpus, checkpoint)
        res.layers = pd.concat([res.layers, sink_layers], ignore_index=True)
        with clock("files"):
            curve = self.write_results(res)
        metrics = (
            self.identity(ck)
            | {"streams_sha256": tokens_sha256(tokens)}
            | res.summary
            | sink
            | {"full_reference_shared": shared.read if shared else 0}
        )
        with clock("tasks"):
            if isinstance(answers, RecallBatch):
                rec = recall_accuracy(model, answers, policy, budget, spec, res, self.cfg.eval.recall_greedy)
                metrics |= self.recall_metrics(rec)
            elif isinstance(answers, TaskBatch):
                decode = corpus.tokenizer.decode
                graded = task_accuracy(model, answers, policy, budget, spec, res, decode, decoding)
                metrics |= self.task_metrics(graded, decoding)
            generations = None
            if self.cfg.eval.generate_tokens and policy.can_generate():
                ours = res.written if answers is None else None  # (a task's answers are not continuations)
                generations, extra = self.generation(model, tokens, corpus, shared, ours)
                metrics |= extra | self.decode_metrics(decoding)
        with clock("tracking"):
            self.track(metrics | clock.seconds(), curve, generations)
        return metrics | clock.seconds()

    def writing(self, tokens: torch.Tensor, answers, policy, decoding: DecodeClock) -> Answers | None:
        """What the evaluation writes on the way (the answer path): a task's answers, or with
        eval.generate_tokens the policy's greedy continuation of each stream's first T - n tokens."""
        if isinstance(answers, TaskBatch):
            return task_answers(answers, decoding)
        n_new = self.cfg.eval.generate_tokens
        if n_new and answers is None and policy.can_generate():
            return Answers(tokens.shape[1] - n_new, n_new, decoding)
        return None

    def record(self, model: GPT, documents: list[str]) -> None:
        """run_info.json's `model_config`: the shape of the model that ran, as loaded (an imported
        checkpoint brings its own; config.yaml's model fields are the small GPT's, unused then); and
        `stream_documents`: the documents each stream's text comes from (TokenSplit.documents_in)."""
        from evictlab.store import to_jsonable

        path = self.out / R.RUN_INFO
        if path.exists():
            extra = {"model_config": to_jsonable(model.cfg), "stream_documents": documents}
            write_json(path, read_json(path) | extra)

    def subject(self) -> tuple[Corpus, Checkpoint, GPT]:
        """The corpus and the model (trained or loaded from the cache), on the evaluation device."""
        cfg = self.cfg
        seed_everything(cfg.seed)
        corpus = load_corpus(cfg.dataset, cfg.tokenizer, cfg.outputs, min_tokens=cfg.corpus_min_tokens)
        ck = get_checkpoint(cfg, corpus)
        if not ck.cached:
            from evictlab import tracking

            tracking.log_training(cfg, ck.meta, ck.path)
        set_threads(cfg.eval.threads)
        seed_everything(cfg.seed)
        model = ck.model.to(
            device=torch.device(cfg.eval.device), dtype=getattr(torch, cfg.model.dtype)
        ).eval()
        check_positions(model.cfg, cfg.eval.position_mode, cfg.eval.stream_len)  # the checkpoint's own model
        return corpus, ck, model

    def shared_references(self, ck, keep_attention: bool = True) -> SharedReferences | None:
        """The full cache's log-probs on this run's streams: computed by a sweep's first run, read by the rest
        (None with eval.share_reference=false; `keep_attention`: `SharedReferences`')."""
        if not self.cfg.eval.share_reference:
            return None
        root = self.cfg.outputs / "cache" / "references"
        return SharedReferences(root, reference_checkpoint(ck), keep_attention)

    def streams(
        self, corpus: Corpus, model: GPT
    ) -> tuple[torch.Tensor, RecallBatch | TaskBatch | None, list[str]]:
        """The evaluation token streams [N, T] (and the answer batch they come from, for task=recall and the
        data/tasks tasks), and the documents each one's text comes from."""
        e, device = self.cfg.eval, next(model.parameters()).device
        if e.task.value in TASKS:
            batch = task_streams(
                corpus,
                e.task.value,
                e.n_streams,
                e.stream_len,
                self.cfg.model.sink_token,
                e.task_template,
                self.cfg.seed,
                e.split,
            )
            return batch.tokens.to(device), batch, batch.documents
        if e.task.value == "recall":
            recall = recall_streams(
                corpus,
                e.recall_per_depth,
                e.stream_len,
                self.cfg.model.sink_token,
                tuple(e.recall_depths),
                self.cfg.seed,
                e.split,
            )
            return recall.tokens.to(device), recall, recall.documents
        tokens, documents = eval_streams(
            corpus,
            e.n_streams,
            e.stream_len,
            self.cfg.model.sink_token,
            e.stream_source,
            e.split,
            seed=self.cfg.seed,
            return_documents=True,
        )
        return tokens.to(device), None, documents

    def sink(self, model: GPT, corpus: Corpus, checkpoint: str):
        """The model's attention-sink metrics (eval/sinks.py) at its training context (a pretrained model's:
        PRETRAINED_CONTEXT or its own if shorter), measured by the first run of this checkpoint and corpus,
        read by the others."""
        cfg = self.cfg
        context = cfg.train.seq_len
        if cfg.model.name_or_path:
            context = min(PRETRAINED_CONTEXT, model.cfg.block_size)
        root = cfg.outputs / "cache" / "subject"
        return cached_sink_metrics(
            root, checkpoint, model, corpus, context, cfg.model.sink_token, cfg.eval.split
        )

    def write_results(self, res: EvalResult) -> pd.DataFrame:
        """The run's result files; returns the NLL-by-position curve (bounded in rows) for tracking."""
        write_atomic(self.out / R.PER_TOKEN, lambda p: R.write_per_token(p, res.per_token))
        _write_table(self.out / R.LAYERS, res.layers)
        if res.attention_by_key is not None:
            _write_table(self.out / R.ATTENTION, R.attention_frame(res.attention_by_key))
        return R.nll_curve(res.per_token)

    def identity(self, ck: Checkpoint) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "status": "ok",
            "run_key": self.key,
            "run_format": R.RUN_FORMAT,
            "group": cfg.group,
            "model": cfg.model.name,
            "dataset": cfg.dataset.name,
            "budget_name": cfg.budget.name,
            "seed": cfg.seed,
            "variant": cfg.variant,
            "checkpoint": ck.path.name,
            "weights_sha256": ck.meta.get("weights_sha256"),
            "train_wall_s": ck.meta.get("wall_s"),
            "checkpoint_val_bpb": ck.meta.get("val_bpb"),
        }

    def task_metrics(self, graded: pd.DataFrame, decoding: DecodeClock) -> dict[str, Any]:
        """tasks.parquet (one row per task stream) and the run's means: teacher-forced exact match and
        answer NLL, and where the policy wrote its answers, exact and partial credit and how fast it
        wrote them (decode token-steps/s through the token loop, the prompts' prefill seconds; for a
        policy that reads no attention weights, also through the fused kernel from the same caches, and
        the share of answers it wrote identically)."""
        _write_table(self.out / R.TASKS, graded)
        metrics = {
            "task_exact_teacher_forced": float(graded["exact_teacher_forced"].mean()),
            "task_answer_nll": float(graded["answer_nll"].mean()),
        }
        if "exact" in graded:
            metrics |= {
                "task_exact": float(graded["exact"].mean()),
                "task_partial": float(graded["partial"].mean()),
            } | self.decode_metrics(decoding)
        return metrics

    @staticmethod
    def decode_metrics(decoding: DecodeClock) -> dict[str, Any]:
        """How fast the run wrote (answers or continuations): decode token-steps/s through the token loop
        and the prompts' prefill seconds; for a policy that reads no attention weights also through the
        fused kernel from the same caches, and the share of rows it wrote identically."""
        if not decoding.decode_steps:
            return {}
        out = {"decode_token_steps_per_s": decoding.rate(), "prefill_s": decoding.prefill_s}
        if decoding.fused_rows:
            out["decode_token_steps_per_s_fused"] = decoding.fused_rate()
            out["fused_same_tokens"] = decoding.fused_same_rows / decoding.fused_rows
        return out

    def recall_metrics(self, rec: pd.DataFrame) -> dict[str, Any]:
        _write_table(self.out / R.RECALL, rec)
        metrics = {
            "recall_token_accuracy": float(rec["token_accuracy"].mean()),
            "recall_exact_teacher_forced": float(rec["exact_teacher_forced"].mean()),
        }
        if "exact_greedy" in rec:
            metrics["recall_exact_greedy"] = float(rec["exact_greedy"].mean())
        return metrics

    def generation(
        self, model: GPT, tokens: torch.Tensor, corpus: Corpus, shared: SharedReferences | None, written
    ):
        """Greedy continuations under the policy (`written` on the answer path, else decoded here) and the
        full cache (shared by a sweep's runs) -> (their table, metrics)."""
        cfg, n_new = self.cfg, self.cfg.eval.generate_tokens
        g = greedy_divergence(
            model, tokens, cfg.strategy.build(), cfg.resolved_budget, n_new, cfg.eval.spec(), shared, written
        )
        decode = corpus.tokenizer.decode
        full, ours = [decode(r) for r in g["full_tokens"]], [decode(r) for r in g["policy_tokens"]]
        table = pd.DataFrame(
            {
                "stream": np.arange(len(g["agreement"])),
                "first_divergence": g["first_divergence"],
                "agreement": g["agreement"],
                "rouge_l": rouge_l(ours, full),
                "text_full": full,
                "text_policy": ours,
            }
        )
        _write_table(self.out / R.GENERATIONS, table)
        return table, {
            "generate_tokens": n_new,
            "gen_first_divergence_mean": float(g["first_divergence"].mean()),
            "gen_agreement": float(g["agreement"].mean()),
            "gen_rouge_l": float(table["rouge_l"].mean()),
        }

    def track(self, metrics: dict[str, Any], curve: pd.DataFrame, generations) -> None:
        from evictlab import tracking
        from evictlab.store import to_jsonable

        tracking.log_eval(self.cfg, self.key, to_jsonable(self.cfg), metrics, curve, generations)


def rouge_l(texts: list[str], references: list[str]) -> list[float]:
    """ROUGE-L F1 of each text against its reference (Google's rouge-score: lower-cased alphanumeric words,
    longest common subsequence); 1 where the two are the same text (even one without words)."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"])
    return [
        1.0 if t == r else scorer.score(r, t)["rougeL"].fmeasure
        for t, r in zip(texts, references, strict=True)
    ]


def summary_line(m: dict[str, Any]) -> str:
    budget = m["budget"] if m.get("evicts", True) else "all"  # the full cache keeps every entry
    head = f"{m['strategy_label']} budget={budget} seed={m['seed']} {m['position_mode']}"
    if m.get("skipped"):
        return f"{head}: already done (ppl {m['ppl']:.3f})"
    extra = f", KL {m['kl_mean']:.4f}, top-1 agreement {m['agreement']:.3f}" if "kl_mean" in m else ""
    return f"{head}: ppl {m['ppl']:.3f} (full {m.get('ppl_full', float('nan')):.3f}){extra} [{m['path']}]"


def main() -> None:
    hydra_entry(lambda cfg: summary_line(run(cfg)))


if __name__ == "__main__":
    main()
