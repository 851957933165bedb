"""The blocked path: the token loop's nest turned around, for every policy that is not position-static.

Layer l at step t depends on layer l-1 at steps <= t and on layer l's own cache, never on a later step.
So a block of steps can run layer by layer ("for each block: for each layer: for each step") instead of
step by step ("for each step: for each layer"): every operation that touches the cache is the token
loop's own code (`TokenLoop.step`: write, attend, evict), and everything else (the projections, the
MLPs, the norms and the head) runs once per block as block-sized matmuls. A stream runs in three parts:

1. **fill** (steps 0 .. smallest budget - 1): no layer evicts, so each block's entries go to their slots
   at once and its queries attend causally in one matmul; a policy that reads attention observes each
   step's row with the loop's context (`BlockedLoop.fill`).
2. **wavefront** (the rest, when every layer has the same budget): all
   layers' steps at once, a block apart (eval/wavefront.py).
3. otherwise, layer by layer and step by step (`BlockedLoop.__call__`).

A policy that scores keys (`entry_state`) gets them projected one token at a time, as the loop projects
them (`CausalSelfAttention.project_keys`: the key rows of the projection alone): equal tokens then have
bit-identical keys and their ties break as in the loop.

(A variant that replayed a score-free policy's evictions first and then attended once per block under a
mask was measured no faster than part 3 at make bench's workload, 2026-12-01, and was removed.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from evictlab.cache.policies import Policy, StepContext
from evictlab.eval.full import Recorder, causal_weights
from evictlab.eval.loop import TokenLoop
from evictlab.eval.paths import Path, StreamOutput
from evictlab.eval.wavefront import Wavefront, steady_start, wave_steps
from evictlab.models.gpt import GPT, CausalSelfAttention


class BlockedLoop:
    """Each layer's attention for one block of steps (positions `pos`), over a TokenLoop's caches."""

    def __init__(self, loop: TokenLoop):
        self.loop = loop
        self.exact_keys = type(loop.policy).entry_state is not Policy.entry_state
        self.pos: torch.Tensor | None = None  # the block's positions [m]

    def blocks(self, start: int, stop: int, block: int, device) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(start, end, positions) of each block of steps start .. stop-1, `block` at a time; while a block
        runs, this attention (and its `fill`) holds its positions."""
        for s in range(start, stop, block):
            e = min(stop, s + block)
            self.pos = torch.arange(s, e, device=device)
            yield s, e, self.pos

    def __call__(self, l: int, a: CausalSelfAttention, h: torch.Tensor) -> torch.Tensor:
        q, k, v, init = self.project(l, a, h, self.pos)
        ys = []
        for i, t in enumerate(self.pos.tolist()):
            one = slice(i, i + 1)
            ys.append(self.loop.step(l, t, q[:, :, one], k[:, :, one], v[:, :, one], _rows(init, one)))
        return a.out(torch.cat(ys, 1))

    def project(self, l: int, a: CausalSelfAttention, h: torch.Tensor, pos: torch.Tensor):
        """Layer l's entries of a block at positions pos [m] from its normed input h [B, m, C] -> q [B, H, m,
        D]; k, v [B, Hkv, m, D] (rotated at their positions in original mode); the policy's entry state."""
        loop, cache = self.loop, self.loop.caches[l]
        q, k, v = a.project(h)  # [B, H, m, D], [B, Hkv, m, D] x2
        if self.exact_keys:
            k = torch.cat([a.project_keys(h[:, i : i + 1]) for i in range(h.shape[1])], 2)
        raw_last = k[:, :, -1:]
        k = a.smear(k, cache.last_raw)  # (last_raw: zeros before the first block)
        cache.last_raw.copy_(raw_last)
        init = loop.policy.entry_state(k) if cache.state else {}
        if loop.rotate_on_write:
            q, k = loop.rope(q, pos), loop.rope(k, pos)
        return q, k, v, init

    def fill(self, l: int, a: CausalSelfAttention, h: torch.Tensor) -> torch.Tensor:
        """Layer l over a block of steps in which no layer evicts (every position < the smallest budget): the
        block's entries go to their slots at once (slot = position while nothing is evicted), its queries
        attend causally in one matmul, and a policy that reads attention observes each step's row with the
        token loop's context."""
        loop, pos = self.loop, self.pos
        cache, policy = loop.caches[l], loop.policy
        s, e = int(pos[0]), int(pos[-1]) + 1
        q, k, v, init = self.project(l, a, h, pos)  # [B, H, m, D], [B, Hkv, m, D] x2
        cache.k[:, :, s:e] = loop.rope.to_pairs(k) if loop.reindex else k
        cache.v[:, :, s:e] = v
        cache.pos[:, :, s:e] = pos
        for name, st in cache.state.items():
            st[:, :, s:e] = init[name].to(st.dtype) if name in init else 0
        if cache.rank is not None:
            cache.rank[:, :, s:e] = pos
        cache.count = cache.used = e
        cache.free.fill_(e)
        K, V = cache.k[:, :, :e], cache.v[:, :, :e]
        if loop.reindex:  # nothing evicted yet: each entry's rank is its position
            K = loop.rope.rotate_ranks(K, torch.arange(e, device=pos.device))
            q = loop.rope.rotate_ranks(loop.rope.to_pairs(q), pos)
        B, H, m, D = q.shape
        Hkv = K.shape[1]
        w = causal_weights(q, K, s)[0]  # [B, H, m, e], as the full-cache reference computes them
        y = (w.view(B, Hkv, loop.groups * m, e) @ V).view(B, H, m, D).transpose(1, 2).reshape(B, m, H * D)
        loop.record_held(s, e, np.arange(s + 1, e + 1), l)
        if loop.lost is not None and s < loop.lost.covered:
            c = min(e, loop.lost.covered) - s
            held = cache.pos[:, :, None, :e].expand(B, Hkv, c, e)
            held = held.masked_fill(held > pos[:c, None], -1)  # step t holds positions 0 .. t
            loop.lost.values[:, s : s + c, l] = 1 - loop.lost.attention.held_mass_steps(l, s, held).mean(1)
        if policy.evicts and policy.needs_attention:
            start = time.perf_counter()
            w = w.view(B, Hkv, loop.groups, m, e)
            row = w[:, :, 0] if loop.groups == 1 else w.mean(2)  # [B, Hkv, m, e]
            for i, t in enumerate(range(s, e)):
                u = t + 1  # the slots written by step t
                ctx = StepContext(
                    t=t,
                    layer=l,
                    budget=loop.budgets[l],
                    pos=cache.pos[:, :, :u],
                    keys=cache.k[:, :, :u],
                    attn=row[:, :, i, :u],
                    state={name: st[:, :, :u] for name, st in cache.state.items()},
                    doc=loop.doc,
                    future=loop.future_of(l, t),
                )
                policy.observe(ctx)
            loop.policy_seconds += time.perf_counter() - start
        return a.out(y)


