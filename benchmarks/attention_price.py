"""The speed price of needing attention weights: decoding through a fused attention kernel against the
explicit attention that H2O and TOVA require, same model, budget, batch and machine, in one process.

    python benchmarks/attention_price.py                          # SmolLM2, budget 256, batch 1 and 8
    python benchmarks/attention_price.py --model gpt_small --prompt 512 --budget 128 --steps 32

A fused kernel (`torch.nn.functional.scaled_dot_product_attention`; FlashAttention on a GPU) never
materialises the attention weights, so a policy that scores keys by the attention they receive (H2O's
accumulated attention, TOVA's last row) cannot run on it: it pays for the explicit softmax(q K^T) V. The
full cache and StreamingLLM read no weights and can. Each row: the same token loop (eval/loop.py), the same
prompt prefilled on the blocked path (`--prompt` tokens of random ids, speed does not depend on the text),
then `--steps` greedy decode steps timed; `kernel` is the loop's per-step attention, the engine's explicit
one or SDPA (`TokenLoop.fused_attention`, only for policies that read no weights). The SDPA rows must
write the same tokens as the explicit ones (checked). Prints decode token-steps/s per row and each against
the full cache's explicit row, best of `--repeats` passes; writes outputs/bench/attention_price.json.

On a CPU the two kernels do the same work for one query (the loop's explicit attention is two batched
matmuls, and masked SDPA was measured no faster for it, 2026-12-01), so the price is small here; on a GPU
the fused kernel is where the difference lives (a GPU session's numbers go beside these in
benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import time

import torch

from evictlab.cache import make_policy
from evictlab.eval.blocked import prefill
from evictlab.eval.engine import BLOCK_STEPS, plan
from evictlab.eval.loop import TokenLoop
from evictlab.eval.spec import PositionMode, StreamSpec
from evictlab.perf import cpu_name, save_report, set_threads
from evictlab.store import git_info

ROWS = [("full", "explicit"), ("full", "sdpa"), ("streaming_llm", "explicit"), ("streaming_llm", "sdpa")]
ROWS += [("h2o", "explicit"), ("tova", "explicit")]


def load(name: str):
    if name == "smollm2":
        from evictlab.checkpoints import get_checkpoint
        from evictlab.config import compose, to_objects

        return get_checkpoint(to_objects(compose(["model=smollm2_135m", "logger=none"]))).model.eval()
    from evictlab.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=258)).eval()


@torch.no_grad()
def decode(
    model, prompt, policy_name: str, kernel: str, budget: int, steps: int
) -> tuple[float, torch.Tensor]:
    """(seconds of `steps` greedy decode steps after a blocked prefill, the tokens written)."""
    policy = make_policy(policy_name)
    B, P = prompt.shape
    n = P + steps - 1
    p = plan(policy, budget, StreamSpec(force_loop=True), model.cfg.n_layer, n + 1)
    loop = TokenLoop(model, policy, list(p.budgets), PositionMode.original, B, n, torch.arange(B))
    prefill(model, prompt, loop, BLOCK_STEPS)
    if kernel == "sdpa":  # the same prefilled caches, decoded through the fused kernel
        loop = loop.fork(fused=True)
    tokens = torch.cat([prompt, prompt.new_zeros(B, steps)], 1)
    start = time.perf_counter()
    for t in range(P - 1, n):
        tokens[:, t + 1] = loop.decode_one_token(tokens[:, t : t + 1], t).argmax(-1)
    return time.perf_counter() - start, tokens[:, P:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["smollm2", "gpt_small"], default="smollm2")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens (prefilled, not timed)")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--out", default=None, help="JSON report path (default outputs/bench/attention_price.json)"
    )
    args = ap.parse_args()
    set_threads(args.threads)
    model = load(args.model)
    torch.manual_seed(0)
    rows = []
    for B in args.batches:
        prompt = torch.randint(0, min(model.cfg.vocab_size, 30000), (B, args.prompt))
        base, written = None, {}
        for policy, kernel in ROWS:
            best, out = float("inf"), None
            for _ in range(args.repeats):
                s, out = decode(model, prompt, policy, kernel, args.budget, args.steps)
                best = min(best, s)
            if policy in written and not torch.equal(written[policy], out):
                raise SystemExit(f"{policy}: SDPA wrote other tokens than the explicit attention")
            written.setdefault(policy, out)
            rate = B * args.steps / best
            base = base or rate
            rows.append({"batch": B, "policy": policy, "kernel": kernel, "token_steps_per_s": rate,
                         "x_full_explicit": rate / base})  # fmt: skip
            print(
                f"batch {B} {policy:14s} {kernel:8s} {rate:8.1f} token-steps/s  {rate / base:.3f}x",
                flush=True,
            )
    head = (
        f"{args.model}, prompt {args.prompt}, budget {args.budget}, {args.steps} decode steps, "
        f"{args.threads} thread(s), {cpu_name()}\n\n"
        "| batch | policy | attention | decode token-steps/s | x full cache, explicit |\n"
        "|---:|---|---|---:|---:|\n"
    )
    table = head + "\n".join(
        f"| {r['batch']} | {r['policy']} | {r['kernel']} | {r['token_steps_per_s']:.1f} | "
        f"{r['x_full_explicit']:.3f} |"
        for r in rows
    )
    report = {"args": vars(args), "git": git_info(), "cpu": cpu_name(), "rows": rows}
    save_report(report, table, args.out, "attention_price.json")


if __name__ == "__main__":
    main()
