"""What one run costs beyond its compute (issue 15, item 3): interpreter and imports, Hydra composition,
corpus and checkpoint loading, evaluation, W&B.

    python benchmarks/run_overhead.py [--repeats 3]

Each measurement is a fresh process, as a sweep job is: `python -c pass`, `import torch`, `import
evictlab.run`, then a small run (`python -m evictlab.run` with gpt_tiny, 1 stream of 64 tokens) with
W&B off and with W&B offline, and offline wandb.init + finish cycles in one process with W&B's
default settings and with evictlab's LEAN ones. The run's own stages come from its metrics.json
(`time_<stage>_s`); what the process spent outside `run()` (interpreter, imports, Hydra, config checks,
exit) is the rest of its wall time. Medians of `--repeats`; outputs go to a temporary folder (the
checkpoint is trained first).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from evictlab.store import REPO_ROOT
from evictlab.tracking import LEAN

RUN = ["model=gpt_tiny", "train=tiny", "train.progress=false", "eval.n_streams=1", "eval.stream_len=64",
       "strategy=window", "budget=b16"]  # fmt: skip


def wall(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, cwd=REPO_ROOT, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def wandb_cycles(folder: str, settings: dict, repeats: int) -> list[float]:
    """Seconds of offline wandb.init + log + finish in one process, after a first cycle that starts the
    W&B service (a sweep worker runs many jobs)."""
    import wandb

    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        s = wandb.Settings(silent=True, console="off", **settings)
        run = wandb.init(mode="offline", project="overhead", dir=folder, reinit="finish_previous", settings=s)
        run.log({"x": float(i)})
        run.finish()
        times.append(time.perf_counter() - start)
    return times[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    py = sys.executable
    rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "EVICTLAB_OUTPUTS": tmp}
        train = [py, "-m", "evictlab.train", *RUN]
        subprocess.run(train, cwd=REPO_ROOT, env=env, check=True, capture_output=True)
        for i in range(args.repeats):
            rows.setdefault("python -c pass", []).append(wall([py, "-c", "pass"], env))
            rows.setdefault("import torch", []).append(wall([py, "-c", "import torch"], env))
            rows.setdefault("import evictlab.run", []).append(wall([py, "-c", "import evictlab.run"], env))
            for j, logger in enumerate(("none", "wandb_offline")):
                seed = 100 + 2 * i + j  # a new run each time (the logger is in no run key)
                total = wall([py, "-m", "evictlab.run", *RUN, f"logger={logger}", f"seed={seed}"], env)
                found = Path(tmp, "runs", "adhoc").glob("*/metrics.json")
                m = next(m for m in map(json.loads, (p.read_text() for p in found)) if m.get("seed") == seed)
                rows.setdefault(f"run, logger={logger}: process", []).append(total)
                rows.setdefault(f"run, logger={logger}: outside run()", []).append(total - m["wall_s"])
                for k, v in m.items():
                    if k.startswith("time_"):
                        rows.setdefault(f"run, logger={logger}: {k[5:-2]}", []).append(v)
        for name, settings in (("default settings", {}), ("evictlab's LEAN settings", LEAN)):
            rows[f"wandb init+finish after the first, {name}"] = wandb_cycles(tmp, settings, args.repeats)
    print(f"{'what (median of ' + str(args.repeats) + ')':<44} {'seconds':>8}")
    for name, values in rows.items():
        print(f"{name:<44} {statistics.median(values):>8.3f}")


if __name__ == "__main__":
    main()
