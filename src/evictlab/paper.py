"""Paper figures from committed snapshots, and the command that refreshes the snapshots.

    python -m evictlab.paper figures   # make figures: every experiments/<name>/ figure, from its snapshot
    python -m evictlab.paper run       # make paper: re-run each experiment's sweep, refresh, redraw
    python -m evictlab.paper verify --only NAME   # make verify EXP=NAME: does the snapshot still hold?
    python -m evictlab.paper noise --only NAME    # its decision noise: the value-deciding runs, perturbed
    python -m evictlab.paper tables --only NAME   # make tables EXP=NAME: the cost tables its README quotes

Each `experiments/<name>/` holds `figures.yaml` (which Hydra experiment produces it and which figures
of the registry in analysis/figures.py to draw, with their arguments), a README, and `snapshot/` (the
aggregated tables of that sweep, evictlab/results.py: TABLES).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import yaml

from evictlab import results as R
from evictlab.analysis import figures as F
from evictlab.analysis.report import load_tables
from evictlab.store import REPO_ROOT, outputs_dir, write_atomic

EXPERIMENTS = REPO_ROOT / "experiments"


def load_spec(folder: Path) -> dict:
    spec = yaml.safe_load((folder / "figures.yaml").read_text()) or {}
    unknown = [f["name"] for f in spec.get("figures", []) if f["name"] not in F.FIGURES]
    if unknown:
        raise ValueError(
            f"{folder / 'figures.yaml'}: unknown figure(s) {unknown}; known: {sorted(F.FIGURES)}"
        )
    return spec


def load_snapshot(folder: Path) -> dict[str, pd.DataFrame]:
    """A folder's committed tables; where `make speed` re-measured its decode rates in one sitting
    (speed.csv beside the snapshot), its runs carry those (`speed` holds the measurement)."""
    from evictlab.speed import SPEED_FILE, with_speed

    tables = load_tables(folder / "snapshot")
    if (folder / SPEED_FILE).exists():
        tables["speed"] = pd.read_csv(folder / SPEED_FILE)
        tables["runs"] = with_speed(tables["runs"], tables["speed"])
    return tables


def draw(folder: Path, out: Path) -> list[Path]:
    """Draw one experiment folder's figures from its snapshot; returns the files written."""
    spec, tables = load_spec(folder), load_snapshot(folder)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for fig_spec in spec.get("figures", []):
        with F.style():
            fig = F.draw(fig_spec["name"], tables, **fig_spec.get("args", {}))
            stem = fig_spec.get("file", fig_spec["name"])
            for ext in ("png", "pdf"):
                fig.savefig(out / f"{stem}.{ext}", dpi=150)
                written.append(out / f"{stem}.{ext}")
    return written


def experiment_folders() -> list[Path]:
    return sorted(p.parent for p in EXPERIMENTS.glob("*/figures.yaml"))


def experiments(spec: dict) -> list[str]:
    """The Hydra experiments whose runs make up a folder's sweep: `experiment` (whose group names the
    sweep) and those listed under `also` (which share that group)."""
    return [spec["experiment"], *spec.get("also", [])]


def refresh(folder: Path, launcher: str, slices: list[str] | None = None) -> None:
    """Re-run the folder's Hydra experiments (make sweep) and copy the aggregated tables into snapshot/.
    With `slices` (some of the folder's experiments), only those run and their runs are merged into the
    committed snapshot (`merge_runs`): an experiment longer than one sitting is made slice by slice."""
    spec = load_spec(folder)
    exps = experiments(spec)
    if launcher == "local":  # an experiment too large to run two jobs at once names its own
        launcher = spec.get("launcher", launcher)
    unknown = sorted(set(slices or []) - set(exps))
    if unknown:
        raise ValueError(f"{folder.name}: --slice {unknown} not among its experiments {exps}")
    for exp in exps if not slices else [e for e in exps if e in slices]:
        cmd = ["make", "sweep", f"EXP={exp}", f"GROUP={exps[0]}", f"LAUNCHER={launcher}"]
        subprocess.run(cmd, cwd=REPO_ROOT, check=True)
    sweep, snap = outputs_dir() / "runs" / exps[0], folder / "snapshot"
    snap.mkdir(exist_ok=True)
    stale = other_text(snap, sweep) if slices else set()
    if stale:
        print(f"{folder.name}: {len(stale)} committed run(s) streamed other text than this slice: dropped")
    for t in R.TABLES:
        made, kept = R.table_path(sweep, t), R.table_path(snap, t)
        if slices and kept.exists():
            new = pd.read_parquet(made) if made.exists() else None
            merged = merge_runs(pd.read_parquet(kept), new, stale)
            write_atomic(kept, lambda p, m=merged: m.to_parquet(p, index=False))
        elif made.exists():
            shutil.copyfile(made, kept)


