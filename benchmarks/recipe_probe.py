"""Follow a training recipe step by step: does the model learn to copy, and does it grow an attention sink?

    python benchmarks/recipe_probe.py --every 150 train.steps=1500 train.seq_len=256 \\
        train.synthetic_kind=copy train.synthetic_share=0.3 train.synthetic_warmup=400

Arguments after the options are Hydra overrides of conf/ (model, train, dataset ...), as for `python -m
evictlab.train`. The model trains with `train.optimize` on `WindowSampler.for_training`, as `train_model`
does (at train.threads threads), but is not cached. Every `--every` steps it prints
one JSON line: validation loss (nats/token), induction (mean NLL on the second copy of 40 random printable
characters repeated once, against the first copy's: a copying model drives `ind2` far below `ind1`),
pass-key recall exact matches (teacher-forced, full cache, 6 streams per depth 0.1/0.5/0.9 of train.seq_len
tokens), `sink_head_fraction(_deep)`, the last query's attention on position 0 per layer and each layer's
strongest head's alpha (eval/sinks.py),
and the functional test: perplexity of 8 held-out streams of train.seq_len tokens under the full cache, a
window and StreamingLLM (4 sinks, original positions) at budget 64, with `window_over_sinks` = ppl(window)
/ ppl(StreamingLLM).
This is the instrument behind the recipe notes in experiments/streaming_quality/README.md ("How the
paper subject's recipe was found").
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from safetensors.torch import save_model

from evictlab.cache import make_policy
from evictlab.config import compose, to_objects
from evictlab.data.dataset import load_corpus
from evictlab.data.recall import recall_streams
from evictlab.data.sampler import WindowSampler
from evictlab.data.streams import eval_streams
from evictlab.errors import ConfigError
from evictlab.eval import StreamSpec, stream
from evictlab.eval.sinks import sink_metrics
from evictlab.models.gpt import GPT
from evictlab.perf import set_threads
from evictlab.train import fixed_batches, mean_loss, optimize

FUNCTIONAL_BUDGET = 64


def functional(model: GPT, streams: torch.Tensor) -> dict:
    """Perplexity of `streams` under the full cache, a window and StreamingLLM at FUNCTIONAL_BUDGET."""
    ppl = {}
    for name in ("full", "window", "streaming_llm"):
        out = stream(model, streams, make_policy(name), FUNCTIONAL_BUDGET, StreamSpec(diagnostics=False))
        ppl[name] = float(out.nll.mean().exp())
    return {f"ppl_{k}": round(v, 3) for k, v in ppl.items()} | {
        "window_over_sinks": round(ppl["window"] / ppl["streaming_llm"], 3)
    }


@torch.no_grad()
def probe(model: GPT, corpus, cfg, induction: torch.Tensor, recall, val, streams) -> dict:
    model.eval()
    nll = -torch.log_softmax(model(induction)[:, :-1], -1).gather(-1, induction[:, 1:, None])[..., 0]
    half = (induction.shape[1] - 1) // 2
    exact = None  # recall streams need a longer context than train.seq_len allows
    if recall is not None:
        pred = model(recall.tokens)[:, :-1].argmax(-1) == recall.tokens[:, 1:]
        exact = f"{sum(bool(pred[i][recall.answer[i]].all()) for i in range(len(pred)))}/{len(pred)}"
    sink, layers = sink_metrics(model, corpus, cfg.train.seq_len, cfg.model.sink_token)
    last = layers[layers.metric == "last_query_first_mass"].sort_values("layer")["value"]
    strongest = layers[layers.metric == "sink_alpha"].groupby("layer")["value"].max().sort_index()
    out = {
        "val": round(mean_loss(model, val), 4),
        "ind1": round(nll[:, 1:half].mean().item(), 3),
        "ind2": round(nll[:, half + 1 :].mean().item(), 3),
        "recall_exact": exact,
        **{k: round(v, 3) for k, v in sink.items()},
        "last_query_first_mass": [round(v, 2) for v in last],
        "strongest_alpha": [round(v, 2) for v in strongest],  # per layer, the head with most on position 0
        **functional(model, streams),
    }
    model.train()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--every", type=int, default=150)
    ap.add_argument("--save", help="write the final weights here (safetensors) for a closer look")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = to_objects(compose(["logger=none", *args.overrides]))
    tc, mc = cfg.train, cfg.model
    set_threads(tc.threads)
    corpus = load_corpus(cfg.dataset, cfg.tokenizer, cfg.outputs, min_tokens=tc.seq_len + 1)
    mc.vocab_size = corpus.tokenizer.vocab_size
    torch.manual_seed(tc.seed)
    model = GPT(mc)
    sampler = WindowSampler.for_training(corpus, tc, mc.sink_token)
    val_split = corpus.splits["val"]
    val = fixed_batches(WindowSampler(val_split, corpus, tc.seq_len, mc.sink_token, 10_000), tc, "cpu")
    rng = np.random.default_rng(123)
    segments = rng.integers(33, 127, size=(32, 40))
    bos = np.full((32, 1), corpus.tokenizer.bos_id)
    induction = torch.from_numpy(np.concatenate([bos, segments, segments], 1))
    try:
        recall = recall_streams(corpus, 6, tc.seq_len, mc.sink_token, depths=(0.1, 0.5, 0.9), seed=0)
    except ConfigError as e:
        print(f"no pass-key recall probe: {e}", flush=True)
        recall = None
    streams = eval_streams(corpus, 8, tc.seq_len, mc.sink_token, "concat", "test", seed=0)
    start = time.perf_counter()
    print(json.dumps({"overrides": args.overrides}), flush=True)

    def after_step(done: int) -> None:
        if done % args.every == 0 or done == tc.steps:
            row = {"step": done, "wall_s": round(time.perf_counter() - start)}
            print(json.dumps(row | probe(model, corpus, cfg, induction, recall, val, streams)), flush=True)

    optimize(model, tc, sampler, val, mc.name, after_step=after_step)
    if args.save:
        save_model(model, args.save)
        print(f"saved the final weights to {args.save}", flush=True)


if __name__ == "__main__":
    main()
