"""Does a committed snapshot still hold? Re-run a sample of its runs from their own configs and compare.

    python -m evictlab.paper verify --only smollm2_quality            # make verify EXP=smollm2_quality
    python -m evictlab.paper verify --only smollm2_quality --streams 2 --all

The sample: for each policy in the snapshot, and each value of any other setting its runs differ in besides
budget and positions (a policy parameter such as n_sink, an arm's BOS), one run: original positions where
the snapshot has them, at the budget nearest the middle of its budgets (the lower one on a tie); `--all`
takes every run. Each run's config is composed as the sweep composed it (`+experiment=<figures.yaml's
experiment>`, the run's strategy and budget, and the values of the other keys the snapshot's runs differ
in), and any other setting that differs from the snapshot's recorded config is printed. `--streams K`
streams the first K of the run's streams (the same tokens the snapshot's first K streams hold). The
attention diagnostics are left off (none of them is compared, and they are most of a large model's cost);
the sampled runs share one load of the model and one full-cache reference.

Compared, for each stream: the mean NLL of the policy and of the full cache, KL to the full cache (relative
tolerance REL_TOL), top-1 agreement with the full cache and top-1 accuracy (absolute tolerance ABS_TOL:
three tokens in a thousand may flip between two near-equal logits under another batch or build). A policy
that decides by values (H2O, TOVA, Scissorhands, L2Norm, random, the oracle: not position-only) also gets
DECISION_TOL x its snapshot NLL, in nats, on its NLL and KL: where two keys' scores differ by float rounding,
another CPU's matmul kernels can evict the other one, and the stream's numbers move by more than rounding.
Measured: TOVA at budget 64 on smollm2_quality's first stream, re-run on another machine than the
snapshot's (AVX2, a 1-thread 1024^3 matmul at 66 GFLOP/s against 111 where the snapshot was made): NLL
3.08651 -> 3.09040 (+0.0039 nats, 0.13%), KL +0.0036, agreement -0.002, while the full cache and the
position-only policies agreed within 1e-5. Where the experiment has measured its decision noise
(`make noise`: experiments/<name>/decision_noise.csv), such a run's tolerance on each metric is also at
least NOISE_FACTOR x the largest shift that rounding-level perturbations of the weights caused in it (on
smollm2_quality: L2Norm at budget 64 moved by up to 0.21% in NLL, so it is allowed 0.41%; another
machine moved its fifth stream by 0.34%). The exit status is 1 when any difference is beyond its
tolerance.

A task run (eval.task=<a data/tasks task>) or a pass-key run (eval.task=recall) is compared on the same
per-stream metrics over its streams, and on its answers: each answer's NLL (relative tolerance, as nll),
whether it was exact teacher-forced, and, for a task under a policy that writes, whether the written answer
is the snapshot's text (`written_match`) and exact (recall with eval.recall_greedy: exact_greedy). Every
stream is drawn and the first K kept, so `--streams K` re-runs the snapshot's first K problems, not K
other ones.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from evictlab import results as R

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from evictlab.checkpoints import Checkpoint
    from evictlab.data.recall import RecallBatch
    from evictlab.data.tasks import TaskBatch
    from evictlab.models.gpt import GPT

REL_TOL = 1e-3  # nll, nll_full, kl: |now - snapshot| <= REL_TOL * |snapshot| (+ 1e-6)
ABS_TOL = 3e-3  # agree, correct: shares of a stream's tokens
DECISION_TOL = 2e-3  # a value-deciding policy's NLL and KL: |now - snapshot| <= DECISION_TOL x snapshot NLL
RELATIVE = ("nll", "nll_full", "kl", "answer_nll")  # (answer_nll: task and recall runs)
ABSOLUTE = ("agree", "correct", "exact_teacher_forced", "exact", "exact_greedy", "written_match")  # answers
GROUP_KEYS = {"strategy.name": "strategy", "budget.name": "budget"}  # config groups: chosen by name
# the settings besides the policy that the sample takes one run of each value of: a policy's parameters
# and an arm (conf/arm/, BOS in the text); not budgets, positions, seeds or the trained subject's settings
ARM_KEYS = ("cfg.strategy.params.", "cfg.dataset.bos", "cfg.arm")


@dataclass
class Sampled:
    """One snapshot run to re-run: its identity and the overrides that compose its config."""

    run_key: str
    label: str
    overrides: list[str]
    recorded: dict  # its cfg.* values in the snapshot (flattened, without the prefix)
    recorded_weights: str | None  # the weights_sha256 it measured (snapshots before RUN_FORMAT 4: None)


def _value(v) -> str:
    if isinstance(v, enum.Enum):  # the composed config holds enums where the snapshot recorded their values
        v = v.value
    if isinstance(v, bool | np.bool_):
        return str(bool(v)).lower()
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def _middle_run(g: pd.DataFrame) -> pd.Series:
    """Of one policy's (or arm's) runs: original positions where there are any, the budget nearest the
    middle (the lower one on a tie)."""
    if (g["position_mode"] == "original").any():
        g = g[g["position_mode"] == "original"]
    budgets = sorted(g["budget"].unique())
    return g[g["budget"] == budgets[(len(budgets) - 1) // 2]].iloc[0]


def sample_runs(results: pd.DataFrame, experiment: str, every: bool = False) -> list[Sampled]:
    """The runs of a snapshot's results table to verify (the module docstring's rule), with overrides."""
    runs = results.drop_duplicates("run_key").reset_index(drop=True)
    cfg_cols = [c for c in runs if c.startswith("cfg.")]
    varying = [c for c in cfg_cols if runs[c].astype(str).nunique() > 1]
    # besides the policy, the settings its runs differ in other than budget and positions (a parameter, an
    # arm's BOS): one sampled run for each value (`arms`: per policy, the columns that vary among its runs)
    arms: dict[str, list[str]] = {}
    for name, g in runs.groupby("strategy", sort=False):
        arms[name] = [c for c in varying if c.startswith(ARM_KEYS) and g[c].astype(str).nunique() > 1]
    chosen = runs
    if not every:
        rows = []
        for name, g in runs.groupby("strategy", sort=False):
            for _, arm in g.groupby(arms[name], sort=False, dropna=False) if arms[name] else [(None, g)]:
                rows.append(_middle_run(arm))
        chosen = pd.DataFrame(rows)
    out = []
    for _, row in chosen.iterrows():
        # every config group's choice, varying or not: a sweep's grid (hydra.sweeper.params) is not part of
        # what compose reads, so a budget all of a snapshot's runs share would compose as the default one
        groups = [f"{group}={row['cfg.' + key]}" for key, group in GROUP_KEYS.items() if "cfg." + key in runs]
        overrides = [f"+experiment={experiment}", *groups]  # config groups first, then values inside them
        # an imported model (a GGUF or Hugging Face checkpoint) is never trained: its runs' train.* values
        # change no number (runs from before train.threads was checked recorded 0, no longer accepted)
        imported = isinstance(row.get("cfg.model.name_or_path"), str)
        for col in varying:
            key, v = col[4:], row[col]
            if key in GROUP_KEYS or v is None or (isinstance(v, float) and math.isnan(v)):
                continue
            if imported and key.startswith("train."):
                continue
            if not key.startswith(("strategy.", "budget.")) or key.startswith("strategy.params."):
                overrides.append(f"{key}={_value(v)}")
        arm = " ".join(f"{c.split('.')[-1]}={_value(row[c])}" for c in arms.get(row["strategy"], []))
        label = f"{row['strategy']} b{int(row['budget'])} {row['position_mode']}" + (f" {arm}" if arm else "")
        recorded = {c[4:]: row[c] for c in cfg_cols}
        weights = row.get("weights_sha256")
        weights = weights if isinstance(weights, str) else None
        out.append(Sampled(row["run_key"], label, overrides, recorded, weights))
    return out


def config_differences(cfg, recorded: dict) -> list[str]:
    """Settings of the composed config that differ from the snapshot's record (keys in no run key left
    out: paths, logger, threads and the like cannot change a number)."""
    from omegaconf import OmegaConf

    from evictlab.analysis.aggregate import flatten
    from evictlab.config import key_dict

    keyed = flatten(key_dict(cfg))
    now = flatten(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))
    diffs = []
    for key, value in now.items():
        if key not in keyed or key not in recorded:
            continue
        was = recorded[key]
        if isinstance(was, float) and math.isnan(was):
            continue
        if _value(was) != _value(value):
            diffs.append(f"{key}: snapshot {was!r}, now {value!r}")
    return diffs


def stream_means(per_token: dict[str, np.ndarray]) -> pd.DataFrame:
    """Per-stream means of the compared per-token metrics: the run's per-token frame (results.py) averaged
    by stream, as aggregation averages a run's per_token.parquet (NaN past the reference's cap skipped)."""
    compared = [name for name in (*RELATIVE, *ABSOLUTE) if name in per_token]
    frame = R.per_token_frame({name: per_token[name] for name in compared})
    return frame.groupby("stream")[compared].mean().reset_index()


ANSWERS = ("answer_nll", "exact_teacher_forced", "exact", "exact_greedy")  # a task's or recall's, per stream


def answer_checks(graded: pd.DataFrame, snapshot: pd.DataFrame | None, run_key: str) -> pd.DataFrame:
    """Per stream of a task or recall run, the answer metrics compared (`task_accuracy`'s or
    `recall_accuracy`'s frame re-run now): answer_nll, exact_teacher_forced and, where the policy wrote
    (a task) or decoded (recall with recall_greedy), exact or exact_greedy; for a task also written_match
    (1.0 where the written text is the snapshot's; the snapshot side of it is 1.0: `snapshot_answers`)."""
    out = graded[["stream"]].copy()
    for col in ANSWERS:
        if col in graded:
            out[col] = graded[col].astype(float)
    if "written" in graded:
        was = pd.Series(dtype=object)
        if snapshot is not None and "written" in snapshot:
            was = snapshot[snapshot["run_key"] == run_key].set_index("stream")["written"]
        same = [
            s in was.index and was[s] == w for s, w in zip(graded["stream"], graded["written"], strict=True)
        ]
        out["written_match"] = np.asarray(same, dtype=float)
    return out


def snapshot_answers(streams: pd.DataFrame, *answers: pd.DataFrame | None) -> pd.DataFrame:
    """The snapshot's streams table with its task or recall runs' answer metrics beside each stream (the
    tasks and recall tables: the side of `compare` that `answer_checks` is compared with)."""
    for table in answers:
        if table is None or table.empty:
            continue
        t = table[["run_key", "stream"]].copy()
        for col in ANSWERS:
            if col in table:
                t[col] = table[col].astype(float)
        if "written" in table:
            wrote = table["written"].notna()
            t["written_match"] = wrote.astype(float).where(wrote)
        streams = streams.merge(t, on=["run_key", "stream"], how="left")
    return streams


def decides(strategy: str) -> bool:
    """Whether a policy decides what to evict by values (scores that rounding can reorder), not by
    positions alone (the window with re-computation keeps no cache: its windows are positions too) nor by
    draws that read no values (random: `Policy.reads_values`)."""
    from evictlab.cache.policies import POLICIES

    if strategy not in POLICIES:
        return False
    p = POLICIES[strategy]
    return p.evicts and p.reads_values and not p.position_only and not p.recompute


NOISE_FILE = "decision_noise.csv"  # experiments/<name>/: the decision noise measured on its sample
NOISE_FACTOR = 2.0  # a value-deciding policy's tolerance: this many times the largest shift measured
NOISE_ULPS = 1.0  # the perturbation: each weight times (1 + NOISE_ULPS x machine epsilon x N(0, 1))


def perturbed(model, seed: int, ulps: float = NOISE_ULPS):
    """A copy of `model` whose every weight is moved by about `ulps` units in its last place (relative,
    seeded): the same model as another CPU's kernels round it, whose near-tied eviction scores can order
    differently."""
    import copy

    import torch

    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            eps = torch.finfo(p.dtype).eps
            p.mul_(1 + ulps * eps * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))
    return out


def noise_table(plain: pd.DataFrame, moved: list[pd.DataFrame]) -> pd.DataFrame:
    """The decision noise of each sampled run (rows: run, metric, noise, streams, perturbations): the
    largest shift over the perturbed re-runs and their streams of each compared metric from the plain
    re-run's, relative to the plain value for nll, nll_full and kl, absolute for agree and correct."""
    keys = ["run_key", "run", "stream"]
    rows = []
    base = plain.set_index(keys)
    for metric in (*RELATIVE, *ABSOLUTE):
        if metric not in plain:
            continue
        shifts = []
        for m in moved:
            d = (m.set_index(keys)[metric] - base[metric]).abs()
            shifts.append(d / base[metric].abs().clip(lower=1e-12) if metric in RELATIVE else d)
        worst = pd.concat(shifts, axis=1).max(axis=1).groupby(level=["run_key", "run"]).max()
        rows += [
            {"run_key": k, "run": r, "metric": metric, "noise": float(v)}
            | {"streams": int(plain["stream"].nunique()), "perturbations": len(moved)}
            for (k, r), v in worst.items()
        ]
    return pd.DataFrame(rows)


def decision_noise(
    folder: Path,
    experiment: str,
    seeds: int = 3,
    streams: int | None = None,
    jobs: int = 1,
    outputs: Path | None = None,
    resume: bool = False,
    fresh: bool = False,
) -> pd.DataFrame:
    """Re-run the sample's value-deciding runs plain and under `seeds` perturbations (`perturbed`) ->
    `noise_table` (written to the folder's NOISE_FILE by `paper noise`). The 1 + `seeds` passes are
    independent: `jobs` > 1 runs them in that many worker processes (joblib starts each with
    OMP_NUM_THREADS = cores // jobs, which torch follows: a re-run does not apply eval.threads). `resume`:
    each (pass, run) result is kept as it is measured (`kept_path`: over all streams in the experiment
    folder, to be committed) and read back by a later call (hours of passes survive a crash or a session's
    end); `fresh`: those kept first removed."""
    import functools
    import shutil

    results = R.read_tables(folder / "snapshot")["results"]
    sample = sample_runs(results, experiment)  # drawn here, once: every pass re-runs the same runs
    # the plain pass (None: the model as trained), then one per seed
    transforms = [None, *(functools.partial(perturbed, seed=s) for s in range(seeds))]
    if fresh:  # (over all streams, the committed runs too)
        for d in [noise_dir(folder, outputs), *([folder / NOISE_RUNS] if streams is None else [])]:
            shutil.rmtree(d, ignore_errors=True)
    kw = {"streams": streams, "outputs": outputs, "sample": sample, "resume": resume}
    one = functools.partial(_noise_pass, folder, experiment, **kw)
    if jobs > 1:
        from joblib import Parallel, delayed

        frames = Parallel(n_jobs=jobs)(delayed(one)(t) for t in transforms)
    else:
        frames = [one(t) for t in transforms]
    if len(machines := pass_machines(frames)) > 1:  # a measurement made over sessions on other machines
        print(
            f"{folder.name}: its passes ran on {len(machines)} machines, so the shifts include their own "
            f"rounding: {'; '.join(machines)}",
            flush=True,
        )
    return noise_table(frames[0], frames[1:])


def _noise_pass(folder, experiment, transform, streams=None, outputs=None, sample=None, resume=False):
    """One pass of `decision_noise` -> the sample's value-deciding runs under `transform` (per stream). The
    plain pass (transform None) reads the full-cache references of the shared store, as `verify` does; a
    perturbed pass computes its model's own, each batch's once for all its runs (a temporary store
    of log-probs, removed when the pass is done). Neither keeps entries with attention (`_references`)."""
    import shutil

    from evictlab.eval.progress import log_to_stderr
    from evictlab.store import stable_hash

    label = transform_label(transform)
    log_to_stderr(label)  # its runs' progress lines (in a worker process of --jobs: none configured there)
    refs = noise_dir(folder, outputs) / f"references-{stable_hash(label)}"
    kw = {"outputs": outputs, "transform": transform, "deciding_only": True, "sample": sample}
    kw |= {"kept": label if resume else None, "pass_references": refs}  # (the plain pass: not used)
    frame = rerun(folder, experiment, streams, **kw)[0]
    shutil.rmtree(refs, ignore_errors=True)
    return frame


RESUME_DIR = "cache/noise"  # under paths.outputs: a resumable noise pass's finished runs (over --streams N)
NOISE_RUNS = "noise_runs"  # experiments/<name>/: a full noise pass's finished runs, one file per (pass, run)


def noise_dir(folder: Path, outputs: Path | None) -> Path:
    """Where `decision_noise` keeps an experiment's finished (pass, run) results and its passes' scratch
    references: outputs/cache/noise/<experiment folder>/."""
    from evictlab.store import outputs_dir

    return outputs_dir(outputs) / RESUME_DIR / folder.name


def transform_label(transform) -> str:
    """A pass's name in its kept results: the transform's function and its arguments ("perturbed(seed=1)");
    "plain" for none."""
    import functools

    if transform is None:
        return "plain"
    if isinstance(transform, functools.partial):
        args = ", ".join(f"{k}={v!r}" for k, v in sorted(transform.keywords.items()))
        return f"{transform.func.__name__}({args})"
    return transform.__name__


def kept_path(folder: Path, outputs: Path | None, s: Sampled, streams: int | None, label: str) -> Path:
    """Where a resumable pass keeps one run's per-stream results. Over all the snapshot's streams (what
    decision_noise.csv is made of): in the experiment folder, `NOISE_RUNS`/<pass>--<run>.parquet, committed
    beside the CSV (a measurement of hours made over several sessions, and what the CSV is recomputed
    from); `_read_kept` checks the run_key inside. Over `--streams N`: outputs/cache/noise/, named by what
    they depend on (the snapshot folder, the run and its overrides, the streams, the pass). The code is in
    neither name: after a change to the engine, run `paper noise --fresh`."""
    from evictlab.store import stable_hash

    if streams is None:
        return folder / NOISE_RUNS / f"{_slug(label)}--{_slug(s.label)}.parquet"
    key = stable_hash([folder.name, s.run_key, list(s.overrides), streams, label])
    return noise_dir(folder, outputs) / f"{key}.parquet"


def _slug(text: str) -> str:
    """ "perturbed(seed=1)" -> "perturbed-seed-1", "h2o b256 cache" -> "h2o-b256-cache"."""
    import re

    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def pass_machines(frames: list[pd.DataFrame]) -> list[str]:
    """The distinct machines (CPU, its kernels' capability, torch) the passes' runs were measured on, from
    their kept results' `machine` column (runs measured before it was recorded: none)."""
    names = [m for f in frames if "machine" in f for m in f["machine"].dropna()]
    return sorted(set(names))


def compare(snapshot: pd.DataFrame, now: pd.DataFrame, noise: pd.DataFrame | None = None) -> pd.DataFrame:
    """Rows (run, stream, metric, snapshot, now, diff, tolerance, ok) for every (run, stream) re-run now:
    `snapshot` is the snapshot's streams table, `now` what `rerun` measured (run_key, run, stream, metrics).
    A value the snapshot has and the re-run lacks (or the reverse) is a failed row. With `noise`
    (`noise_table`, measured on this snapshot's sample), a value-deciding policy's tolerance on a metric is
    NOISE_FACTOR x the largest shift measured for its run, where that exceeds DECISION_TOL (module
    docstring: on NLL and KL, the floor measured on another CPU) and the plain tolerance."""
    rows = []
    snap = snapshot.set_index(["run_key", "stream"])
    deciding = {
        key: decides(name) for key, name in zip(snapshot["run_key"], snapshot["strategy"], strict=True)
    }
    measured = (
        {} if noise is None else {(r, m): v for r, m, v in noise[["run_key", "metric", "noise"]].to_numpy()}
    )
    for _, r in now.iterrows():
        where = (r["run_key"], int(r["stream"]))
        for metric in (*RELATIVE, *ABSOLUTE):
            a = float(snap.loc[where, metric]) if where in snap.index and metric in snap else math.nan
            b = float(r[metric]) if metric in r else math.nan
            if math.isnan(a) and math.isnan(b):
                continue  # neither side has it (no reference past the cap, no KL for the full cache run)
            tol = REL_TOL * abs(a) + 1e-6 if metric in RELATIVE else ABS_TOL
            if metric in ("nll", "kl") and deciding.get(where[0], False) and where in snap.index:
                tol = max(tol, DECISION_TOL * abs(float(snap.loc[where, "nll"])))  # (a floor: measured)
            if deciding.get(where[0], False) and (where[0], metric) in measured:
                shift = measured[where[0], metric] * (abs(a) if metric in RELATIVE else 1.0)
                tol = max(tol, NOISE_FACTOR * shift)
            ok = abs(b - a) <= tol  # False when one side is NaN
            rows.append(
                {"run": r["run"], "stream": where[1], "metric": metric, "snapshot": a, "now": b}
                | {"diff": b - a, "tolerance": tol, "ok": ok}
            )
    return pd.DataFrame(rows)


@dataclass
class Subject:
    """What the sampled runs of one (model, data, eval settings, seed) share: loaded once."""

    checkpoint: Checkpoint
    model: GPT  # (or `transform`'s copy)
    tokens: torch.Tensor  # [N, T]: the first K streams with --streams K
    batch: TaskBatch | RecallBatch | None  # the task's or pass-key problems of those streams
    decode: Callable[[list[int]], str]  # the tokenizer's


def load_subject(stages, streams: int | None, transform=None) -> Subject:
    """The run's corpus, model and streams as it loaded them; every stream built, then the first
    `streams` kept (a task draws its problems in order)."""
    corpus, ck, model = stages.subject()
    tokens, batch, _ = stages.streams(corpus, model)
    if streams is not None:
        tokens = tokens[:streams]
        batch = batch.head(streams) if batch is not None else None
    model = transform(model) if transform is not None else model
    return Subject(ck, model, tokens, batch, corpus.tokenizer.decode)


def measure(cfg, subject: Subject, shared, tasks: pd.DataFrame | None, run_key: str) -> pd.DataFrame:
    """One sampled run re-run on its subject -> per-stream means of the compared metrics (and, for a task
    or recall run, its answers: `answer_checks`, against the snapshot's `tasks` table for written text)."""
    from evictlab.data.tasks import TaskBatch
    from evictlab.eval.evaluate import evaluate, recall_accuracy, task_accuracy, task_answers

    policy, budget, batch, model = cfg.strategy.build(), cfg.resolved_budget, subject.batch, subject.model
    spec = dataclasses.replace(cfg.eval.spec(), diagnostics=policy.needs_future)  # the oracle's future
    task = isinstance(batch, TaskBatch)
    writing = task_answers(batch) if task and policy.can_generate() else None
    res = evaluate(model, subject.tokens, policy, budget, spec, shared, writing)
    means = stream_means(res.per_token)
    if batch is None:
        return means
    if task:
        graded = task_accuracy(model, batch, policy, budget, spec, res, subject.decode)
    else:
        graded = recall_accuracy(model, batch, policy, budget, spec, res, cfg.eval.recall_greedy)
    return means.merge(answer_checks(graded, tasks, run_key), on="stream", how="left")


def rerun(
    folder: Path,
    experiment: str,
    streams: int | None = None,
    every: bool = False,
    outputs: Path | None = None,
    transform=None,
    deciding_only: bool = False,
    strategies: list[str] | None = None,
    sample: list[Sampled] | None = None,
    kept: str | None = None,
    pass_references: Path | None = None,
):
    """Re-run the sample of one experiment folder's snapshot of `experiment` (its figures.yaml names it)
    -> (per-stream means now: run_key, run, stream and the compared metrics; notes). Trained subjects load
    from the checkpoint cache or train again (a note says when the weights are not the snapshot's).
    `transform(model) -> model`: run a changed model instead (`perturbed`), with its own full-cache
    references (never the shared ones, which are the unchanged model's); `deciding_only`: only the runs
    of policies that decide by values (`decides`); `strategies`: only the sampled runs of these policies
    (a snapshot re-checked a slice at a time); `sample`: these runs instead of `sample_runs`' (drawn once
    by a caller that re-runs them several times); `kept`: a pass's name (`transform_label`): each run's
    result is written under `kept_path` when measured, and read from there instead where it exists;
    `pass_references`: with a transform, where its runs share their full-cache log-probs (`_references`)."""
    from evictlab.config import compose, to_objects
    from evictlab.run import RunStages, run_key

    tables = R.read_tables(folder / "snapshot")
    results = tables["results"]
    if results.empty:
        raise ValueError(f"{folder / 'snapshot'} has no results to verify")
    frames, notes = [], []
    _check_strategies(strategies, results)
    subjects: dict[tuple, Subject] = {}  # the sampled runs mostly share one model and one set of streams
    for s in sample_runs(results, experiment, every) if sample is None else sample:
        strategy = results.loc[results["run_key"] == s.run_key, "strategy"].iloc[0]
        if (deciding_only and not decides(strategy)) or (strategies and strategy not in strategies):
            continue
        extra = [f"paths.outputs={outputs}"] if outputs else []
        cfg = to_objects(compose([*s.overrides, "logger=none", *extra]))
        notes += [
            f"{s.label}: config differs from the snapshot's: {d}" for d in config_differences(cfg, s.recorded)
        ]
        path = kept_path(folder, outputs, s, streams, kept) if kept else None
        if path is not None and (was_kept := _read_kept(path, s)) is not None:  # an earlier call's
            frames.append(was_kept)
            continue
        stages, start = RunStages(cfg, run_key(cfg), Path(".")), time.perf_counter()
        subject = _subject(subjects, cfg, stages, streams, transform)
        was = s.recorded_weights
        if was and was != subject.checkpoint.meta.get("weights_sha256"):
            notes.append(f"{s.label}: the checkpoint's weights are not the snapshot's (sha256 {was[:12]}...)")
        shared = _references(stages, subject, transform, pass_references)
        means = measure(cfg, subject, shared, tables.get("tasks"), s.run_key)
        seconds = time.perf_counter() - start
        frames.append(_keep(path, means.assign(run_key=s.run_key, run=s.label, seconds=seconds), kept))
        _report(s.label, kept, len(subject.tokens), seconds)
    return (pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()), notes


def _subject(subjects: dict, cfg, stages, streams: int | None, transform) -> Subject:
    """The run's `Subject`, loaded once for every sampled run of the same settings (mostly all of them)."""
    from evictlab.config import key_dict
    from evictlab.store import stable_hash

    settings = [key_dict(x) for x in (cfg.model, cfg.dataset, cfg.tokenizer, cfg.train, cfg.eval)]
    key = (stable_hash(settings), cfg.seed)
    if key not in subjects:
        subjects[key] = load_subject(stages, streams, transform)
    return subjects[key]


def _references(stages, subject: Subject, transform, pass_references: Path | None):
    """A re-run's full-cache references: the shared store's for the model as trained; for a changed one
    none (each run computes its own) or, with `pass_references`, a scratch store of its log-probs there
    (each batch's computed once for all the runs of a pass). With `pass_references` (a noise pass) no
    entry with attention is kept, in the shared store either: one run of a pass reads it (the oracle), and
    smollm2_tasks' would put 10 x 3 GB on the disk beside the passes' scratch stores."""
    from evictlab.eval.shared import SharedReferences
    from evictlab.run import reference_checkpoint

    if transform is None:
        return stages.shared_references(subject.checkpoint, keep_attention=pass_references is None)
    if pass_references is None:
        return None
    return SharedReferences(pass_references, reference_checkpoint(subject.checkpoint), keep_attention=False)


def _check_strategies(strategies: list[str] | None, results: pd.DataFrame) -> None:
    unknown = sorted(set(strategies or []) - set(results["strategy"]))
    if unknown:
        known = sorted(set(results["strategy"]))
        raise ValueError(f"--strategies {unknown}: not among the snapshot's policies {known}")


def _report(label: str, kept: str | None, streams: int, seconds: float) -> None:
    """One line per re-run run (with the pass it belongs to: `make noise --jobs 2` interleaves them)."""
    from evictlab.eval.progress import duration

    where = f" [{kept}]" if kept else ""
    print(f"{label}{where}: {streams} stream(s) re-run in {duration(seconds)}", flush=True)


def _read_kept(path: Path, s: Sampled) -> pd.DataFrame | None:
    """A run an earlier call of the pass kept at `path`; None where there is none, or where it is another
    run's (a committed file left from before the snapshot was re-made: measured again, overwritten)."""
    if not path.exists():
        return None
    frame = pd.read_parquet(path)
    if set(frame["run_key"]) != {s.run_key}:
        print(f"{s.label}: {path} is of another run (the snapshot re-made?): measured again", flush=True)
        return None
    print(f"{s.label}: kept from an earlier call ({path})", flush=True)
    return frame


def _keep(path: Path | None, frame: pd.DataFrame, label: str | None) -> pd.DataFrame:
    """frame, written to `path` first where one is given (a resumable pass's finished run), with the pass,
    the machine that measured it (`pass_machines`) and the evictlab commit."""
    from evictlab.perf import build_info, cpu_name
    from evictlab.store import git_info, write_atomic

    if path is not None:
        b = build_info()
        machine = f"{cpu_name()} ({b['cpu_capability']}), torch {b['torch']}"
        git = git_info()
        kept = frame.assign(noise_pass=label, machine=machine, git_commit=git.get("commit"))
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda p: kept.to_parquet(p, index=False))
        return kept
    return frame


