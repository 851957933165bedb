"""The blocked path's steady part as a wavefront over layers: in round r, layer l runs block r - l.

On the blocked path each layer still steps through a block one token at a time: a few small tensor ops
per layer and step, bound by their dispatch rather than their FLOPs at batch 1 (SmolLM2, 30 layers:
~2/3 of the blocked path's time, profiled 2026-12-04). Once every layer's cache is full (each enters a
step holding exactly its budget in budget + 1 written slots), each layer's step is the same computation
on the same shapes, so the steps of different layers can run as one op over the layers stacked along the
batch dim (`SlotCache.stacked`: row l * B + b is layer l's document b). Layer l's step t needs layer
l-1's step t, so the layers run a block apart:

    round r:  for each active layer l:  project block r - l            (block matmuls, as before)
              for each step i of a block:  write, attend, evict          (one op per step for all layers)
              for each active layer l:  c_proj + MLP -> layer l+1's input for round r+1

The per-step code is the token loop's own (`SlotCache.update`, `TokenLoop.attention`, the policy's
`observe` and `scores`, `choose_victim`, `SlotCache.evict`) on more rows; a policy sees the step index and
the layer as per-row tensors [R, 1, 1] (`StepContext`). Exact: tests/test_policies.py holds the blocked
path equal to the token loop, token for token and kept set for kept set.

A stream of n steady steps in blocks of m runs n / m + L - 1 rounds of m stacked steps, against n x L
steps of one layer: the first and last L - 1 rounds run fewer layers (the wavefront fills and drains).

At a large cache a stacked step is bound by reading the held keys and values (SmolLM2, cache of 1,024, 2
documents: 2 x 47 MB per step; a batched matmul of a few query rows streams them at 6.5 GB/s on one core here,
a plain sum at 14.8: throwaway script, 1 thread). (A variant that attended a run of 4 steps from one read of
the cache was measured and not kept, 2026-12-05: in cache positions each eviction moves the rank of every
newer key, so each query had to be rotated at every offset a key could have dropped by, and the offsets'
scores and the per-step gathers gave back what the saved reads won: 29.0 -> 27.3 ms per steady step for H2O on
SmolLM2, 2 documents, cache of 1,024, 1 thread, another stream running on the second core as in a sweep; and
its sums ran in another order than the token loop's.)
"""

from __future__ import annotations

import time

import torch

from evictlab.cache.policies import StepContext, choose_victim
from evictlab.eval.caches import SlotCache, ranks
from evictlab.eval.full import Recorder
from evictlab.eval.loop import TokenLoop
from evictlab.models.gpt import GPT

# Steps per wavefront block (`wave_steps`): the block matmuls between rounds get this many rows per
# document, and the wavefront fills and drains over (L - 1) x this many steps. Measured on SmolLM2, H2O,
# budget 64, 1 thread (token-steps/s): 512 tokens at batch 1 with 8 / 16 / 32 / 48 / 64 steps 77 / 98 /
# 131 / 124 / 118 (2026-12-04); one batch of smollm2_quality (8 x 1,024 tokens, diagnostics and reference
# on: `make run ARGS="+experiment=smollm2_quality strategy=h2o budget=b64 eval.n_streams=8
# eval.threads=1"`) streamed in 50 / 44 / 44 s with 16 / 32 / 64 steps (2026-12-05). A 576 x 1536 matmul
# whose weights are not in cache (each layer's are read once per round) ran at 37 / 51 / 64 / 76 GFLOP/s
# on 16 / 32 / 64 / 128 rows.
WAVE_STEPS = 32


def wave_steps(block: int) -> int:
    """Steps per wavefront block: WAVE_STEPS, at most `block`."""
    return min(block, WAVE_STEPS)


def steady_start(loop: TokenLoop, n: int) -> int | None:
    """The first step that evicts (step budget) when from there on every layer's steps are the same
    computation on the same shapes, or None when the stream cannot run a wavefront: budgets that differ
    by layer (the caches would not stack), a policy that never evicts, or a stream that ends first."""
    budgets, p = loop.budgets, loop.policy
    if len(set(budgets)) != 1 or not p.evicts:
        return None
    return budgets[0] if budgets[0] < n else None  # (then every cache has budget + 1 slots)


