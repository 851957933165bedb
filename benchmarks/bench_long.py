"""Long streams: peak memory and speed of one stream as it grows (make bench-long).

    python benchmarks/bench_long.py                      # the issue's rows (about 15 minutes here)
    python benchmarks/bench_long.py --lengths 8192,32768 --policies window
    python benchmarks/bench_long.py --compile            # the compiled token loop (default: the engine path)

Workload: gpt_small with random weights, one stream of random byte tokens, budget `--budget`, 1 thread,
diagnostics off and no full-cache reference (the engine alone). Each (policy, length) runs in a fresh
process, so its peak RSS is its own. Bounded policies must keep memory and token-steps/s flat in stream
length (the ratio columns, against the shortest length); the full cache is measured at `--full-length`
(memory O(T) for its growing KV cache, compute O(T^2)).

Diagnostics rows (`--diag`): a whole evaluation with attention diagnostics on (the full-cache reference
with its attention, then the policy's stream with attention lost and sink mass), batch 1, each in a
fresh process, against a stated peak-RSS bound: SmolLM2-135M (model=smollm2_135m, converted into the
checkpoint cache on first use) over 4,096 tokens, and gpt_tiny's full cache over 32,768 tokens with the
reference's cap raised to cover it. Random tokens: memory and speed do not depend on the text.

Later-run row (`--later-run`): the wall time of a whole `python -m evictlab.run` on SmolLM2 (2 streams x
512 tokens of man pages, budget 64, W&B off) once the checkpoint, the streams and the subject's sink metrics
are cached, as for a sweep's second run on: in a fresh outputs folder a first run (window) computes them,
then a second (H2O, the slowest path) is timed, each a fresh process; bound 60 s on 2 cores (issue 26).

Writes outputs/bench/long.json and prints the tables that benchmarks/README.md quotes.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

import torch

from evictlab.cache import make_policy
from evictlab.eval import StreamSpec, stream
from evictlab.models.gpt import GPT, GPTConfig
from evictlab.perf import cpu_name, peak_rss_bytes, save_report, set_threads
from evictlab.store import REPO_ROOT, git_info

GiB = 1024**3
DIAG_BOUNDS = {"smollm2_135m": 4 * GiB, "gpt_tiny": 3 * GiB}  # issue 26: peak RSS with diagnostics on
LATER_RUN = "model=smollm2_135m dataset=man_pages eval.n_streams=2 eval.stream_len=512 budget=b64"
LATER_BOUND_S = 60.0  # issue 26: a later SmolLM2 run of 2 streams x 512 tokens, wall on 2 cores


def later_run(overrides: str, first: str = "window", timed: str = "h2o") -> dict:
    """Wall seconds of a first run (`first`: computes and caches the checkpoint, the streams and the sink
    metrics) and of a later one (`timed`) in a fresh outputs folder, each a fresh `python -m evictlab.run`."""
    args = [*shlex.split(overrides), "logger=none"]
    walls = {}
    with tempfile.TemporaryDirectory(prefix="evictlab-later-") as tmp:
        env = {**os.environ, "EVICTLAB_OUTPUTS": tmp}
        for policy in (first, timed):
            cmd = [sys.executable, "-m", "evictlab.run", *args, f"strategy={policy}"]
            start = time.perf_counter()
            res = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
            if res.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
            walls[policy] = time.perf_counter() - start
    bound = LATER_BOUND_S if overrides == LATER_RUN else None
    return {"overrides": overrides, "first_policy": first, "first_seconds": walls[first], "policy": timed,
            "seconds": walls[timed], "bound_seconds": bound}  # fmt: skip


def one(policy: str, length: int, budget: int, compile: bool, seed: int = 0) -> dict:
    """Stream one random stream in this process; returns seconds, token-steps/s (the compilation of the
    loop's step excluded: a fixed cost, reported as compile_seconds) and peak RSS."""
    set_threads(1)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(name="gpt_small", vocab_size=258)).eval()
    tokens = torch.randint(0, 256, (1, length + 1))
    tokens[:, 0] = 256
    spec = StreamSpec(diagnostics=False, batch_size=1, compile=compile)
    start = time.perf_counter()
    out = stream(model, tokens, make_policy(policy), budget, spec)
    seconds = time.perf_counter() - start
    streaming = seconds - out.compile_seconds
    return {"policy": policy, "length": length, "path": out.path, "seconds": seconds,
            "compile_seconds": out.compile_seconds, "token_steps_per_s": length / streaming,
            "peak_rss_bytes": peak_rss_bytes()}  # fmt: skip