def _rows(init: dict[str, torch.Tensor], one: slice) -> dict[str, torch.Tensor]:
    return {name: x[:, :, one] for name, x in init.items()}


@dataclass
class BlockedPath(Path):
    """Every cache policy that is not position-static: the token loop layer by layer over blocks of
    `plan.block` steps. Where it can, the steps from the first eviction on run as a wavefront over layers
    (eval/wavefront.py) in blocks of `wave_steps(block)`."""

    name: ClassVar[str] = "blocked"

    @torch.no_grad()
    def run(self, tokens, reference, doc, tick=None) -> StreamOutput:
        inp, tgt = tokens[:, :-1], tokens[:, 1:]
        rec = Recorder(tgt, None, reference, tick)
        budgets, mode = list(self.plan.budgets), self.spec.position_mode
        loop = TokenLoop(self.model, self.policy, budgets, mode, inp.shape[0], inp.shape[1], doc, reference)
        run_blocked(self.model, inp, loop, self.plan.block, rec)
        out = rec.out
        if loop.lost is not None:
            out["lost"] = loop.lost.values
        return self.cache_output(out, loop)


class _Discard:
    """A recorder that keeps nothing (a prefill wants the caches, not the prompt's predictions)."""

    def add(self, s: int, logits: torch.Tensor) -> None:
        pass


@torch.no_grad()
def prefill(model: GPT, prompt: torch.Tensor, loop: TokenLoop, block: int) -> None:
    """Steps 0 .. P-2 of prompt [B, P] on the blocked path into `loop` (a TokenLoop sized for the whole
    generation): its caches and policy state are then the token loop's after step P-2, and decoding goes on
    with `loop.decode_one_token` from step P-1 (tests/test_generate.py holds it equal to the token loop)."""
    if prompt.shape[1] > 1:
        run_blocked(model, prompt[:, :-1], loop, block, _Discard())


def run_blocked(model: GPT, inp: torch.Tensor, loop: TokenLoop, block: int, rec) -> None:
    """Steps 0 .. n-1 of inp [B, n] into loop, the predictions of each block to `rec.add(start, logits)`."""
    n = inp.shape[1]
    attend = BlockedLoop(loop)
    filled = min(n, min(loop.budgets))  # steps 0 .. filled-1: no layer evicts yet
    for s, e, pos in attend.blocks(0, filled, block, inp.device):
        rec.add(s, model.forward_with(inp[:, s:e], pos, attend.fill))
    if steady_start(loop, n) == filled:  # all layers at once, a block apart
        Wavefront(model, loop, attend.project, rec, inp, filled).run(wave_steps(block), block)
        filled = n
    for s, e, pos in attend.blocks(filled, n, block, inp.device):  # layer by layer, step by step
        rec.add(s, model.forward_with(inp[:, s:e], pos, attend))
