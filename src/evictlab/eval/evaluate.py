"""Evaluation streams from a corpus, batched evaluation of one policy, and the per-run summary."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import torch
from tqdm.auto import tqdm

from evictlab.cache.policies import Policy, make_policy
from evictlab.data.dataset import Corpus
from evictlab.errors import ConfigError
from evictlab.eval.engine import FullReference, PositionMode, budgets_for, full_reference, generate, stream
from evictlab.models.gpt import GPT
from evictlab.perf import peak_rss_bytes


class StreamSource(str, Enum):
    documents = "documents"  # each stream is one document from its start (documents must be long enough)
    concat = "concat"  # the split's documents joined by <bos>, cut into consecutive chunks


def eval_streams(
    corpus: Corpus, n_streams: int, length: int, sink_token: bool, source: StreamSource | str = "concat",
    split: str = "test", seed: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """[n_streams, length] token ids, each row starting with the corpus prefix (<sink>?, <bos>).

    `documents`: the first n_streams long-enough documents (a seed shuffles which ones). `concat`:
    consecutive chunks of the split's text, from its start (or from a seeded random offset).
    """
    source = StreamSource(source)
    prefix = corpus.prefix(sink_token)
    body = length - len(prefix)
    if body < 1 or n_streams < 1:
        raise ConfigError(
            f"eval.stream_len={length} and eval.n_streams={n_streams} must leave >= 1 text token"
        )
    sp = corpus.splits[split]
    if source is StreamSource.documents:
        rows = [sp.doc(i)[:body] for i in range(sp.n_docs) if len(sp.doc(i)) >= body]
        if seed is not None:
            rows = [rows[i] for i in np.random.default_rng(seed).permutation(len(rows))]
        if len(rows) < n_streams:
            raise ConfigError(
                f"eval.stream_len={length} is longer than the documents: only {len(rows)} of the {sp.n_docs} "
                f"{split} documents of {corpus.name!r} hold {body} tokens, eval.n_streams={n_streams} needed "
                "(use eval.stream_source=concat, a shorter stream or fewer streams)"
            )
    else:
        text = sp.stream(corpus.tokenizer.bos_id if corpus.bos else None)
        available = len(text) // body
        if available < n_streams:
            raise ConfigError(
                f"eval.stream_len={length} x eval.n_streams={n_streams} is longer than the {split} documents "
                f"of {corpus.name!r}: they hold {len(text)} tokens, {available} stream(s) of this length"
            )
        start = (
            0
            if seed is None
            else int(np.random.default_rng(seed).integers(0, len(text) - n_streams * body + 1))
        )
        rows = [text[start + i * body : start + (i + 1) * body] for i in range(n_streams)]
    out = np.stack([np.concatenate((prefix, r)) for r in rows[:n_streams]]).astype(np.int64)
    return torch.from_numpy(out)


def kv_bytes(model: GPT, policy: Policy, budget: int, stream_len: int, allocation: str = "uniform") -> int:
    """Bytes of K and V one sequence holds between steps at the end of a stream of `stream_len` tokens."""
    cfg = model.cfg
    n = stream_len - 1
    per_entry = 2 * cfg.kv_heads * cfg.head_dim * model.wte.weight.element_size()
    budgets = budgets_for(model.cfg.n_layer, policy, budget, allocation, n)
    return sum(min(b, n) for b in budgets) * per_entry


@dataclass
class EvalResult:
    per_token: dict[str, np.ndarray]  # name -> [N, n] (or [N, n, L]) arrays
    summary: dict[str, float | int | str | bool | list]
    references: list[FullReference] = field(default_factory=list, repr=False)  # reusable per batch
    attention_by_key: np.ndarray | None = None  # [L, n] full-cache attention by key position


def evaluate(
    model: GPT,
    tokens: torch.Tensor,
    policy: Policy,
    budget: int,
    *,
    position_mode: PositionMode | str = PositionMode.original,
    allocation: str = "uniform",
    batch_size: int = 16,
    diagnostics: bool = True,
    force_loop: bool = False,
    progress: bool = False,
    references: list[FullReference] | None = None,
) -> EvalResult:
    """Stream every row of tokens [N, T] under the policy, in batches, against the full cache.

    `references` (one per batch, from an earlier call's `.references`) lets a sweep compute the
    full-cache run once and reuse it for every policy on the same streams.
    """
    N, T = tokens.shape
    n = T - 1
    outs, refs = [], []
    start = time.perf_counter()
    if references is not None:  # reuse the batches the references were computed on
        sizes = [r.logp.shape[0] for r in references]
        if sum(sizes) != N:
            raise ValueError(f"references cover {sum(sizes)} streams, tokens has {N}")
    else:
        sizes = [min(batch_size, N - b0) for b0 in range(0, N, batch_size)]
    batches = [sum(sizes[:i]) for i in range(len(sizes))]
    for i, b0 in enumerate(
        tqdm(batches, desc=f"{policy.name} b={budget}", disable=not progress, unit="batch")
    ):
        batch = tokens[b0 : b0 + sizes[i]]
        reusable = references is not None and (references[i].future is not None or not policy.needs_future)
        if reusable:
            ref = references[i]
        else:
            ref = full_reference(model, batch, attention=diagnostics or policy.needs_future,
                                 future=policy.needs_future)  # fmt: skip
        refs.append(ref)
        doc = torch.arange(b0, b0 + batch.shape[0], device=tokens.device)
        outs.append(
            stream(
                model,
                batch,
                policy,
                budget,
                position_mode=position_mode,
                allocation=allocation,
                reference=ref,
                force_loop=force_loop,
                doc=doc,
            )  # fmt: skip
        )
    seconds = time.perf_counter() - start

    def cat(name: str) -> np.ndarray | None:
        parts = [getattr(o, name) for o in outs]
        return None if parts[0] is None else torch.cat(parts).float().cpu().numpy()

    names = ("nll", "correct", "kl", "agree", "lost", "sink_mass")
    per_token = {k: v for k in names if (v := cat(k)) is not None}
    nll = per_token["nll"]
    half = n // 2
    o0 = outs[0]
    summary: dict = {
        "strategy": policy.name,
        "strategy_label": policy.label,
        "non_causal": policy.needs_future,
        "strategy_params": policy.params(),
        "budget": budget if policy.evicts else n,  # the full cache holds every scored position
        "budget_fraction": (budget if policy.evicts else n) / n,
        "layer_budgets": o0.budgets,
        "position_mode": PositionMode(position_mode).value,
        "allocation": allocation,
        "path": o0.path,
        "n_streams": N,
        "stream_len": T,
        "scored_tokens": int(nll.size),
        "ppl": math.exp(float(nll.mean())),
        "ppl_second_half": math.exp(float(nll[:, half:].mean())),
        "nll_mean": float(nll.mean()),
        "top1_accuracy": float(per_token["correct"].mean()),
        "occupancy_max": int(o0.occupancy.max()),
        "kv_bytes": kv_bytes(model, policy, budget, T, allocation),
        "kv_bytes_full": kv_bytes(model, make_policy("full"), 0, T),
        "peak_rss_bytes": peak_rss_bytes(),
        "seconds": seconds,
        "token_steps_per_s": N * n / sum(o.seconds for o in outs),
        "policy_time_share": sum(o.policy_seconds for o in outs) / max(1e-12, sum(o.seconds for o in outs)),
    }
    if "kl" in per_token:
        full_nll = torch.cat(
            [
                -r.logp.gather(-1, tokens[b0 : b0 + r.logp.shape[0], 1:, None].to(r.logp.device))[..., 0]
                for r, b0 in zip(refs, batches, strict=True)
            ]  # fmt: skip
        )
        per_token["nll_full"] = full_nll.float().cpu().numpy()
        summary |= {
            "kl_mean": float(per_token["kl"].mean()),
            "agreement": float(per_token["agree"].mean()),
            "ppl_full": math.exp(float(per_token["nll_full"].mean())),
            "delta_nll": float((per_token["nll"] - per_token["nll_full"]).mean()),
        }
    if "lost" in per_token:
        summary["attention_lost"] = float(per_token["lost"].mean())
        summary["attention_lost_per_layer"] = per_token["lost"].mean(axis=(0, 1)).tolist()
    if "sink_mass" in per_token:
        summary["sink_mass_per_layer"] = per_token["sink_mass"].mean(axis=(0, 1)).tolist()
        first = [r.first_position_mass().float().cpu() * r.logp.shape[0] for r in refs]  # weight by streams
        per_head = (torch.stack(first).sum(0) / N).numpy()  # [L, H]
        summary["first_position_mass_per_head"] = per_head.reshape(-1).tolist()  # layer-major: l * H + h
    by_key = [r.attention_by_key() for r in refs]
    attention_by_key = None
    if by_key and by_key[0] is not None:  # weight each batch by its number of streams
        w = torch.tensor([float(r.logp.shape[0]) for r in refs])
        stacked = torch.stack([b.float().cpu() for b in by_key])
        attention_by_key = ((stacked * w[:, None, None]).sum(0) / w.sum()).numpy()
    return EvalResult(per_token, summary, refs, attention_by_key)


def greedy_divergence(
    model: GPT, tokens: torch.Tensor, policy: Policy, budget: int, n_new: int, *,
    position_mode: PositionMode | str = PositionMode.original, allocation: str = "uniform",
    batch_size: int = 16,
) -> dict[str, np.ndarray]:  # fmt: skip
    """Greedy continuations of each stream's first T - n_new tokens under the policy and under the full
    cache: per stream, the first step where they differ (n_new if never) and the share of steps that
    agree, plus both token arrays [N, n_new]."""
    N, T = tokens.shape
    if not 1 <= n_new < T:
        raise ConfigError(f"eval.generate_tokens={n_new} must be in [1, eval.stream_len)")
    full = make_policy("full")
    ours, theirs = [], []
    for b0 in range(0, N, batch_size):
        prompt = tokens[b0 : b0 + batch_size, : T - n_new]
        doc = torch.arange(b0, b0 + prompt.shape[0], device=tokens.device)
        kw = {"position_mode": position_mode, "allocation": allocation, "doc": doc}
        ours.append(generate(model, prompt, policy, budget, n_new, **kw))
        theirs.append(generate(model, prompt, full, budget, n_new, **kw))
    p, f = torch.cat(ours).cpu().numpy(), torch.cat(theirs).cpu().numpy()
    same = p == f
    first = np.where(same.all(1), n_new, np.argmin(same, axis=1))
    return {"policy_tokens": p, "full_tokens": f, "first_divergence": first, "agreement": same.mean(1)}


def recall_accuracy(
    model: GPT, batch, policy: Policy, budget: int, *,
    position_mode: PositionMode | str = PositionMode.original, allocation: str = "uniform",
    batch_size: int = 16, result: EvalResult | None = None,
):  # fmt: skip
    """Per recall stream (data/recall.py): teacher-forced accuracy on the answer tokens, exact match
    teacher-forced and by greedy decoding under the policy, and the stream's perplexity.

    `result`: an `evaluate` of these streams already made (its per-token arrays are reused).
    Returns a pandas frame with one row per stream (the oracle gets no greedy column: it cannot generate).
    """
    import pandas as pd

    res = result or evaluate(model, batch.tokens, policy, budget, position_mode=position_mode,
                             allocation=allocation, batch_size=batch_size, diagnostics=False)  # fmt: skip
    mask = batch.answer.numpy()
    correct, nll = res.per_token["correct"], res.per_token["nll"]
    frame = pd.DataFrame({
        "stream": np.arange(len(mask)), "depth": batch.depth, "needle_pos": batch.needle_pos,
        "token_accuracy": [correct[i][mask[i]].mean() for i in range(len(mask))],
        "exact_teacher_forced": [bool(correct[i][mask[i]].all()) for i in range(len(mask))],
        "answer_nll": [nll[i][mask[i]].mean() for i in range(len(mask))],
        "ppl": np.exp(nll.mean(axis=1)),
    })  # fmt: skip
    if not policy.needs_future:
        exact = np.zeros(len(mask), dtype=bool)
        for start in np.unique(batch.answer_start):  # streams whose answers start at one position
            for n in np.unique(batch.answer_len[batch.answer_start == start]):
                rows = np.flatnonzero((batch.answer_start == start) & (batch.answer_len == n))
                for r0 in range(0, len(rows), batch_size):
                    idx = torch.from_numpy(rows[r0 : r0 + batch_size])
                    prompt = batch.tokens[idx, :start]
                    out = generate(model, prompt, policy, budget, int(n), position_mode=position_mode,
                                   allocation=allocation, doc=idx)  # fmt: skip
                    exact[idx.numpy()] = (out == batch.tokens[idx, start : start + n]).all(1).numpy()
        frame["exact_greedy"] = exact
    return frame
