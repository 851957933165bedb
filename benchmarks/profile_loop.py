"""Where a token-loop step spends its time (torch.profiler), at make bench's shapes.

    python benchmarks/profile_loop.py h2o original          # policy, position mode (the token loop)
    python benchmarks/profile_loop.py h2o original --engine auto   # the path the engine picks (blocked)
    python benchmarks/profile_loop.py streaming_llm cache --tokens 256 --docs 64
    python benchmarks/profile_loop.py h2o cache --engine auto --tokens 1024 --no-profile   # tok/s only

gpt_small with random weights, `--docs` documents x `--tokens` tokens, budget 128, 1 thread, diagnostics
off, the token loop forced (`--engine loop`, the default) or the engine's own choice (`--engine auto`).
Prints tokens/s and ms per step of an unprofiled pass, then the profiler's table of aten ops by self
CPU time for a second pass.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from evictlab.cache import make_policy
from evictlab.eval import StreamSpec, stream
from evictlab.eval.spec import PositionMode
from evictlab.models.gpt import GPT, GPTConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("policy")
    ap.add_argument("mode", choices=[m.value for m in PositionMode])
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--rows", type=int, default=20)
    ap.add_argument("--engine", choices=["loop", "auto"], default="loop")
    ap.add_argument("--no-profile", action="store_true", help="only the unprofiled pass's tokens/s")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=258)).eval()
    tokens = torch.randint(0, 256, (args.docs, args.tokens + 1))
    spec = StreamSpec(
        position_mode=PositionMode(args.mode),
        batch_size=args.docs,
        diagnostics=False,
        force_loop=args.engine == "loop",
    )
    policy = make_policy(args.policy)
    stream(model, tokens[:, :64], policy, args.budget, spec)  # warm-up
    start = time.perf_counter()
    path = stream(model, tokens, policy, args.budget, spec).path
    seconds = time.perf_counter() - start
    steps = args.tokens
    rate, step_ms = args.docs * steps / seconds, seconds / steps * 1e3
    print(f"{args.policy} {args.mode} [{path}]: {rate:,.0f} tok/s, {step_ms:.2f} ms/step")
    if args.no_profile:
        return
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        stream(model, tokens, policy, args.budget, spec)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
