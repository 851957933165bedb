"""Batched evaluation of one policy against the full cache, the per-run summary and per-layer table, and
the task metrics built on the engine (greedy divergence from the full cache, pass-key recall, the
long-context tasks of data/tasks)."""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from evictlab.cache.budget import budgets_for
from evictlab.cache.policies import Policy, full_cache
from evictlab.errors import ConfigError
from evictlab.eval.caches import held_share
from evictlab.eval.engine import Answers, DecodeClock, StreamOutput, generate, stream
from evictlab.eval.full import FullAttention, FullReference, full_reference
from evictlab.eval.progress import StreamProgress, duration
from evictlab.eval.shared import SharedReferences
from evictlab.eval.spec import DEFAULT, StreamSpec, check_reference_cap, sampled_steps
from evictlab.eval.static import full_logp
from evictlab.models.gpt import GPT
from evictlab.perf import peak_rss_bytes

log = logging.getLogger(__name__)

PER_TOKEN = ("nll", "correct", "kl", "agree", "lost", "first4_mass")  # StreamOutput fields kept per token


def kv_bytes(model: GPT, policy: Policy, budget: int, stream_len: int, spec: StreamSpec = DEFAULT) -> int:
    """Bytes of K and V one sequence holds between steps at the end of a stream of `stream_len` tokens."""
    cfg, n = model.cfg, stream_len - 1
    per_entry = 2 * cfg.kv_heads * cfg.head_dim * model.wte.weight.element_size()
    return sum(min(b, n) for b in budgets_for(cfg.n_layer, policy, budget, spec.allocation, n)) * per_entry


@dataclass
class EvalResult:
    per_token: dict[str, np.ndarray]  # name -> [N, n] (or [N, n, L]) arrays
    summary: dict[str, float | int | str | bool]  # scalars only
    layers: pd.DataFrame  # tidy per-layer (and per-head) values: layer, head, metric, value
    attention_by_key: np.ndarray | None = None  # [L, n] full-cache attention by key position
    written: np.ndarray | None = None  # [N, n_new] answers written on the answer path (`Answers`)


@dataclass
class KeptReference:
    """What a run keeps of one batch's full-cache reference once the batch is streamed: the full cache's
    NLL of each true next token and its attention summaries, not its log-probs over the vocabulary (for
    SmolLM2, 2 streams x 12,288 predictions x 49,152 = 4.8 GB per batch: a run of two batches held both
    until it ended, 11.8 GB of RSS), nor the queries and keys the oracle's reference holds (every layer's,
    and the oracle's rows: by their shapes about 1.3 GB per batch of 5 x 2,047 tokens; smollm2_tasks'
    oracle run of 10 batches, which kept them all, reached 22.8 GiB of RSS; its first 15 streams, 3
    batches, now peak at 6.95 GB instead of 9.36, every metric the same, 2026-12-07)."""

    streams: int  # rows of the batch
    nll: np.ndarray  # [B, m] float32, m = the predictions the reference covers
    attention: FullAttention | None

    @staticmethod
    def of(ref: FullReference, batch: torch.Tensor) -> KeptReference:
        B, m = ref.logp.shape[:2]
        tgt = batch[:, 1 : m + 1, None].to(ref.logp.device)
        nll = (-ref.logp.gather(-1, tgt)[..., 0]).float().cpu().numpy()
        return KeptReference(B, nll, None if ref.attention is None else ref.attention.summaries())


@dataclass
class Batches:
    """What streaming every batch produced: one StreamOutput and what is kept of its full-cache reference."""

    starts: list[int]  # first row of each batch
    outs: list[StreamOutput]
    refs: list[KeptReference]
    seconds: float

    def cat(self, name: str) -> np.ndarray | None:
        parts = [getattr(o, name) for o in self.outs]
        return None if parts[0] is None else torch.cat(parts).float().cpu().numpy()

    def sizes(self) -> list[int]:
        """Streams per batch (the weights of per-batch means)."""
        return [r.streams for r in self.refs]


def reference_for(
    model: GPT, batch: torch.Tensor, policy: Policy, spec: StreamSpec, shared: SharedReferences | None = None
) -> FullReference:
    """The full-cache run of a batch over its first spec.full_max_len predictions: with attention weights
    when diagnostics (or the policy) need them, else chunked over a growing KV cache (no [T, T] matrix),
    read from `shared` when another run has computed it (eval/shared.py)."""
    batch, attention = reference_rows(batch, spec), reference_attention(policy, spec)

    def compute() -> FullReference:
        if attention:
            return full_reference(model, batch, attention=True)
        return FullReference(logp=full_logp(model, batch, spec.block))

    return compute() if shared is None else shared.reference(model, batch, spec, attention, compute)