def other_text(snap: Path, sweep: Path) -> set[str]:
    """The committed runs that streamed other tokens than every run of the new slice (their
    `streams_sha256` is none of the slice's): a re-made experiment's first slice replaces them, so a
    snapshot never mixes texts."""
    kept, made = R.table_path(snap, "results"), R.table_path(sweep, "results")
    if not (kept.exists() and made.exists()):
        return set()
    old, new = pd.read_parquet(kept), pd.read_parquet(made)
    if "streams_sha256" not in old or "streams_sha256" not in new:
        return set()
    return set(old.loc[~old["streams_sha256"].isin(set(new["streams_sha256"])), "run_key"])


def merge_runs(kept: pd.DataFrame, new: pd.DataFrame | None, drop: set[str] = frozenset()) -> pd.DataFrame:
    """A snapshot table with a slice's freshly aggregated rows: every run of `new` replaces that run's rows
    in `kept` (matched by run_key), the runs in `drop` go, the other runs' rows stay."""
    if (new is None or not len(new)) and not drop:
        return kept
    if not len(kept) or "run_key" not in kept:
        return kept if new is None else new.reset_index(drop=True)
    gone = set(drop) | (set() if new is None or not len(new) else set(new["run_key"]))
    rest = kept[~kept["run_key"].isin(gone)]
    return rest.reset_index(drop=True) if new is None else pd.concat([rest, new], ignore_index=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["figures", "run", "verify", "tables", "noise", "speed"])
    ap.add_argument("--only", nargs="*", default=None, help="experiment folder names (default: all)")
    ap.add_argument("--launcher", default="local", help="for `run`: local | submitit_local | slurm")
    ap.add_argument(
        "--slice",
        nargs="+",
        default=None,
        help="for `run`: only these of the folder's experiments, merged into its committed snapshot",
    )
    ap.add_argument("--out", type=Path, default=None, help="figure root (default outputs/figures/paper)")
    ap.add_argument("--streams", type=int, default=None, help="for `verify`: the first K streams of each run")
    ap.add_argument("--all", action="store_true", help="for `verify`: every run, not one per policy")
    ap.add_argument("--strategies", nargs="*", default=None, help="for `verify`: only these policies' runs")
    ap.add_argument("--seeds", type=int, default=3, help="for `noise`: perturbations of the weights")
    ap.add_argument("--jobs", type=int, default=1, help="for `noise`: passes run at once, in processes")
    ap.add_argument("--fresh", action="store_true", help="for `noise`: drop the runs earlier calls kept")
    ap.add_argument("--rounds", type=int, default=3, help="for `speed`: interleaved timings of every run")
    ap.add_argument("--steps", type=int, default=32, help="for `speed`: decode steps timed per run")
    args = ap.parse_args(argv)
    if args.command == "speed":
        return speed_main(args)
    if args.command in ("verify", "noise"):
        return verify_main(args)
    folders = [f for f in experiment_folders() if args.only is None or f.name in args.only]
    if not folders:
        print(f"error: no experiments/<name>/figures.yaml matches {args.only}", file=sys.stderr)
        return 2
    if args.command == "tables":
        for folder in folders:
            print(snapshot_tables(folder))
        return 0
    root = args.out or outputs_dir() / "figures" / "paper"
    for folder in folders:
        if args.command == "run":
            refresh(folder, args.launcher, args.slice)
        files = draw(folder, root / folder.name)
        print(f"{folder.name}: {len(files) // 2} figure(s) -> {root / folder.name}")
    return 0


def markdown(frame: pd.DataFrame) -> str:
    """A table as GitHub markdown, its index as the first column, numbers right-aligned."""
    f = frame.reset_index()
    head = "| " + " | ".join(str(c) for c in f.columns) + " |"
    align = "| --- | " + " | ".join("---:" for _ in f.columns[1:]) + " |"
    return "\n".join(
        [head, align, *("| " + " | ".join(str(v) for v in r) + " |" for r in f.itertuples(index=False))]
    )