def diag_model(name: str):
    """gpt_tiny with random weights, or a configured subject from the checkpoint cache (converted once)."""
    if name == "gpt_tiny":
        torch.manual_seed(0)
        return GPT(GPTConfig(name="gpt_tiny", vocab_size=258, n_layer=2, n_embd=40)).eval()
    from evictlab.checkpoints import get_checkpoint
    from evictlab.config import compose, to_objects

    return get_checkpoint(to_objects(compose([f"model={name}", "logger=none"]))).model


def one_diag(name: str, policy: str, length: int, budget: int) -> dict:
    """One evaluation with diagnostics on, in this process: the full-cache reference (with its attention)
    and the policy's stream against it; seconds of each and peak RSS."""
    from evictlab.eval.evaluate import evaluate

    set_threads(1)
    model = diag_model(name)
    torch.manual_seed(1)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, length + 1))
    spec = StreamSpec(diagnostics=True, batch_size=1, full_max_len=length)
    start = time.perf_counter()
    res = evaluate(model, tokens, make_policy(policy), budget, spec)
    seconds = time.perf_counter() - start
    return {"model": name, "policy": policy, "length": length, "path": res.summary["path"],
            "seconds": seconds, "token_steps_per_s": res.summary["token_steps_per_s"],
            "peak_rss_bytes": peak_rss_bytes(), "bound_bytes": DIAG_BOUNDS.get(name)}  # fmt: skip


def measure(policy: str, length: int, budget: int, compile: bool) -> dict:
    cmd = [sys.executable, __file__, "--one", policy, str(length), "--budget", str(budget)]
    cmd += ["--compile"] if compile else []
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default=f"8192,{2**18}", help="stream lengths (predictions), shortest first")
    ap.add_argument("--policies", default="window,streaming_llm,h2o,tova")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--full-length", type=int, default=32768, help="the full cache's stream (0: skip)")
    ap.add_argument("--compile", action="store_true", help="eval.compile: the compiled token loop")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="the engine's path (default)")
    ap.add_argument("--diag", default="smollm2_135m:h2o:4096,gpt_tiny:full:32768",
                    help="MODEL:POLICY:LENGTH rows evaluated with diagnostics on ('' to skip)")  # fmt: skip
    ap.add_argument(
        "--later-run",
        default=LATER_RUN,
        help="overrides of the later-run row: a run timed once the caches hold its subject ('' to skip)",
    )
    ap.add_argument("--one", nargs=2, metavar=("POLICY", "LENGTH"), help=argparse.SUPPRESS)
    ap.add_argument("--one-diag", nargs=3, metavar=("MODEL", "POLICY", "LENGTH"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="JSON path (default outputs/bench/long.json)")
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), args.budget, args.compile)))
        return {}
    if args.one_diag:
        name, policy, length = args.one_diag
        print(json.dumps(one_diag(name, policy, int(length), args.budget)))
        return {}
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = []
    for policy in filter(None, args.policies.split(",")):
        for length in lengths:
            rows.append(measure(policy, length, args.budget, args.compile))
            base = next(r for r in rows if r["policy"] == policy and r["length"] == lengths[0])
            r = rows[-1]
            r["rss_ratio"] = r["peak_rss_bytes"] / base["peak_rss_bytes"]
            r["speed_ratio"] = base["token_steps_per_s"] / r["token_steps_per_s"]
            print(line(rows[-1]), file=sys.stderr)
    if args.full_length:
        rows.append(measure("full", args.full_length, args.budget, args.compile))
        print(line(rows[-1]), file=sys.stderr)
    diag = []
    for row in filter(None, args.diag.split(",")):
        name, policy, length = row.split(":")
        cmd = [sys.executable, __file__, "--one-diag", name, policy, length, "--budget", str(args.budget)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        diag.append(json.loads(res.stdout.strip().splitlines()[-1]))
        print(diag_line(diag[-1]), file=sys.stderr)
    later = later_run(args.later_run) if args.later_run else None
    if later is not None:
        print(later_line(later), file=sys.stderr)
    report = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "torch": torch.__version__,
              "budget": args.budget, "compile": args.compile, "git": git_info(), "rows": rows,
              "diagnostics": diag, "later_run": later}  # fmt: skip
    save_report(report, markdown_table(report), args.out, "long.json")
    return report