def reference_rows(batch: torch.Tensor, spec: StreamSpec) -> torch.Tensor:
    """The tokens a batch's full-cache reference covers: its first spec.full_max_len predictions."""
    return batch[:, : spec.full_max_len + 1]


def reference_attention(policy: Policy, spec: StreamSpec) -> bool:
    """Whether a batch's full-cache run keeps its attention: diagnostics, or a policy reading the future."""
    return spec.diagnostics or policy.needs_future


def batch_order(model, tokens, policy, spec, shared: SharedReferences | None) -> Iterator[int]:
    """The first rows of the batches in the order they stream: in row order, except that a batch whose
    shared reference another process is computing goes after the batches it can start now (see
    `SharedReferences.busy`); when every pending batch waits on another process, the first one."""
    pending = list(range(0, tokens.shape[0], spec.batch_size))
    attention = reference_attention(policy, spec)

    def busy(b0: int) -> bool:
        batch = reference_rows(tokens[b0 : b0 + spec.batch_size], spec)
        return shared is not None and shared.busy(model, batch, spec, attention)

    while pending:
        b0 = next((b0 for b0 in pending if not busy(b0)), pending[0])
        pending.remove(b0)
        yield b0


def run_batches(
    model: GPT,
    tokens: torch.Tensor,
    policy: Policy,
    budget: int,
    spec: StreamSpec,
    shared: SharedReferences | None = None,
    answers: Answers | None = None,
) -> Batches:
    """Stream every row of tokens [N, T] under the policy, spec.batch_size rows at a time, each batch
    against its own full-cache run (writing `answers` on the way, where given)."""
    check_reference_cap(policy, tokens.shape[1] - 1, spec)
    done: dict[int, tuple[StreamOutput, KeptReference]] = {}
    start = time.perf_counter()
    N, T = tokens.shape
    n_batches = -(-N // spec.batch_size)
    steps = len(sampled_steps(T - 1, spec.recompute_sample)) if policy.recompute else T - 1
    progress = StreamProgress(N * steps, f"{policy.name} b={budget}", bar=spec.progress)
    for b0 in batch_order(model, tokens, policy, spec, shared):
        batch = tokens[b0 : b0 + spec.batch_size]
        i = b0 // spec.batch_size
        what = f"{policy.name} b={budget}, batch {i + 1}/{n_batches} ({batch.shape[0]} x {T:,} tokens)"
        t0 = time.perf_counter()
        ref = reference_for(model, batch, policy, spec, shared)
        log.info("%s: full-cache reference ready in %s", what, duration(time.perf_counter() - t0))
        doc = torch.arange(b0, b0 + batch.shape[0], device=tokens.device)
        progress.resume()
        out = stream(
            model, batch, policy, budget, spec, reference=ref, doc=doc, tick=progress, answers=answers
        )
        progress.pause()
        log.info("%s: streamed in %s on the %s path", what, duration(out.seconds), out.path)
        done[b0] = out, KeptReference.of(ref, batch)
        del ref  # (its log-probs go before the next batch's arrive)
        gc.collect()  # (and whatever a batch's loops left in reference cycles)
    progress.close()
    starts = sorted(done)
    outs, refs = [done[b0][0] for b0 in starts], [done[b0][1] for b0 in starts]
    return Batches(starts, outs, refs, time.perf_counter() - start)


def collect_per_token(b: Batches) -> dict[str, np.ndarray]:
    """The per-token arrays of every batch, joined: [N, n] (or [N, n, L]) each, plus the full cache's NLL."""
    per_token = {k: v for k in PER_TOKEN if (v := b.cat(k)) is not None}
    if "kl" in per_token:
        full = np.full(per_token["nll"].shape, np.nan, dtype=np.float32)  # NaN past the reference's cap
        for r, b0 in zip(b.refs, b.starts, strict=True):
            full[b0 : b0 + r.streams, : r.nll.shape[1]] = r.nll
        full[np.isnan(per_token["nll"])] = np.nan  # steps a sampled run did not score: neither side
        per_token["nll_full"] = full
    return per_token


def summarize(model, policy, budget, spec, tokens, b: Batches, per_token) -> dict:
    """The run's scalar summary: what ran, quality (vs the full cache where computed), memory and speed."""
    N, T = tokens.shape
    n, nll, o0 = T - 1, per_token["nll"], b.outs[0]
    held = budget if policy.evicts else n  # the full cache holds every scored position
    stream_s = sum(o.seconds for o in b.outs)
    compile_s = sum(o.compile_seconds for o in b.outs)  # eval.compile: a fixed cost, kept out of the rate
    summary = policy.facts() | {
        "strategy_params": policy.params(),
        "budget": held,
        "budget_fraction": held / n,
        "position_mode": spec.position_mode.value,
        "allocation": spec.allocation.value,
        "path": o0.path,
        "block": o0.block,
        "n_streams": N,
        "stream_len": T,
        # (a sampled recompute run, eval.recompute_sample, scores some steps: NaN at the others)
        "scored_tokens": int(np.isfinite(nll).sum()),
        "ppl": math.exp(float(np.nanmean(nll))),
        "ppl_second_half": math.exp(float(np.nanmean(nll[:, n // 2 :]))),
        "nll_mean": float(np.nanmean(nll)),
        "top1_accuracy": float(np.nanmean(per_token["correct"])),
        "occupancy_max": int(o0.occupancy.max()),
        "kv_bytes": kv_bytes(model, policy, budget, T, spec),
        "kv_bytes_full": kv_bytes(model, full_cache(), 0, T),
        "peak_rss_bytes": peak_rss_bytes(),
        "seconds": b.seconds,
        "token_steps_per_s": int(np.isfinite(nll).sum()) / max(1e-12, stream_s - compile_s),
        "compile_s": compile_s,
        # a compiled step fuses the policy into the layer: its time cannot be told apart (NaN)
        "policy_time_share": (
            float("nan") if compile_s else sum(o.policy_seconds for o in b.outs) / max(1e-12, stream_s)
        ),
    }
    if "kl" in per_token:  # over the steps the full-cache reference covers
        covered = ~np.isnan(per_token["nll_full"])
        summary |= {
            "full_reference_len": max(r.nll.shape[1] for r in b.refs),
            "kl_mean": float(np.nanmean(per_token["kl"])),
            "agreement": float(np.nanmean(per_token["agree"])),
            "ppl_full": math.exp(float(np.nanmean(per_token["nll_full"]))),
            "delta_nll": float((per_token["nll"] - per_token["nll_full"])[covered].mean()),
        }
    if "lost" in per_token:
        summary["attention_lost"] = float(np.nanmean(per_token["lost"]))
    return summary


def held_shares(b: Batches, n: int) -> np.ndarray | None:
    """[L, N_FIRST]: per layer, the share of the steps t >= p at which the policy's cache holds position p
    (its query attends to it), over the streams and KV heads (`caches.held_share`)."""
    last = b.cat("last_attended")
    if last is None:
        return None
    return held_share(torch.from_numpy(last).long(), n).mean(dim=(0, 2)).numpy()


def layer_table(b: Batches, per_token: dict[str, np.ndarray]) -> pd.DataFrame:
    """Tidy per-layer values (head <NA>) and per-head ones: each layer's budget, the attention it lost, the
    share of steps it holds each of positions 0-3 (held_p0 .. held_p3), the full cache's attention on
    positions 0-3 (first4_mass, per layer) and on position 0 (per head)."""
    budgets = b.outs[0].budgets
    rows = [{"layer": l, "head": None, "metric": "budget", "value": float(x)} for l, x in enumerate(budgets)]
    held = held_shares(b, per_token["nll"].shape[1])
    if held is not None:
        rows += [
            {"layer": l, "head": None, "metric": f"held_p{p}", "value": float(held[l, p])}
            for l in range(held.shape[0])
            for p in range(held.shape[1])
        ]
    for name, metric in (("lost", "attention_lost"), ("first4_mass", "first4_mass")):
        if name in per_token:
            by_layer = np.nanmean(per_token[name], axis=(0, 1))
            rows += [
                {"layer": l, "head": None, "metric": metric, "value": float(x)}
                for l, x in enumerate(by_layer)
            ]
    if b.refs[0].attention is not None:
        first = [r.attention.first_position_mass().float().cpu() * r.streams for r in b.refs]  # by streams
        per_head = (torch.stack(first).sum(0) / sum(b.sizes())).numpy()  # [L, H]
        rows += [
            {"layer": l, "head": h, "metric": "first_position_mass", "value": float(per_head[l, h])}
            for l in range(per_head.shape[0])
            for h in range(per_head.shape[1])
        ]
    frame = pd.DataFrame(rows, columns=["layer", "head", "metric", "value"])
    return frame.astype({"layer": "int64", "head": "Int64", "value": "float64"})


def attention_by_key(b: Batches) -> np.ndarray | None:
    """[L, n] mean full-cache attention by key position, each batch weighted by its number of streams."""
    if b.refs[0].attention is None:
        return None
    by_key = [r.attention.attention_by_key() for r in b.refs]
    w = torch.tensor([float(size) for size in b.sizes()])
    stacked = torch.stack([x.float().cpu() for x in by_key])
    return ((stacked * w[:, None, None]).sum(0) / w.sum()).numpy()


def evaluate(
    model: GPT,
    tokens: torch.Tensor,
    policy: Policy,
    budget: int,
    spec: StreamSpec = DEFAULT,
    shared: SharedReferences | None = None,
    answers: Answers | None = None,
) -> EvalResult:
    """Stream every row of tokens [N, T] under the policy, in batches, against the full cache (its
    log-probs read from `shared` when another run of the sweep computed them); `answers`: also write
    them where the policy can generate (EvalResult.written)."""
    b = run_batches(model, tokens, policy, budget, spec, shared, answers)
    per_token = collect_per_token(b)
    summary = summarize(model, policy, budget, spec, tokens, b, per_token)
    layers = layer_table(b, per_token)
    held = layers.loc[layers["metric"] == "held_p0", "value"]
    if len(held):  # the share of steps whose query attends to position 0, mean over layers
        summary["position0_held"] = float(held.mean())
    written = None
    if b.outs[0].written is not None:
        written = torch.cat([o.written for o in b.outs]).cpu().numpy()
    return EvalResult(per_token, summary, layers, attention_by_key(b), written)


def greedy_divergence(
    model: GPT,
    tokens: torch.Tensor,
    policy: Policy,
    budget: int,
    n_new: int,
    spec: StreamSpec = DEFAULT,
    shared: SharedReferences | None = None,
    written: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Greedy continuations of each stream's first T - n_new tokens under the policy and under the full
    cache: per stream, the first step where they differ (n_new if never) and the share of steps that
    agree, plus both token arrays [N, n_new]. The full cache's continuations come from `shared` where
    another run of the sweep has written them; the policy's are `written` where the evaluation wrote
    them on the answer path (`Answers(T - n_new, n_new)`)."""
    N, T = tokens.shape
    if not 1 <= n_new < T:
        raise ConfigError(f"eval.generate_tokens={n_new} must be in [1, eval.stream_len)")
    ours, theirs = [], []
    for b0 in range(0, N, spec.batch_size):
        prompt = tokens[b0 : b0 + spec.batch_size, : T - n_new]
        doc = torch.arange(b0, b0 + prompt.shape[0], device=tokens.device)
        if written is None:
            ours.append(generate(model, prompt, policy, budget, n_new, spec, doc=doc))
        else:
            ours.append(torch.as_tensor(written[b0 : b0 + prompt.shape[0]]))
        full = lambda p=prompt, d=doc: generate(model, p, full_cache(), budget, n_new, spec, doc=d)  # noqa: E731
        theirs.append(full() if shared is None else shared.continuation(model, prompt, n_new, full))
    p, f = torch.cat(ours).cpu().numpy(), torch.cat(theirs).cpu().numpy()
    same = p == f
    first = np.where(same.all(1), n_new, np.argmin(same, axis=1))
    return {"policy_tokens": p, "full_tokens": f, "first_divergence": first, "agreement": same.mean(1)}


def greedy_answers(
    model, batch, policy: Policy, budget: int, spec: StreamSpec, length=None, clock: DecodeClock | None = None
) -> list:
    """Per stream of an answer batch (RecallBatch, TaskBatch): the tokens greedy decoding writes under the
    policy from the stream's prompt (tokens[:, :answer_start]), answer_len of them, or `length(answer_len)`;
    streams whose prompts end at one position decode together, in batches (as many tokens as the longest
    needs: decoding is causal, so a row's first tokens do not depend on how many follow)."""
    out: list = [None] * len(batch.answer_start)
    for start in np.unique(batch.answer_start):  # streams whose answers start at one position
        rows = np.flatnonzero(batch.answer_start == start)
        for r0 in range(0, len(rows), spec.batch_size):
            idx = torch.from_numpy(rows[r0 : r0 + spec.batch_size])
            want = batch.answer_len[idx.numpy()]
            want = want if length is None else length(want)
            prompt, most = batch.tokens[idx, :start], int(want.max())
            new = generate(model, prompt, policy, budget, most, spec, doc=idx, clock=clock)
            for i, row, n in zip(idx.tolist(), new, want, strict=True):
                out[i] = row[:n]
    return out


def _greedy_exact(model, batch, policy: Policy, budget: int, spec: StreamSpec) -> np.ndarray:
    """Per recall stream: does greedy decoding under the policy reproduce the answer exactly?"""
    written = greedy_answers(model, batch, policy, budget, spec)
    return np.array(
        [
            bool((w == batch.tokens[i, s : s + len(w)]).all())
            for i, (w, s) in enumerate(zip(written, batch.answer_start, strict=True))
        ]
    )


def _answer_columns(batch, result: EvalResult) -> dict[str, list]:
    """Teacher-forced facts of each stream's answer tokens: accuracy, exact match, mean NLL."""
    mask = batch.answer.numpy()
    correct, nll = result.per_token["correct"], result.per_token["nll"]
    return {
        "token_accuracy": [correct[i][mask[i]].mean() for i in range(len(mask))],
        "exact_teacher_forced": [bool(correct[i][mask[i]].all()) for i in range(len(mask))],
        "answer_nll": [nll[i][mask[i]].mean() for i in range(len(mask))],
    }


def _teacher_forced(model, batch, policy: Policy, budget: int, spec: StreamSpec) -> EvalResult:
    """An answer batch's streams evaluated under the policy (no attention diagnostics)."""
    return evaluate(model, batch.tokens, policy, budget, dataclasses.replace(spec, diagnostics=False))


def recall_accuracy(
    model: GPT,
    batch,
    policy: Policy,
    budget: int,
    spec: StreamSpec = DEFAULT,
    result: EvalResult | None = None,
    greedy: bool = True,
) -> pd.DataFrame:
    """Per recall stream (data/recall.py): teacher-forced accuracy on the answer tokens, exact match
    teacher-forced and by greedy decoding under the policy, and the stream's perplexity. `result`: an
    `evaluate` of these streams already made. One row per stream; a policy that cannot generate (it
    needs the full-cache run's future), or greedy=False, gets no greedy column."""
    result = result if result is not None else _teacher_forced(model, batch, policy, budget, spec)
    frame = pd.DataFrame(
        {
            "stream": np.arange(len(batch.answer_start)),
            "depth": batch.depth,
            "needle_pos": batch.needle_pos,
            **_answer_columns(batch, result),
            "ppl": np.exp(result.per_token["nll"].mean(axis=1)),
        }
    )
    if greedy and policy.can_generate():
        frame["exact_greedy"] = _greedy_exact(model, batch, policy, budget, spec)
    return frame


def task_answers(batch, clock: DecodeClock | None = None) -> Answers:
    """What a task batch's streams write on the answer path: from the prompt's end (one position for every
    row), as many tokens as the longest answer's `task_decode_len`."""
    if len(set(batch.answer_start.tolist())) != 1:
        raise ValueError("a task batch's prompts end at one position (data/tasks: task_streams)")
    return Answers(int(batch.answer_start[0]), int(task_decode_len(batch.answer_len).max()), clock)


def task_decode_len(answer_len: np.ndarray) -> np.ndarray:
    """Tokens decoded for an answer of `answer_len` tokens: twice as many, plus 8 (an answer may be phrased
    longer than the reference: a list of one item per line, a sentence around the number)."""
    return 2 * answer_len + 8


def task_accuracy(
    model: GPT,
    batch,
    policy: Policy,
    budget: int,
    spec: StreamSpec = DEFAULT,
    result: EvalResult | None = None,
    decode=None,
    clock: DecodeClock | None = None,
) -> pd.DataFrame:
    """Per task stream (data/tasks): the answer teacher-forced (token accuracy, exact match, NLL) and, for a
    policy that can generate, as written: greedy decoding under the policy from the prompt, `decode`d to
    text and graded by the task (`exact`, `partial`). One row per stream. `clock` gets generation's
    prefill and decode seconds."""
    result = result if result is not None else _teacher_forced(model, batch, policy, budget, spec)
    frame = pd.DataFrame(
        {
            "stream": np.arange(len(batch.answer_start)),
            "task": batch.task.name,
            "answer_start": batch.answer_start,
            "first_needle": [p[0] if p else -1 for p in batch.needle_pos],
            "reference": [p.answer for p in batch.problems],
            **_answer_columns(batch, result),
        }
    )
    if decode is not None and policy.can_generate():
        if result.written is not None:  # written on the answer path, in the same pass
            want = task_decode_len(batch.answer_len)
            written = [row[:k] for row, k in zip(result.written, want, strict=True)]
        else:
            written = greedy_answers(model, batch, policy, budget, spec, task_decode_len, clock)
        frame["written"] = [decode([int(x) for x in w]) for w in written]
        graded = [batch.task.score(p, t) for p, t in zip(batch.problems, frame["written"], strict=True)]
        frame["exact"] = [e for e, _ in graded]
        frame["partial"] = [c for _, c in graded]
    return frame