class Wavefront:
    """The rounds of one stream's steady part, over a TokenLoop whose per-layer caches are full."""

    def __init__(self, model: GPT, loop: TokenLoop, project, rec: Recorder, inp: torch.Tensor, start: int):
        self.model, self.loop, self.project, self.rec, self.inp = model, loop, project, rec, inp
        B, self.n = inp.shape
        self.B, self.L = B, L = B, model.cfg.n_layer
        self.cache = SlotCache.stacked(loop.caches)  # each holds budget entries in slots 0 .. budget-1
        self.cache.used += 1  # the first step writes the last slot: every step after sees all of them
        if loop.reindex and self.cache.rank is None:  # position-only policies: ranks from the positions
            self.cache.rank = ranks(self.cache.pos)
        # each layer's cache becomes its rows of the stacked one (one copy in memory; `project` keeps
        # writing each layer's last raw key into it, and StreamOutput.kept reads each layer's positions)
        loop.share_caches(self.cache)
        device = inp.device
        self.layer = torch.arange(L, device=device).repeat_interleave(B).view(-1, 1, 1)  # [L*B, 1, 1]
        self.doc = loop.doc.repeat(L)  # [L*B]
        self.start = start
        loop.record_held(start, None, loop.budgets[0])

    def run(self, m: int, head_steps: int) -> None:
        """Steps start .. n-1 in blocks of m; the head runs on the last layer's outputs of at least
        `head_steps` steps at once (SmolLM2's 49,152 x 576 head ran at 43 GFLOP/s on 32 rows, 57 on 128)."""
        model, B, L, n = self.model, self.B, self.L, self.n
        starts = list(range(self.start, n, m))
        nb = len(starts)
        xs: dict[int, torch.Tensor] = {}  # layer -> its input for the block it runs next
        done: list[torch.Tensor] = []  # the last layer's outputs not yet through the head
        first = self.start
        for r in range(nb + L - 1):
            lo, hi = max(0, r - nb + 1), min(L - 1, r)
            if r < nb:
                s, e = starts[r], min(n, starts[r] + m)
                xs[0] = model.embed(self.inp[:, s:e], torch.arange(s, e, device=self.inp.device))
            spans = {l: (starts[r - l], min(n, starts[r - l] + m)) for l in range(lo, hi + 1)}
            ys = self.round(lo, hi, spans, xs, m)
            for l, (s, e) in reversed(spans.items()):  # (layer l+1 reads its input before l replaces it)
                block = model.blocks[l]
                x = block.mix(xs[l], block.attn.out(ys[(l - lo) * B : (l - lo + 1) * B, : e - s]))
                if l < L - 1:
                    xs[l + 1] = x
                    continue
                done.append(x)
                if e - first >= head_steps or e == n:
                    self.rec.add(first, model.head(torch.cat(done, 1)))
                    done, first = [], e

    def round(self, lo: int, hi: int, spans: dict[int, tuple[int, int]], xs, m: int) -> torch.Tensor:
        """The steps of layers lo .. hi over their blocks `spans` (layer -> (start, end)) -> the attention
        outputs [(hi - lo + 1) * B, m, C] (rows of a block shorter than m past its end: unwritten)."""
        loop, model, B = self.loop, self.model, self.B
        parts = []
        for l, (s, e) in spans.items():
            block = model.blocks[l]
            pos = torch.arange(s, e, device=self.inp.device)
            q, k, v, init = self.project(l, block.attn, block.ln_1(xs[l]), pos)
            if e - s < m:  # only the lowest layer can be on the last, shorter block: pad it
                pad = m - (e - s)
                q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
                init = {name: torch.nn.functional.pad(x, (0, pad)) for name, x in init.items()}
            parts.append((q, k, v, init))
        q, k, v = (torch.cat([p[i] for p in parts]) for i in range(3))  # [A*B, H or Hkv, m, D]
        init = {name: torch.cat([p[3][name] for p in parts]) for name in parts[0][3]}
        r0, r1 = lo * B, (hi + 1) * B
        t0 = torch.tensor([s for s, _ in spans.values()], device=q.device).repeat_interleave(B).view(-1, 1, 1)
        short = spans[lo][1] - spans[lo][0]  # steps of the lowest layer's block (m unless the last)
        full_rows, short_rows = self.cache.rows(r0, r1), self.cache.rows(r0 + B, r1)
        lost = loop.lost
        covered = lost.covered if lost is not None else 0
        hist = None
        if covered > min(s for s, _ in spans.values()):
            hist = self.cache.pos.new_empty(m, r1 - r0, *self.cache.pos.shape[1:])
        y = q.new_empty(r1 - r0, m, model.cfg.n_embd)
        for i in range(m):
            a = 0 if i < short else B  # the rows this step runs (the short block's layer drops out)
            if r0 + a == r1:
                break
            c = full_rows if a == 0 else short_rows
            one = slice(i, i + 1)
            y[a:, one] = self.step(
                c,
                t0[a:] + i,
                self.layer[r0 + a : r1],
                self.doc[r0 + a : r1],
                q[a:, :, one],
                k[a:, :, one],
                v[a:, :, one],
                {name: x[a:, :, one] for name, x in init.items()},
                None if hist is None else hist[i, a:],
                loop.future_for([(l, s + i) for l, (s, _) in spans.items()][a // B :]),
            )
        if hist is not None:
            self.observe_lost(lo, spans, hist)
        return y

    def step(self, c: SlotCache, t, layer, doc, q, k, v, init, hist, future) -> torch.Tensor:
        """One step of every row of c (each a layer's document at its own step t [R, 1, 1]): the token
        loop's `step` on stacked rows, its cache full -> the attention output [R, 1, C]. future: the
        oracle's lookup (`TokenLoop.future_for`), else None."""
        loop = self.loop
        K, V, P = c.update(loop.rope.to_pairs(k) if loop.reindex else k, v, t, init)
        if loop.reindex:  # ranks 0 .. S-1 inside the cache (every slot holds one), the query last
            y, row = loop.attend_ranked(q, K, V, c.rank, c.count - 1, None)
        else:
            y, row = loop.attention(q, K, V, None)
        if hist is not None:
            hist.copy_(P)
        start = time.perf_counter()
        budget, policy = loop.budgets[0], loop.policy
        ctx = StepContext(
            t=t, layer=layer, budget=budget, pos=P, keys=c.k, attn=row, state=c.state, doc=doc, future=future
        )
        policy.observe(ctx)
        c.evict(choose_victim(policy.scores(ctx), P, all_valid=True))
        loop.policy_seconds += time.perf_counter() - start
        return y

    def observe_lost(self, lo: int, spans: dict[int, tuple[int, int]], hist: torch.Tensor) -> None:
        """Attention lost (`LostAttention`) for a round's steps the reference covers, one batched
        computation per layer from the positions each step held (hist [m, A*B, Hkv, S])."""
        lost, B = self.loop.lost, self.B
        for l, (s, e) in spans.items():
            c = min(e, lost.covered) - s
            if c <= 0:
                continue
            pos = hist[:c, (l - lo) * B : (l - lo + 1) * B].permute(1, 2, 0, 3)  # [B, Hkv, c, S]
            lost.values[:, s : s + c, l] = 1 - lost.attention.held_mass_steps(l, s, pos).mean(1)
