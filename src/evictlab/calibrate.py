"""Which long-context tasks a model can do at all: the full cache's written-answer score per task and context.

    python -m evictlab.calibrate --out experiments/smollm2_tasks/calibration.csv \\
        --tasks niah_multikey niah_multivalue --lengths 2048 4096 --samples 50 \\
        model=smollm2_135m dataset=man_pinned

A task enters an eviction experiment only where the full cache answers it (issue 49: >= 50% exact): below
that, a policy's "loss" is noise around a model that cannot do the task. Only the full cache runs and only
its written answers are scored (greedy decoding from the prompt, the prompt on the blocked path: one pass
per sample; an eviction run also teacher-forces the stream for its per-token tables). One row per task x
context in the CSV: exact-match share with its Wilson 95% interval, mean partial credit, n, and what makes
it reproducible (commit, weights and streams sha256, seed); each sample's written answer beside it in
`<out stem>_answers.parquet`. Rows already in the CSV are kept and not re-run (a crash loses at most the
row in progress); delete a row to redo it.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import pandas as pd

log = logging.getLogger("evictlab.calibrate")

KEY = ["task", "context"]


def calibrate_one(model, corpus, cfg, task: str, length: int, samples: int, batch: int) -> pd.DataFrame:
    """Each sample's written answer under the full cache and its grades: one row per sample."""
    from dataclasses import replace

    from evictlab.cache.policies import full_cache
    from evictlab.data.tasks import task_streams
    from evictlab.eval.evaluate import greedy_answers, task_decode_len

    e = cfg.eval
    tb = task_streams(corpus, task, samples, length, cfg.model.sink_token, e.task_template, cfg.seed, e.split)
    spec = replace(e.spec(), batch_size=batch)
    written = greedy_answers(model, tb, full_cache(), length, spec, task_decode_len)
    text = [corpus.tokenizer.decode(w.tolist()) for w in written]
    graded = [tb.task.score(p, t) for p, t in zip(tb.problems, text, strict=True)]
    from evictlab.store import tokens_sha256

    return pd.DataFrame(
        {
            "task": task,
            "context": length,
            "sample": range(samples),
            "reference": [p.answer for p in tb.problems],
            "written": text,
            "exact": [g[0] for g in graded],
            "partial": [g[1] for g in graded],
            "streams_sha256": tokens_sha256(tb.tokens),
        }
    )


def summary_row(answers: pd.DataFrame) -> dict:
    from evictlab.analysis.stats import wilson_ci

    n, k = len(answers), int(answers["exact"].sum())
    share, lo, hi = wilson_ci(k, n)
    return {
        "n": n,
        "exact": k,
        "exact_share": round(share, 4),
        "ci_low": round(lo, 4),
        "ci_high": round(hi, 4),
        "partial": round(float(answers["partial"].mean()), 4),
        "passes": share >= 0.5,
        "streams_sha256": answers["streams_sha256"].iloc[0],
    }


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m evictlab.calibrate", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the summary CSV (appended to, resumable)")
    ap.add_argument("--tasks", nargs="+", default=None, help="task names (default: every registered task)")
    ap.add_argument("--lengths", nargs="+", type=int, default=[2048], help="context lengths in tokens")
    ap.add_argument("--samples", type=int, default=50, help="samples per task and context")
    ap.add_argument("--batch", type=int, default=10, help="samples decoded together")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides (model=..., dataset=..., eval.threads=...)")
    args = ap.parse_args(argv)
    if args.samples < 1 or args.batch < 1:
        ap.error("--samples and --batch must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s] %(message)s")
    args = _parse(sys.argv[1:] if argv is None else argv)
    from evictlab.config import compose, to_objects
    from evictlab.data.tasks import TASKS
    from evictlab.errors import ConfigError
    from evictlab.run import RunStages, run_key
    from evictlab.store import git_info, write_atomic

    cfg = to_objects(compose(["eval.task_template=chatml", *args.overrides]))
    tasks = args.tasks or sorted(TASKS)
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        raise ConfigError(f"unknown task(s) {unknown}; known: {sorted(TASKS)}")
    corpus, ck, model = RunStages(cfg, run_key(cfg), Path(".")).subject()  # as a run loads its subject
    done = pd.read_csv(args.out) if args.out.exists() else None
    answers_path = args.out.with_name(args.out.stem + "_answers.parquet")
    answers = pd.read_parquet(answers_path) if answers_path.exists() else pd.DataFrame()
    version = git_info()
    for task in tasks:
        for length in args.lengths:
            if done is not None and ((done["task"] == task) & (done["context"] == length)).any():
                log.info("%s at %d: in %s already, kept", task, length, args.out)
                continue
            t0 = time.perf_counter()
            rows = calibrate_one(model, corpus, cfg, task, length, args.samples, args.batch)
            row = {"task": task, "context": length, **summary_row(rows)}
            row |= {
                "template": cfg.eval.task_template,
                "model": cfg.model.name,
                "dataset": cfg.dataset.name,
                "seed": cfg.seed,
                "weights_sha256": ck.meta.get("weights_sha256"),
                "commit": version["commit"],
                "dirty": version["dirty"],
                "seconds": round(time.perf_counter() - t0, 1),
            }
            log.info("%s at %d: %d/%d exact, %.1f s", task, length, row["exact"], row["n"], row["seconds"])
            done = pd.concat([d for d in (done, pd.DataFrame([row])) if d is not None], ignore_index=True)
            answers = pd.concat([answers, rows], ignore_index=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(answers_path, answers.to_parquet)
            write_atomic(args.out, lambda p, d=done: d.to_csv(p, index=False))
    if done is not None:
        print(done.to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
