"""The engine on a real 30-layer model, against the way streaming-llm evaluates one (make bench, second part).

    python benchmarks/bench_smollm2.py                       # batch 1 and 8, 512 tokens, budget 64
    python benchmarks/bench_smollm2.py --length 256 --batches 1 --peer-length 64

Workload: SmolLM2-135M-Instruct (model=smollm2_135m; converted into the checkpoint cache on first use),
`--threads` torch threads, random token streams of `--length` tokens (speed does not depend on the text),
budget `--budget`, diagnostics off, no full-cache reference (the engine alone). Rows, each in a fresh
process (its peak RSS its own), each the best of `--repeats` passes (default 2, the same for every row):

* evictlab: StreamingLLM (4 sinks; the parallel path) and H2O (the blocked path) at batch 1 and 8, with
  token-steps/s and the share of the FLOP floor (useful forward FLOPs per token x rate / the rate of a
  1024^3 matmul measured in the same run);
* the peer: transformers' own GGUF load of the same file, decoding the first stream token by token with a
  DynamicCache trimmed after every step to the first 4 entries + the most recent (budget - 4), as
  streaming-llm's evaluation does (each token at its text position: original positions).

Writes outputs/bench/smollm2.json and prints the table benchmarks/README.md quotes, with the issue's
targets: >= 20x the peer on the parallel path and >= 10x on the blocked path at batch 1; >= 50% / >= 35%
of the FLOP floor at batch 8.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from evictlab.perf import cpu_name, matmul_flops_per_s, peak_rss_bytes, save_report, set_threads
from evictlab.store import git_info

GiB = 1024**3
N_SINK = 4
PEER_TARGET = {"parallel": 20.0, "blocked": 10.0}  # x the peer's token-steps/s at batch 1
FLOOR_TARGET = {"parallel": 0.50, "blocked": 0.35}  # share of the FLOP floor at batch 8
POLICIES = {"streaming_llm": "parallel", "h2o": "blocked"}


def load(threads: int):
    from evictlab.checkpoints import get_checkpoint
    from evictlab.config import compose, to_objects

    set_threads(threads)
    cfg = to_objects(compose(["model=smollm2_135m", "logger=none"]))
    return cfg, get_checkpoint(cfg).model


def streams(vocab: int, batch: int, length: int, bos: int = 1) -> torch.Tensor:
    torch.manual_seed(0)
    tokens = torch.randint(3, vocab, (batch, length))
    tokens[:, 0] = bos
    return tokens


def engine_row(policy: str, batch: int, length: int, budget: int, threads: int, repeats: int = 1) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_engine import forward_flops_per_token

    from evictlab.cache import make_policy
    from evictlab.eval import StreamSpec
    from evictlab.eval.evaluate import evaluate

    _, model = load(threads)
    tokens = streams(model.cfg.vocab_size, batch, length)
    spec = StreamSpec(diagnostics=False, batch_size=batch)
    runs = [evaluate(model, tokens, make_policy(policy), budget, spec) for _ in range(repeats)]
    res = max(runs, key=lambda r: r.summary["token_steps_per_s"])  # the best of `repeats`, as for the peer
    rate = res.summary["token_steps_per_s"]
    floor, useful = matmul_flops_per_s(seconds=1.0), forward_flops_per_token(model, budget, length, False)
    return {"runner": "evictlab", "policy": policy, "path": res.summary["path"], "batch": batch,
            "token_steps_per_s": rate, "floor_fraction": rate * useful / floor, "matmul_flops_per_s": floor,
            "peak_rss_bytes": peak_rss_bytes()}  # fmt: skip


@torch.no_grad()
def peer_row(length: int, budget: int, threads: int, repeats: int = 1) -> dict:
    """transformers decoding token by token, its cache trimmed to sinks + recent after every step (the
    fastest of `repeats` passes, each with a fresh cache)."""
    import transformers

    from evictlab.models import gguf

    cfg, _ = load(threads)
    file = gguf.locate(cfg.model.name_or_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(file.path.parent), gguf_file=file.path.name, dtype=torch.float32
    ).eval()
    tokens = streams(hf.config.vocab_size, 1, length)
    times = []
    for _ in range(repeats):
        cache = transformers.DynamicCache(config=hf.config)
        start = time.perf_counter()
        for t in range(length - 1):
            hf(tokens[:, t : t + 1], cache=cache, use_cache=True, position_ids=torch.tensor([[t]]))
            for layer in cache.layers:
                if layer.keys.shape[2] > budget:  # StreamingLLM's trim: the first N_SINK and the last ones
                    keep = budget - N_SINK
                    layer.keys = torch.cat([layer.keys[:, :, :N_SINK], layer.keys[:, :, -keep:]], 2)
                    layer.values = torch.cat([layer.values[:, :, :N_SINK], layer.values[:, :, -keep:]], 2)
        times.append(time.perf_counter() - start)
    seconds = min(times)
    return {"runner": "transformers", "policy": "streaming_llm (trimmed DynamicCache)", "path": "token loop",
            "batch": 1, "token_steps_per_s": (length - 1) / seconds, "floor_fraction": None,
            "peak_rss_bytes": peak_rss_bytes()}  # fmt: skip


def fresh(args: list[str]) -> dict:
    res = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--peer-length", type=int, default=512, help="tokens the transformers peer decodes")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=2, help="passes per row; each row reports its best")
    ap.add_argument("--engine-one", nargs=2, metavar=("POLICY", "BATCH"), help=argparse.SUPPRESS)
    ap.add_argument("--peer-one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="JSON path (default outputs/bench/smollm2.json)")
    args = ap.parse_args(argv)
    common = ["--budget", str(args.budget), "--threads", str(args.threads), "--repeats", str(args.repeats)]
    if args.engine_one:
        policy, batch = args.engine_one
        row = engine_row(policy, int(batch), args.length, args.budget, args.threads, args.repeats)
        print(json.dumps(row))
        return {}
    if args.peer_one:
        print(json.dumps(peer_row(args.peer_length, args.budget, args.threads, args.repeats)))
        return {}
    rows = [fresh(["--peer-one", "--peer-length", str(args.peer_length), *common])]
    print(line(rows[-1]), file=sys.stderr)
    for batch in [int(b) for b in args.batches.split(",")]:
        for policy in POLICIES:
            rows.append(fresh(["--engine-one", policy, str(batch), "--length", str(args.length), *common]))
            r = rows[-1]
            r["vs_peer"] = r["token_steps_per_s"] / rows[0]["token_steps_per_s"] if batch == 1 else None
            r["target_vs_peer"] = PEER_TARGET[r["path"]] if batch == 1 else None
            r["target_floor_fraction"] = FLOOR_TARGET[r["path"]] if batch > 1 else None
            print(line(r), file=sys.stderr)
    report = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "torch": torch.__version__,
              "workload": vars(args), "git": git_info(), "rows": rows}  # fmt: skip
    save_report(report, markdown_table(report), args.out, "smollm2.json")
    return report


def line(r: dict) -> str:
    extra = f"  x{r['vs_peer']:.1f} the peer" if r.get("vs_peer") else ""
    floor = "" if r["floor_fraction"] is None else f"  floor {100 * r['floor_fraction']:.1f}%"
    rss = f"peak RSS {r['peak_rss_bytes'] / GiB:.2f} GiB"
    return (f"{r['runner']:12s} {r['policy']:38s} [{r['path']}] batch {r['batch']}: "
            f"{r['token_steps_per_s']:8.1f} tok/s{floor}{extra}  {rss}")  # fmt: skip


def markdown_table(report: dict) -> str:
    lines = [
        "| runner | policy | path | batch | token-steps/s | x peer (target) | FLOP floor (target) "
        "| peak RSS |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        vs = "-" if not r.get("vs_peer") else f"{r['vs_peer']:.1f}x ({r['target_vs_peer']:.0f}x)"
        fl = "-" if r["floor_fraction"] is None else f"{100 * r['floor_fraction']:.1f}%"
        if r.get("target_floor_fraction"):
            fl += f" ({100 * r['target_floor_fraction']:.0f}%)"
        rss = f"{r['peak_rss_bytes'] / GiB:.2f} GiB"
        lines.append(f"| {r['runner']} | {r['policy']} | {r['path']} | {r['batch']} | "
                     f"{r['token_steps_per_s']:,.1f} | {vs} | {fl} | {rss} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
