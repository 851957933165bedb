"""Decode speed re-measured in one sitting: `python -m evictlab.paper speed --only NAME` (`make speed`).

A run records how fast it wrote its answers or continuations (`decode_token_steps_per_s`, and through the
fused kernel for a policy that reads no attention weights), but an experiment made in slices over several
sessions mixes machines and loads: the sliding window and StreamingLLM, the same computation at one budget,
decoded at 56.8 and 41.5 token-steps/s in two sessions of smollm2_tasks. This pass measures every writing
run of a snapshot again in one process, interleaved (round r measures every run before round r + 1 starts,
so a change of load spreads over all of them), and writes `experiments/NAME/speed.csv`; the tables and the
trade-off figure then read their decode rates from it (`with_speed`) and say so.

Each measurement is the engine's own: the prompt prefilled once per run on the blocked path
(`eval.engine.prefilled`, untimed), then in every round `steps` greedy steps through the token loop from a
fork of those caches (`Prefilled.write` with a `DecodeClock`: timed; the fused-kernel twin from another
fork where the policy allows), on the run's composed config (policy, budget, positions, threads) and its
first `batch` streams (the run's batch size), each cut to its first `stream_len - 1 - steps` tokens as
the prompt. Every run's prefilled caches are held through the rounds (a full cache of B x P entries per
layer, the others their budget). A policy that keeps no cache (the window with re-computation) runs
`generate` whole in each round. The rate kept is the best round's (the least disturbed); the median
beside it.
"""

from __future__ import annotations

import datetime as dt
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

if TYPE_CHECKING:
    import torch

    from evictlab.config import Config
    from evictlab.models.gpt import GPT

SPEED_FILE = "speed.csv"
RATES = ("decode_token_steps_per_s", "decode_token_steps_per_s_fused", "fused_same_tokens")


@dataclass
class Setting:
    """One snapshot run to time: its key, label, composed config and the prompt it decodes from."""

    run_key: str
    label: str
    cfg: Config
    model: GPT
    prompt: torch.Tensor  # [batch, P]: the first `batch` streams' first tokens


def writing_runs(results: pd.DataFrame) -> pd.DataFrame:
    """The runs (one row each) that wrote answers or continuations: those with a decode rate."""
    rates = results[results["metric"] == "decode_token_steps_per_s"]
    return results[results["run_key"].isin(set(rates["run_key"]))]


def settings(folder: Path, experiment: str, steps: int) -> list[Setting]:
    """Every writing run of the folder's snapshot, composed as `make verify` composes it, with its prompt."""
    from evictlab import results as R
    from evictlab.config import compose, to_objects
    from evictlab.errors import ConfigError
    from evictlab.run import RunStages, run_key
    from evictlab.verify import sample_runs

    results = writing_runs(R.read_tables(folder / "snapshot")["results"])
    if results.empty:
        raise ConfigError(
            f"{folder.name}: no run of its snapshot wrote tokens (no decode rate to re-measure)"
        )
    out, prompts = [], {}
    for s in sample_runs(results, experiment, every=True):
        cfg = to_objects(compose([*s.overrides, "logger=none"]))
        B, T = cfg.eval.batch_size, cfg.eval.stream_len
        if T - 1 - steps < 1:
            raise ConfigError(f"{s.label}: streams of {T} tokens leave no prompt before {steps} steps")
        key = (cfg.model.name, cfg.dataset.name, B, T)
        if key not in prompts:  # the runs of a snapshot share one model and one set of streams
            stages = RunStages(cfg, run_key(cfg), Path("."))
            corpus, _, model = stages.subject()
            tokens = stages.streams(corpus, model)[0]
            prompts[key] = (model, tokens[:B, : T - 1 - steps].clone())
        out.append(Setting(s.run_key, s.label, cfg, *prompts[key]))
    return out


