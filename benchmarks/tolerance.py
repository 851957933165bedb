"""How far two settings that reorder floating-point reductions move the numbers (issue 14).

    python benchmarks/tolerance.py

`eval.batch_size` is KEYLESS (config.py): it cannot change what a run means, but it changes the order of
floating-point reductions; `train.threads` does too, and since it changes the weights' bits it is in the
checkpoint key (two counts are two checkpoints): this measures how far apart those two land. It trains
gpt_small for 100 steps (train=short with steps=100) once with 1 thread and once with 2, each into its own
outputs folder, and evaluates both on the same 8 streams of 512 tokens (full cache and h2o at budget 64)
with eval batch sizes 1 and 16. Prints the largest per-token |dNLL| and the |d mean NLL| of each pair.
"""

from __future__ import annotations

import dataclasses
import tempfile

import numpy as np
import torch

from evictlab.checkpoints import get_checkpoint
from evictlab.config import compose, to_objects
from evictlab.data.dataset import load_corpus
from evictlab.data.streams import eval_streams
from evictlab.eval.evaluate import evaluate

BASE = ["model=gpt_small", "train=short", "train.steps=100", "train.warmup_steps=10", "logger=none"]


def main() -> None:
    nll = {}
    with tempfile.TemporaryDirectory() as tmp:
        for threads in (1, 2):
            cfg = to_objects(compose([*BASE, f"train.threads={threads}", f"paths.outputs={tmp}/t{threads}"]))
            ck = get_checkpoint(cfg)
            corpus = load_corpus(cfg.dataset, cfg.tokenizer, cfg.outputs)
            tokens = eval_streams(corpus, 8, 512, False, "concat", "test", seed=0)
            torch.set_num_threads(1)
            for strategy in ("full", "h2o"):
                run = to_objects(compose([*BASE, f"strategy={strategy}", "budget=b64"]))
                for batch in (1, 16):
                    spec = dataclasses.replace(run.eval.spec(), batch_size=batch)
                    res = evaluate(ck.model, tokens, run.strategy.build(), 64, spec)
                    nll[threads, strategy, batch] = res.per_token["nll"]
    print("pair                               max per-token |dNLL|   |d mean NLL|")
    for strategy in ("full", "h2o"):
        for name, a, b in (
            ("train.threads 1 vs 2", (1, strategy, 16), (2, strategy, 16)),
            ("eval.batch_size 1 vs 16", (1, strategy, 1), (1, strategy, 16)),
        ):
            d = np.abs(nll[a] - nll[b]).max()
            m = abs(float(nll[a].mean()) - float(nll[b].mean()))
            print(f"{name + ', ' + strategy:<34} {d:>20.2e} {m:>14.2e}")


if __name__ == "__main__":
    main()