def line(r: dict) -> str:
    ratios = f"  RSS x{r['rss_ratio']:.2f}  time/token x{r['speed_ratio']:.2f}" if "rss_ratio" in r else ""
    return (f"{r['policy']:14s} T={r['length']:8d} [{r['path']}] {r['token_steps_per_s']:9.0f} tok/s  "
            f"{r['seconds']:7.1f} s (compile {r['compile_seconds']:.0f} s)  "
            f"peak RSS {r['peak_rss_bytes'] / GiB:.2f} GiB{ratios}")  # fmt: skip


def within(r: dict) -> str:
    return "-" if r["bound_bytes"] is None else ("yes" if r["peak_rss_bytes"] <= r["bound_bytes"] else "NO")


def later_line(r: dict) -> str:
    bound = r["bound_seconds"]
    within = "" if bound is None else f" (bound {bound:.0f} s: {'yes' if r['seconds'] <= bound else 'NO'})"
    return (
        f"later run ({r['overrides']}) strategy={r['policy']}: {r['seconds']:.1f} s wall{within}; "
        f"the first run (strategy={r['first_policy']}, caches empty) {r['first_seconds']:.1f} s"
    )


def diag_line(r: dict) -> str:
    bound = "" if r["bound_bytes"] is None else f" (bound {r['bound_bytes'] / GiB:.0f} GiB: {within(r)})"
    return (f"diagnostics {r['model']} {r['policy']} T={r['length']} [{r['path']}] {r['seconds']:.1f} s  "
            f"peak RSS {r['peak_rss_bytes'] / GiB:.2f} GiB{bound}")  # fmt: skip


def markdown_table(report: dict) -> str:
    lines = [
        "| policy | stream length | path | token-steps/s | seconds (compile) | peak RSS | RSS vs shortest "
        "| time per token vs shortest |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for r in report["rows"]:
        ratio = f"{r['rss_ratio']:.2f}x | {r['speed_ratio']:.2f}x" if "rss_ratio" in r else "- | -"
        lines.append(f"| {r['policy']} | {r['length']:,} | {r['path']} | {r['token_steps_per_s']:,.0f} | "
                     f"{r['seconds']:.1f} ({r['compile_seconds']:.0f}) | "
                     f"{r['peak_rss_bytes'] / GiB:.2f} GiB | {ratio} |")  # fmt: skip
    if report.get("diagnostics"):
        lines += ["", "With diagnostics on (reference + stream, batch 1):", "",
                  "| model | policy | stream length | path | seconds | peak RSS | bound | within |",
                  "|---|---|---:|---|---:|---:|---:|---|"]  # fmt: skip
        for r in report["diagnostics"]:
            bound = "-" if r["bound_bytes"] is None else f"{r['bound_bytes'] / GiB:.0f} GiB"
            head = f"| {r['model']} | {r['policy']} | {r['length']:,} | {r['path']} | {r['seconds']:.1f} | "
            lines.append(head + f"{r['peak_rss_bytes'] / GiB:.2f} GiB | {bound} | {within(r)} |")
    if report.get("later_run"):
        lines += ["", later_line(report["later_run"])]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