class Timer:
    """One run's decode, timed again and again from one prefill of its prompt."""

    def __init__(self, s: Setting, steps: int):
        from evictlab.eval.engine import prefilled
        from evictlab.perf import pinned_threads

        self.s, self.steps = s, steps
        self.policy, self.budget, self.spec = s.cfg.strategy.build(), s.cfg.resolved_budget, s.cfg.eval.spec()
        with pinned_threads(s.cfg.eval.threads):
            self.pre = prefilled(s.model, s.prompt, self.policy, self.budget, steps, self.spec)

    def time(self):
        """One timed decode of `steps` tokens -> its DecodeClock."""
        from evictlab.eval.engine import DecodeClock, generate
        from evictlab.perf import pinned_threads

        clock, s = DecodeClock(fused=True), self.s
        with pinned_threads(s.cfg.eval.threads):
            if self.pre is None:  # no cache to prefill: the whole generation, as the run did it
                generate(s.model, s.prompt, self.policy, self.budget, self.steps, self.spec, clock=clock)
            else:
                self.pre.write(clock)
        return clock


def remeasure(folder: Path, experiment: str, rounds: int = 3, steps: int = 32) -> pd.DataFrame:
    """Every writing run of the snapshot timed `rounds` times, interleaved -> one row per run."""
    from tqdm import tqdm

    from evictlab.perf import cpu_name
    from evictlab.store import git_info

    if rounds < 1 or steps < 1:
        raise ValueError(f"rounds ({rounds}) and steps ({steps}) must be >= 1")
    todo = settings(folder, experiment, steps)
    timers = [Timer(s, steps) for s in tqdm(todo, desc=f"{folder.name}: prefill", unit="run")]
    clocks: dict[str, list] = {s.run_key: [] for s in todo}
    with tqdm(total=rounds * len(todo), desc=f"{folder.name}: decode", unit="run") as bar:
        for _ in range(rounds):
            for t in timers:
                clocks[t.s.run_key].append(t.time())
                bar.update()
    stamp = {
        "cpu": cpu_name(),
        "commit": git_info()["commit"],
        "measured_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    return pd.DataFrame([_row(s, clocks[s.run_key], steps) | stamp for s in todo])


def _row(s: Setting, clocks: list, steps: int) -> dict:
    """One run's timings -> its speed.csv row: the best round's rates and the median beside them."""
    rate = [c.rate() for c in clocks]
    fused = [c.fused_rate() for c in clocks if c.fused_rows]
    fused_rows = sum(c.fused_rows for c in clocks)
    return {
        "run_key": s.run_key,
        "run": s.label,
        "batch": s.prompt.shape[0],
        "prompt": s.prompt.shape[1],
        "steps": steps,
        "threads": s.cfg.eval.threads,
        "rounds": len(clocks),
        "decode_token_steps_per_s": max(rate),
        "decode_token_steps_per_s_median": statistics.median(rate),
        "decode_token_steps_per_s_fused": max(fused) if fused else float("nan"),
        "fused_same_tokens": sum(c.fused_same_rows for c in clocks) / fused_rows if fused else float("nan"),
    }


def with_speed(runs: pd.DataFrame, speed: pd.DataFrame | None) -> pd.DataFrame:
    """The runs table (one row per run) with its decode rates replaced by the one-sitting measurement
    where `speed` has the run (the recorded ones kept elsewhere); `decode_source` says which."""
    if speed is None or speed.empty or "run_key" not in runs:
        return runs
    out = runs.copy()
    m = speed.set_index("run_key")
    hit = out["run_key"].isin(m.index)
    for col in RATES:
        if col not in out:
            out[col] = float("nan")
        out.loc[hit, col] = out.loc[hit, "run_key"].map(m[col]).astype(float)
    out["decode_source"] = hit.map({True: "speed.csv", False: "run"})
    return out


def describe(speed: pd.DataFrame) -> str:
    """One line: where and how the rates were re-measured."""
    first = speed.iloc[0]
    return (
        f"re-measured in one sitting (speed.csv, {first['measured_utc']}, {first['cpu']}, commit "
        f"{str(first['commit'])[:7]}): {int(first['batch'])} streams x {int(first['prompt'])}-token prompts, "
        f"{int(first['steps'])} decode steps, {int(first['threads'])} thread(s), best of "
        f"{int(first['rounds'])} interleaved rounds"
    )