PROVENANCE = ("info.git_commit", "streams_sha256", "weights_sha256")  # every run of a snapshot records these


def in_history(commits: list[str], repo: Path) -> dict[str, bool]:
    """For each commit (a full or abbreviated sha): whether it is in the history of `repo`'s HEAD."""
    import subprocess

    def known(c: str) -> bool:
        git = ["git", "-C", str(repo), "merge-base", "--is-ancestor", c, "HEAD"]
        return subprocess.run(git, capture_output=True).returncode == 0

    return {c: known(c) for c in commits}


def shallow(repo: Path) -> bool:
    import subprocess

    git = ["git", "-C", str(repo), "rev-parse", "--is-shallow-repository"]
    return subprocess.run(git, capture_output=True, text=True).stdout.strip() == "true"


def provenance_gaps(tables: dict[str, pd.DataFrame], repo: Path) -> str | None:
    """One line naming what a snapshot's provenance lacks: a run without its commit, the sha256 of its
    streams or of its weights; a commit not in `repo`'s history (HEAD's ancestors); a stream without its
    documents (streams.parquet's `documents`). None when complete."""
    runs = tables["results"].drop_duplicates("run_key")
    gaps = []
    for col in PROVENANCE:
        lacking = len(runs) if col not in runs else int(runs[col].isna().sum())
        if lacking:
            gaps.append(f"{lacking} of {len(runs)} runs lack {col}")
    if "info.git_commit" in runs:
        commits = runs["info.git_commit"].dropna().astype(str)
        unknown = [c for c, ok in in_history(sorted(set(commits)), repo).items() if not ok]
        gaps += [
            f"commit {c[:12]} ({int((commits == c).sum())} runs) is not in main's history" for c in unknown
        ]
        if unknown and shallow(repo):
            gaps.append("(this clone is shallow: `git fetch --unshallow` to check against the whole history)")
    streams = tables["streams"]
    lacking = len(streams) if "documents" not in streams else int(streams["documents"].isna().sum())
    if lacking:
        gaps.append(f"{lacking} of {len(streams)} streams lack their documents")
    return "; ".join(gaps) or None


def report(rows: pd.DataFrame) -> str:
    """The table of differences: per run and metric, the largest |now - snapshot| and its tolerance."""
    if rows.empty:
        return "nothing compared"
    rows = rows.assign(excess=(rows["diff"].abs() / rows["tolerance"]))
    worst = rows.loc[rows.groupby(["run", "metric"], sort=False)["excess"].idxmax()]
    table = worst[["run", "metric", "stream", "snapshot", "now", "diff", "tolerance", "ok"]]
    return table.to_string(index=False, float_format=lambda x: f"{x:.6g}")
