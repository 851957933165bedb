"""The static paths: policies whose kept set depends only on positions, and the re-computation baseline.

A position-static policy keeps, for query i, the keys j <= i with j < n_sink or j >= i - lookback
(`Policy.static_window`): `ParallelPath`. The stream runs in blocks of `plan.block` queries; each layer
keeps only the keys a later block can still reach (the sinks and the last `lookback` positions; every key
for the full cache), so a block's attention is O(block x (block + budget)) and memory stays flat in
stream length for bounded policies (O(T) keys for the full cache, O(T^2) compute, as it must be). A
stream no longer than one block is one forward with a keep mask, exactly as before. `RecomputePath` is
the window with re-computation (no cache).

Each block's logits become per-token metrics at once (`eval/full.py: Recorder`), so no [B, T, V] tensor is
held."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from evictlab.eval.caches import BandCache
from evictlab.eval.full import Recorder
from evictlab.eval.paths import Path, StreamOutput
from evictlab.eval.spec import PositionMode, sampled_steps
from evictlab.models.gpt import GPT, CausalSelfAttention
from evictlab.models.rope import Rope

CHUNK_TOKENS = 2048  # the recompute path's windows per forward: about this many tokens


class _BandAttention:
    """Each layer's attention for one block of queries over what its BandCache holds plus the block.

    In `cache` position mode a query's keys are re-indexed by rank among the held ones. The held set of a
    static window is the sinks plus a contiguous run ending at the query, so every distance inside the run
    is its text distance, and only the sinks move: once query i holds n_sink + lookback + 1 entries it sits
    at rank n_sink + lookback, so it sees sink j at distance n_sink + lookback - j instead of i - j. The block
    attends once at the queries' text positions, with an additive bias on the sinks' columns that turns
    their scores into those of the query at min(i, n_sink + lookback) (`sink_bias`)."""

    def __init__(
        self,
        caches: list[BandCache],
        rope: Rope,
        cache_mode: bool = False,
        ablate: tuple[str, list[bool]] | None = None,
    ):
        self.caches, self.rope, self.pos, self.next_start, self.cache_mode = caches, rope, None, 0, cache_mode
        self.ablate = ablate  # (part, per-layer flags): position 0 ablated for later queries (bos_ablation)

    def blocks(self, n: int, block: int, device) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(start, end, positions) of each block of queries of a stream of n, `block` at a time; while a
        block runs, this attention holds its positions (and then evicts what no later query reaches)."""
        for s in range(0, n, block):
            e = min(n, s + block)
            self.pos, self.next_start = torch.arange(s, e, device=device), e
            yield s, e, self.pos

    def __call__(self, l: int, a: CausalSelfAttention, h: torch.Tensor) -> torch.Tensor:
        cache = self.caches[l]
        q, k, v = a.project(h)
        smeared, cache.last_raw = a.smear(k, cache.last_raw), k[:, :, -1:]
        qr, k = self.rope(q, self.pos), self.rope(smeared, self.pos)
        K, V, P = cache.update(k, v, self.pos)
        mask = cache.visible(self.pos, P)
        if self.ablate is not None and self.ablate[1][l]:
            y = self.ablated(a, qr, K, V, P, mask, self.ablate[0])
        elif self.cache_mode and cache.n_sink and cache.lookback is not None and self.rope.enabled:
            y = a.attend(qr, K, V, mask=self.sink_bias(q, qr, K, P, mask, cache))
        else:
            y = a.attend(qr, K, V, mask=mask)
        cache.evict(self.next_start)
        return a.out(y)

    def ablated(self, a: CausalSelfAttention, qr, K, V, P, mask, part: str) -> torch.Tensor:
        """Attention with position 0 ablated for the queries after it: its key hidden (`key`), or its value
        read as zero (`value`). Query 0 itself attends as in the full cache (it sees only itself)."""
        first = (P == 0)[None, :] & (self.pos > 0)[:, None]  # [b, m]: later queries on position 0
        if part == "key":
            return a.attend(qr, K, V, mask=mask & ~first)
        y = a.attend(qr, K, V.masked_fill((P == 0)[:, None], 0.0), mask=mask)
        if self.pos[0] == 0:  # the block holding query 0: its own row reads its real value
            y[:, :1] = a.attend(qr[:, :, :1], K, V, mask=mask[:1])
        return y

    def sink_bias(self, q, qr, K, P, mask, cache: BandCache) -> torch.Tensor:
        """The additive attention bias [B, H, b, Tk] of cache mode: -inf where `mask` hides a key, and on
        the sinks (the first keys held: positions sort ascending) the difference between the score at
        the sinks' re-indexed distance and the score at their text distance, so that one attention of
        the query at its text position is exact. (A bias rather than a second query: SDPA's fused CPU
        kernel needs equal query and value widths, and the sinks are a few columns.)"""
        ns = min(cache.n_sink, P.shape[0])  # the sinks are held from the first block on
        qs = self.rope(q, self.pos.clamp(max=cache.n_sink + cache.lookback))  # the query as the sinks see it
        B, H, b, D = q.shape
        Hkv = K.shape[1]
        dq = (qs - qr).view(B, Hkv, (H // Hkv) * b, D)  # each KV head's query heads as rows of one GEMM
        fix = (dq @ K[:, :, :ns].transpose(-1, -2)).view(B, H, b, ns) * D**-0.5
        bias = torch.zeros(B, H, b, K.shape[2], dtype=q.dtype, device=q.device)
        bias[..., :ns] = fix
        return bias.masked_fill_(~mask, float("-inf"))


@dataclass
class ParallelPath(Path):
    """Position-static policies (`Policy.static_window`) in both position modes: blocks of `plan.block`
    queries, each over the keys its layer's window (Plan.windows) reaches; in cache mode positions are
    re-indexed inside the cache (see _BandAttention); bos_ablation's part and layers ablated."""

    name: ClassVar[str] = "parallel"

    @torch.no_grad()
    def run(self, tokens, reference, doc, tick=None) -> StreamOutput:
        model, windows = self.model, list(self.plan.windows)
        inp, tgt = tokens[:, :-1], tokens[:, 1:]
        n = inp.shape[1]
        ablate = (self.policy.part, self.policy.ablated(len(windows))) if self.policy.ablation else None
        cache_mode = self.spec.position_mode is PositionMode.cache
        rec = Recorder(tgt, windows, reference, tick)
        caches, rope = [BandCache(*w) for w in windows], Rope.for_model(model, tokens.device)
        attend = _BandAttention(caches, rope, cache_mode, ablate)
        for s, e, pos in attend.blocks(n, self.plan.block, tokens.device):
            rec.add(s, model.forward_with(inp[:, s:e], pos, attend))
        return self.static_output(rec.out, tokens)


def recompute_windows(inp: torch.Tensor, W: int, first: int, last: int, n_sink: int = 0) -> torch.Tensor:
    """The windows of steps t = first .. last-1 (t >= W) of inp [B, n]: tokens [B * (last-first), W], step t
    seeing tokens 0 .. n_sink-1 and then t-(W-n_sink)+1 .. t."""
    n_recent = W - n_sink
    rows = inp[:, first - n_recent + 1 : last].unfold(1, n_recent, 1)  # [B, steps, n_recent]
    if n_sink:
        sinks = inp[:, None, :n_sink].expand(-1, rows.shape[1], -1)
        rows = torch.cat([sinks, rows], dim=2)
    return rows.reshape(-1, W)


@dataclass
class RecomputePath(Path):
    """Window of the last W = budget + 1 tokens, re-encoded at positions 0 .. W-1 for every prediction (the
    StreamingLLM paper's baseline, in both position modes: RoPE scores depend only on distances, and
    learned absolute positions never run past the window). With the policy's `n_sink`, the stream's first
    n_sink tokens head every window, followed by the last W - n_sink. `spec.recompute_sample`: only those
    predictions, one per stratum (`sampled_steps`; the others stay NaN).

    While t < W the window is the whole prefix 0..t at positions 0..t, i.e. the full cache: one causal
    forward covers those steps. Every later step is a full window of W tokens; they run as batched
    causal forwards (no padding, so the fused causal kernel applies) of about CHUNK_TOKENS tokens
    (larger ones fall out of the CPU caches), `plan.block` steps at a time.
    """

    name: ClassVar[str] = "recompute"

    @torch.no_grad()
    def run(self, tokens, reference, doc, tick=None) -> StreamOutput:
        model, W, n_sink = self.model, self.plan.budgets[0] + 1, self.policy.n_sink
        inp, tgt = tokens[:, :-1], tokens[:, 1:]
        B, n = inp.shape
        rec = Recorder(tgt, [(n_sink, W - 1 - n_sink)] * model.cfg.n_layer, reference, tick)
        rows_per_chunk = max(1, CHUNK_TOKENS // W)
        steps = sampled_steps(n, self.spec.recompute_sample)
        if steps is not None and len(steps) < n:
            _recompute_steps(model, inp, W, rec, steps, rows_per_chunk, n_sink)
            return self.static_output(rec.out, tokens)
        rec.add(0, model(inp[:, : min(W, n)]))  # steps 0 .. W-1: the window is the prefix
        for s in range(W, n, self.plan.block):
            e = min(n, s + self.plan.block)
            rows, pos = recompute_windows(inp, W, s, e, n_sink), torch.arange(W, device=tokens.device)
            parts = []
            for r in range(0, rows.shape[0], rows_per_chunk):
                parts.append(model.forward_with(rows[r : r + rows_per_chunk], pos, last_only=True))
            rec.add(s, torch.cat(parts).view(B, e - s, -1))
        return self.static_output(rec.out, tokens)


def _recompute_steps(
    model: GPT, inp, W: int, rec: Recorder, steps: list[int], rows_per_chunk: int, n_sink: int
):
    """`RecomputePath` at the given steps only (the others stay NaN): those before W from one causal
    forward of the prefix, each later one from its own window, about rows_per_chunk windows per forward."""
    B = inp.shape[0]
    head = [t for t in steps if t < W]
    if head:
        logits = model(inp[:, : head[-1] + 1])
        for t in head:
            rec.add(t, logits[:, t : t + 1])
    tail = [t for t in steps if t >= W]
    per = max(1, rows_per_chunk // B)  # steps per forward
    pos = torch.arange(W, device=inp.device)
    for i in range(0, len(tail), per):
        group = tail[i : i + per]
        rows = torch.cat([recompute_windows(inp, W, t, t + 1, n_sink) for t in group])  # [(step, B), W]
        out = model.forward_with(rows, pos, last_only=True).view(len(group), B, 1, -1)
        for t, logits in zip(group, out, strict=True):
            rec.add(t, logits)
    return rec.out


@torch.no_grad()
def full_logp(model: GPT, tokens: torch.Tensor, block: int) -> torch.Tensor:
    """[B, T-1, V] log-probs of the full cache, `block` queries at a time over a growing KV cache: no
    [T, T] attention matrix is ever built (compute O(T^2), memory O(T))."""
    inp = tokens[:, :-1]
    n = inp.shape[1]
    caches = [BandCache(0, None) for _ in range(model.cfg.n_layer)]
    attend = _BandAttention(caches, Rope.for_model(model, tokens.device))
    out = None  # filled block by block: the peak is one [B, n, V] array, not the blocks plus their join
    for s, e, pos in attend.blocks(n, block, tokens.device):
        logp = F.log_softmax(model.forward_with(inp[:, s:e], pos, attend), dim=-1)
        if out is None:
            out = logp.new_empty(logp.shape[0], n, logp.shape[-1])
        out[:, s:e] = logp
    return out
