"""The blocked path: the token loop's nest turned around, for every policy that is not position-static.

Layer l at step t depends on layer l-1 at steps <= t and on layer l's own cache, never on a later step.
So a block of steps can run layer by layer ("for each block: for each layer: for each step") instead of
step by step ("for each step: for each layer"): every operation that touches the cache is the token
loop's own code (`TokenLoop.step`: write, attend, evict), and everything else (the projections, the
MLPs, the norms and the head) runs once per block as block-sized matmuls.

A policy that scores keys (`entry_state`) gets them projected one token at a time, as the loop projects
them: equal tokens then have bit-identical keys and their ties break as in the loop.

(A variant that replayed a score-free policy's evictions first and then attended once per block under a
mask was measured no faster than this at make bench's workload, 2026-12-01, and was removed.)
"""

from __future__ import annotations

import torch

from evictlab.cache.policies import Policy
from evictlab.eval.full import FullReference, Recorder, Tick
from evictlab.eval.loop import TokenLoop
from evictlab.eval.spec import PositionMode
from evictlab.models.gpt import GPT, CausalSelfAttention


class BlockedLoop:
    """Each layer's attention for one block of steps (positions `pos`), over a TokenLoop's caches."""

    def __init__(self, loop: TokenLoop):
        self.loop = loop
        self.exact_keys = type(loop.policy).entry_state is not Policy.entry_state
        self.pos: torch.Tensor | None = None  # the block's positions [m]

    def __call__(self, l: int, a: CausalSelfAttention, h: torch.Tensor) -> torch.Tensor:
        loop, cache, pos = self.loop, self.loop.caches[l], self.pos
        q, k, v = a.project(h)  # [B, H, m, D], [B, Hkv, m, D] x2
        if self.exact_keys:
            k = torch.cat([a.project(h[:, i : i + 1])[1] for i in range(h.shape[1])], 2)
        raw_last = k[:, :, -1:]
        k = a.smear(k, cache.last_raw)  # (last_raw: zeros before the first block)
        cache.last_raw.copy_(raw_last)
        init = loop.policy.entry_state(k) if cache.state else {}
        if loop.rotate_on_write:
            q, k = loop.rope(q, pos), loop.rope(k, pos)
        ys = []
        for i, t in enumerate(pos.tolist()):
            one = slice(i, i + 1)
            ys.append(loop.step(l, t, q[:, :, one], k[:, :, one], v[:, :, one], _rows(init, one)))
        return a.out(torch.cat(ys, 1))


def _rows(init: dict[str, torch.Tensor], one: slice) -> dict[str, torch.Tensor]:
    return {name: x[:, :, one] for name, x in init.items()}


@torch.no_grad()
def stream_blocked(
    model: GPT,
    tokens: torch.Tensor,
    policy: Policy,
    budgets: list[int],
    mode: PositionMode,
    ref: FullReference | None,
    doc: torch.Tensor,
    block: int,
    tick: Tick | None = None,
) -> tuple[dict[str, torch.Tensor], TokenLoop]:
    """Stream tokens [B, T] on the blocked path, `block` steps at a time -> (metrics, the loop state)."""
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    B, n = inp.shape
    rec = Recorder(tgt, None, ref, tick)
    loop = TokenLoop(model, policy, budgets, mode, B, n, doc, ref)
    attend = BlockedLoop(loop)
    for s in range(0, n, block):
        e = min(n, s + block)
        attend.pos = torch.arange(s, e, device=tokens.device)
        rec.add(s, model.forward_with(inp[:, s:e], attend.pos, attend))
    out = rec.out
    if loop.lost is not None:
        out["lost"] = loop.lost.values
    return out, loop