def snapshot_tables(folder: Path) -> str:
    """`tables`: an experiment snapshot's tables (analysis/report.py) as the markdown its README quotes: the
    cost per position mode, per training where several, the rows its figures.yaml sets `against` the
    others, NLL by position `bands`, pass-key recall, and the paired cache / original ratios. A snapshot
    of several stream lengths (long_stream and long_stream_1m) gets them once per length."""
    tables, wanted = load_snapshot(folder), load_spec(folder).get("tables", {})
    lengths = sorted(tables["streams"]["stream_len"].unique()) if "stream_len" in tables["streams"] else []
    if len(lengths) < 2:
        return _tables_text(folder.name, tables, wanted)
    parts = []
    for n in lengths:
        one = {k: t[t["stream_len"] == n] if "stream_len" in t else t for k, t in tables.items()}
        parts.append(_tables_text(f"{folder.name}, streams of {int(n) - 1:,} predictions", one, wanted))
    return "\n".join(parts)


def _all_steps(tables: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """The tables without the runs that scored sampled steps only (eval.recompute_sample)."""
    from evictlab.analysis import stats as S

    sampled = S.sampled_runs(tables["results"])
    if not sampled:
        return tables
    return {k: t[~t["run_key"].isin(sampled)] if "run_key" in t else t for k, t in tables.items()}


def _sampled_note(results: pd.DataFrame | None) -> list[str]:
    """Under the band table, where a snapshot has sampled runs: what their plain columns cover."""
    from evictlab.analysis import stats as S

    if not (keys := S.sampled_runs(results)):
        return []
    per = sorted({int(v) for v in results.loc[results["run_key"].isin(keys), "cfg.eval.recompute_sample"]})
    return [
        f"(a sampled run's perplexity and band NLLs are over its {' or '.join(f'{n:,}' for n in per)}"
        " sampled predictions per stream, not every prediction of the band: only its paired costs below,"
        " each on its own predictions against the full cache's, compare with the other rows)"
    ]


def reference_capped(results: pd.DataFrame) -> bool:
    """Whether some run's full-cache reference covers fewer predictions than its streams hold
    (eval.full_max_len below stream_len - 1: smollm2_long, long_stream)."""
    cap = results.get("cfg.eval.full_max_len")
    return cap is not None and bool((results["stream_len"] - 1 > cap).any())


def _training_lines(tables: dict[str, pd.DataFrame], wanted: dict, mode: str) -> list[str]:
    """Per training where a snapshot has several (and each `against` row set against the others, per
    budget); on a one-model snapshot, each `against` row against the others, budgets as columns."""
    from evictlab.analysis import stats as S
    from evictlab.analysis.report import training_table

    out: list[str] = []
    if "checkpoint" in tables["streams"] and tables["streams"]["checkpoint"].nunique() > 1:
        original = tables["streams"][tables["streams"]["position_mode"] == mode]
        ablated = S.ablations(original)
        for budget in sorted(S.evicting(original)["budget"].unique()):
            also = " (and the full cache's ablations)" if len(ablated) else ""
            out += ["", f"per training, {mode} positions, budget {int(budget)}{also}:"]
            out.append(markdown(training_table(tables, mode, int(budget))))
            for against in wanted.get("against", []):
                what = "paired per stream; above 1: the policy does better"
                out += ["", f"{against} against each other policy, budget {int(budget)} ({what}):"]
                out.append(markdown(training_table(tables, mode, int(budget), against)))
        return out
    if reference_capped(tables["results"]):
        # a capped reference (its span shorter than the streams): a sampled run pairs with the others only
        # on that span, not on the whole streams this table compares (the band tables pair it by band)
        tables = _all_steps(tables)
    original = tables["streams"][tables["streams"]["position_mode"] == mode]
    budgets = sorted(S.evicting(original)["budget"].unique())
    for against in wanted.get("against", []):
        what = "perplexity ratio paired per stream [95% CI]; above 1: the row does better"
        out += ["", f"{against} against each other policy, {mode} positions ({what}):"]
        cols = {f"b{int(b)}": training_table(tables, mode, int(b), against).iloc[:, -1] for b in budgets}
        out.append(markdown(pd.DataFrame(cols).fillna("-").rename_axis("policy")))
    return out


def _task_lines(tables: dict[str, pd.DataFrame], mode: str) -> list[str]:
    """The task tables: answers graded as written, and teacher-forced (where the oracle has a row); how
    fast the answers were written, where the runs measured it."""
    from evictlab.analysis.report import task_table

    what = "share [95% Wilson CI] correct/samples; exact McNemar p against the full cache's answers"
    out = [
        "",
        f"task answers graded exact, as written under the policy: {what}:",
        markdown(task_table(tables, mode)),
        "",
        "task answers exact teacher-forced (the oracle too), the same columns:",
        markdown(task_table(tables, mode, "exact_teacher_forced")),
    ]
    return out + _decode_lines(tables, mode, "the answers")


def _generation_lines(tables: dict[str, pd.DataFrame], mode: str) -> list[str]:
    """Free-running generation against the full cache, and how fast the continuations were written."""
    from evictlab.analysis.report import generation_table

    what = "ROUGE-L [95% CI]; tokens to the first divergence [95% CI]; continuations identical/streams"
    out = ["", f"greedy continuations against the full cache's from the same prefix: {what}:"]
    out.append(markdown(generation_table(tables, mode)))
    return out + _decode_lines(tables, mode, "them")


def _decode_lines(tables: dict[str, pd.DataFrame], mode: str, what: str) -> list[str]:
    """How fast the runs wrote (decode_table), and where the rates come from: the runs as they ran, or
    `make speed`'s one-sitting measurement."""
    from evictlab.analysis.report import decode_table
    from evictlab.speed import describe

    speed = decode_table(tables, mode)
    if not len(speed):
        return []
    where = describe(tables["speed"]) if "speed" in tables else "as each run measured it (sessions differ)"
    head = f"decode token-steps/s writing {what} (explicit attention; SDPA from the same caches), {where}:"
    return ["", head, markdown(speed)]


def _tables_text(name: str, tables: dict[str, pd.DataFrame], wanted: dict) -> str:
    from evictlab.analysis.report import (
        band_cost_table,
        band_table,
        cost_table,
        held_table,
        mode_table,
        recall_table,
        sinks_table,
        units_line,
    )

    out = [
        f"## {name}: perplexity (perplexity / full-cache perplexity [95% paired CI])",
        units_line(tables),
    ]
    modes = sorted(tables["streams"]["position_mode"].unique(), key=["original", "cache"].index)
    for mode in modes:
        out += ["", f"{mode} positions:", markdown(cost_table(tables, mode))]
    out += _training_lines(tables, wanted, modes[0])
    if bands := wanted.get("bands"):
        out += ["", "perplexity over the stream, and mean NLL [nats] by position band:"]
        out.append(markdown(band_table(tables, bands)))
        out += _sampled_note(tables["results"])
        what = "exp(mean per-stream NLL difference) on the predictions both cover [95% CI; n streams]"
        out += ["", f"paired cost by position band, policy / full cache: {what}:"]
        out.append(markdown(band_cost_table(tables, bands)))
        for against in wanted.get("against", []):
            what = "exp(mean per-stream difference of the two band costs above) [95% CI; n streams]"
            head = f"{against} against each other policy by position band (above 1: the row does better)"
            out += ["", f"{head}, {what}:"]
            out.append(markdown(band_cost_table(tables, bands, against=against)))
    if (against := wanted.get("sinks_against")) is not None:
        out += [
            "",
            f"initial positions kept, paired against {against} on the same streams [95% CI]; streams lower:",
        ]
        out.append(markdown(sinks_table(tables, against)))
    for mode in modes:
        held = held_table(tables, mode)
        if held is not None:
            what = "share of steps at which the cache holds position 0, mean over layers (lowest layer)"
            out += ["", f"{mode} positions, {what}:", markdown(held)]
    if not tables["recall"].empty:
        depths = ", ".join(f"{d:g}" for d in sorted(tables["recall"]["depth"].unique()))
        out += ["", f"pass-key recall, exact (teacher-forced), recalled/streams (by needle depth {depths}):"]
        out.append(markdown(recall_table(tables)))
    if not tables.get("tasks", pd.DataFrame()).empty:
        out += _task_lines(tables, modes[0])
    elif not tables.get("generations", pd.DataFrame()).empty:
        out += _generation_lines(tables, modes[0])
    if len(modes) == 2:
        out += [
            "",
            "cache / original positions, paired perplexity ratio [95% CI]:",
            markdown(mode_table(tables)),
        ]
    return "\n".join(out) + "\n"


def named_folders(args) -> list[Path] | None:
    """The folders `--only` names for a command that re-runs a snapshot's runs; None (said on stderr) when
    none is named, one has no figures.yaml or an option is out of range."""
    if not args.only:
        print(
            f"error: {args.command} needs --only NAME (make {args.command} EXP=NAME): it re-runs the "
            "snapshot's runs",
            file=sys.stderr,
        )
        return None
    folders = [EXPERIMENTS / name for name in args.only]
    missing = [f.name for f in folders if not (f / "figures.yaml").exists()]
    if missing:
        print(f"error: no experiments/<name>/figures.yaml for {missing}", file=sys.stderr)
        return None
    for name, v in (("streams", args.streams), ("rounds", args.rounds), ("steps", args.steps)):
        if v is not None and v < 1:
            print(f"error: --{name} {v} must be >= 1", file=sys.stderr)
            return None
    return folders


def speed_main(args) -> int:
    """`speed`: every writing run of each named snapshot timed again in one sitting (evictlab/speed.py),
    into experiments/NAME/speed.csv, which the tables and the trade-off figure then read."""
    from evictlab.speed import SPEED_FILE, describe, remeasure

    folders = named_folders(args)
    if folders is None:
        return 2
    for folder in folders:
        speed = remeasure(folder, load_spec(folder)["experiment"], args.rounds, args.steps)
        speed.to_csv(folder / SPEED_FILE, index=False, float_format="%.6g")
        cols = ["run", "decode_token_steps_per_s", "decode_token_steps_per_s_median"]
        cols += ["decode_token_steps_per_s_fused", "fused_same_tokens"]
        print(speed[cols].to_string(index=False, float_format=lambda x: f"{x:.1f}"))
        print(f"{folder.name}: {describe(speed)} -> {folder / SPEED_FILE}")
    return 0


def verify_main(args) -> int:
    """`verify`: re-run each named snapshot's sample (evictlab/verify.py), print the differences; 1 when
    any is beyond its tolerance."""
    from evictlab import verify as V
    from evictlab.eval.progress import log_to_stderr

    log_to_stderr()  # each re-run's progress every 5 minutes: a pass can take hours
    folders = named_folders(args)
    if folders is None:
        return 2
    status = 0
    for folder in folders:
        if args.command == "noise":  # measure what rounding does to the value-deciding runs: the tolerance
            experiment = load_spec(folder)["experiment"]
            kw = {"jobs": args.jobs, "resume": True, "fresh": args.fresh}  # (a stopped call goes on)
            noise = V.decision_noise(folder, experiment, args.seeds, args.streams, **kw)
            noise.to_csv(folder / V.NOISE_FILE, index=False, float_format="%.6g")
            print(noise.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
            print(f"{folder.name}: decision noise -> {folder / V.NOISE_FILE}")
            continue
        gaps = V.provenance_gaps(load_snapshot(folder), REPO_ROOT)
        print(f"{folder.name}: provenance " + (f"INCOMPLETE: {gaps}" if gaps else "complete"), flush=True)
        status = 1 if gaps else status
        now, notes = V.rerun(
            folder, load_spec(folder)["experiment"], args.streams, args.all, strategies=args.strategies
        )
        noise = pd.read_csv(folder / V.NOISE_FILE) if (folder / V.NOISE_FILE).exists() else None
        how = f"{V.NOISE_FACTOR:g} x the noise in {V.NOISE_FILE}" if noise is not None else "DECISION_TOL"
        print(f"{folder.name}: value-deciding policies' tolerance: {how}")
        snap = load_snapshot(folder)
        rows = (
            V.compare(V.snapshot_answers(snap["streams"], snap.get("tasks"), snap.get("recall")), now, noise)
            if len(now)
            else pd.DataFrame()
        )
        for note in notes:
            print(f"note: {note}")
        print(f"\n{folder.name}: largest difference per run and metric")
        print(V.report(rows))
        bad = int((~rows["ok"]).sum()) if len(rows) else -1
        if bad:
            what = "nothing was compared" if bad < 0 else f"{bad} value(s) beyond tolerance"
            print(f"{folder.name}: FAILED ({what})")
            status = 1
        else:
            print(f"{folder.name}: holds ({len(rows)} values within tolerance)")
    return status


if __name__ == "__main__":
    sys.exit(main())
