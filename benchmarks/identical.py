"""Behaviour unchanged, shown: every engine path's per-token outputs, dumped at one commit and compared
bit for bit with another's (for refactors that must not change a number).

    PYTHONPATH=<old checkout>/src python benchmarks/identical.py dump /tmp/before.pt
    python benchmarks/identical.py dump /tmp/after.pt
    python benchmarks/identical.py compare /tmp/before.pt /tmp/after.pt

The streams: the shared policy matrix's models (tests/test_policies.py: MHA, GQA, every switch the
imported families use with partial rotary and smeared keys; plus learned absolute positions), float64,
3 streams of 40 tokens, every policy and the parameter settings that change which code runs, both
position modes, the fast path and the token loop; and SmolLM2-135M (model=smollm2_135m, float32, 2
random streams of 129 tokens, budget 32, the fast path, both modes). Per stream: NLL, KL, agreement,
occupancy and the last step attending to positions 0-3; for every policy that can generate, the same
from the answer path (a prompt of T-8 tokens, 6 written) with its written tokens, and `generate`'s.

The script is self-contained on purpose (its model matrix restates tests/test_policies.py's VARIANTS
rather than importing it): `dump` runs against an older checkout's src, which may predate any shared
helper, and the same script must build the same models at both commits.
"""

from __future__ import annotations

import argparse
import sys

import torch

from evictlab.cache import POLICIES, make_policy
from evictlab.eval import StreamSpec, full_reference, generate, stream
from evictlab.eval.engine import Answers
from evictlab.models.gpt import GPT, GPTConfig

FIELDS = ("nll", "kl", "agree", "occupancy", "last_attended")
EXTRA = {  # parameter settings that take other code (issue 27's ablations, the recompute window's sinks)
    "streaming_llm:n_sink=1,first_sink=1": ("streaming_llm", {"n_sink": 1, "first_sink": 1}),
    "recompute_window:n_sink=1": ("recompute_window", {"n_sink": 1}),
    "bos_ablation:part=value": ("bos_ablation", {"part": "value"}),
    "bos_ablation:layer=1": ("bos_ablation", {"layer": 1}),
}
CASES = {**{n: (n, {}) for n in sorted(POLICIES)}, **EXTRA}
VARIANTS = {
    "mha": {},
    "gqa": {"n_kv_head": 2},
    "families": {
        "n_kv_head": 2,
        "norm": "rmsnorm",
        "act": "swiglu",
        "bias": True,
        "rotary_dim": 4,
        "parallel_residual": True,
        "tie_embeddings": False,
        "smear_keys": True,
    },
    "learned": {"pos_emb": "learned", "block_size": 64},
}


def tiny(variant: str):
    torch.manual_seed(0)
    cfg = GPTConfig(name="t", vocab_size=40, n_layer=2, n_head=4, n_embd=32, **VARIANTS[variant])
    model = GPT(cfg).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("smear_logit"):
                p.normal_(0, 0.1 if name.endswith("bias") else 1.0)
    tokens = torch.randint(0, 40, (3, 40))
    tokens[:, 0] = 39
    return model, tokens


def smollm2():
    from evictlab.checkpoints import get_checkpoint
    from evictlab.config import compose, to_objects

    model = get_checkpoint(to_objects(compose(["model=smollm2_135m", "logger=none"]))).model.eval()
    torch.manual_seed(0)
    return model, torch.randint(0, model.cfg.vocab_size, (2, 129))


def outputs(model, tokens, budgets: list[int], loops: tuple[bool, ...], modes) -> dict[str, torch.Tensor]:
    ref = full_reference(model, tokens, attention=True)
    found = {}
    for case, (name, params) in CASES.items():
        policy = make_policy(name, **params)
        for mode in modes:
            if mode == "cache" and model.cfg.pos_emb.value != "rope":
                continue
            for loop in loops:
                if loop and (policy.ablation or policy.recompute):
                    continue
                for budget in budgets:
                    spec = StreamSpec(position_mode=mode, force_loop=loop)
                    b = max(budget, policy.min_budget())
                    out = stream(model, tokens, policy, b, spec, reference=ref)
                    for f in FIELDS:
                        value = getattr(out, f)
                        if value is not None:
                            found[f"{case}|{mode}|loop={loop}|b={budget}|{f}"] = value.detach().cpu()
                    if not policy.can_generate():
                        continue
                    # the answer path (a prompt of T-8 tokens, 6 written) and generate, as the tasks use them
                    P = tokens.shape[1] - 8
                    if not loop:
                        out = stream(model, tokens, policy, b, spec, reference=ref, answers=Answers(P, 6))
                        for f in (*FIELDS, "written"):
                            if getattr(out, f) is not None:  # (no answer path: the recompute window)
                                found[f"{case}|{mode}|answer|b={budget}|{f}"] = getattr(out, f).detach().cpu()
                    written = generate(model, tokens[:, :P], policy, b, 6, spec)
                    found[f"{case}|{mode}|loop={loop}|b={budget}|generate"] = written.detach().cpu()
    return found


def dump(path: str, with_smollm2: bool) -> None:
    found = {}
    with torch.no_grad():
        for variant in VARIANTS:
            model, tokens = tiny(variant)
            for key, value in outputs(model, tokens, [10, 40], (False, True), ("original", "cache")).items():
                found[f"{variant}|{key}"] = value
            print(f"{variant}: {len(found)} tensors so far", file=sys.stderr)
        if with_smollm2:
            model, tokens = smollm2()
            for key, value in outputs(model, tokens, [32], (False,), ("original", "cache")).items():
                found[f"smollm2|{key}"] = value
    torch.save(found, path)
    print(f"{len(found)} tensors -> {path}")


def compare(a: str, b: str) -> int:
    x, y = torch.load(a), torch.load(b)
    differ = [k for k in x if k in y and not torch.equal(x[k], y[k])]
    missing = sorted(set(x) ^ set(y))
    streams = {k.rsplit("|", 1)[0] for k in x if k in y}
    print(
        f"{len(streams)} runs, {len(x)} vs {len(y)} tensors: {len(differ)} differ, {len(missing)} in one only"
    )
    for k in differ[:20] + missing[:20]:
        print("  ", k)
    return 1 if differ or missing else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("path")
    d.add_argument("--no-smollm2", action="store_true", help="the small models only")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args()
    if args.cmd == "dump":
        dump(args.path, not args.no_smollm2)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
