"""The block paths of the token loop: its loop nest turned around, for the policies that are not
position-static.

Layer l at step t depends on layer l-1 at steps <= t and on layer l's own cache, never on a later step.
So a block of steps can run layer by layer ("for each block: for each layer: for each step") instead of
step by step ("for each step: for each layer"): every operation that touches the cache is the token
loop's own code (`TokenLoop.step`: write, attend, evict; `evict_step`), and everything else (the
projections, the MLPs, the norms and the head) runs once per block as block-sized matmuls.

* **blocked**: every such policy, both position modes. Per step and layer only the write, the attention
  over the held entries and the eviction run.
* **scheduled**: policies whose decisions never read attention (random, l2norm), in original
  positions. The block's evictions are replayed first on the slot bookkeeping alone, which says when
  each entry left; then the block attends at once, query t seeing entry p iff p <= t <= the step that
  evicted p. (Cache mode re-indexes RoPE phases by rank per query: it stays blocked.)

A policy that scores keys (`entry_state`) gets them projected one token at a time, as the loop projects
them: equal tokens then have bit-identical keys and their ties break as in the loop.
"""

from __future__ import annotations

import torch

from evictlab.cache.policies import Policy
from evictlab.eval.full import FullReference
from evictlab.eval.loop import LayerCache, TokenLoop
from evictlab.eval.spec import PositionMode
from evictlab.eval.static import Recorder
from evictlab.models.gpt import GPT, CausalSelfAttention

NEVER = torch.iinfo(torch.long).max  # "not evicted" as a step index


def schedulable(policy: Policy) -> bool:
    """The policy's kept set can be decided without attention (and is not a position-static window,
    which the parallel path runs)."""
    return (
        policy.evicts
        and not policy.needs_attention
        and not policy.needs_future
        and not policy.recompute
        and policy.static_window(1) is None
    )


class BlockedLoop:
    """Each layer's attention for one block of steps (positions `pos`), over a TokenLoop's caches."""

    def __init__(self, loop: TokenLoop, scheduled: bool):
        self.loop, self.scheduled = loop, scheduled
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
            q, k = a.rotate(q, pos), a.rotate(k, pos)
        if self.scheduled:
            return a.out(self.attend_scheduled(l, a, cache, q, k, v, init))
        ys = []
        for i, t in enumerate(pos.tolist()):
            loop.t, one = t, slice(i, i + 1)
            ys.append(loop.step(l, q[:, :, one], k[:, :, one], v[:, :, one], _rows(init, one)))
        return a.out(torch.cat(ys, 1))

    def attend_scheduled(self, l: int, a: CausalSelfAttention, cache: LayerCache, q, k, v, init):
        """Replay the block's evictions, then one masked attention -> [B, m, C] (before c_proj)."""
        U0 = cache.used  # the entries held when the block starts come first, then the block's own
        K0, V0, P0 = (x[:, :, :U0].clone() for x in (cache.k, cache.v, cache.pos))  # (the replay writes)
        until = self.replay(l, cache, k, v, init, U0)
        B, Hkv, m, _ = k.shape
        K, V = torch.cat([K0, k], 2), torch.cat([V0, v], 2)  # [B, Hkv, U0 + m, D]
        P = torch.cat([P0, self.pos.expand(B, Hkv, m)], 2)
        t = self.pos[:, None]  # [m, 1] query positions
        visible = (P[:, :, None, :] >= 0) & (P[:, :, None, :] <= t) & (t <= until[:, :, None, :])
        groups = self.loop.groups
        return a.attend(q, K, V, mask=visible.repeat_interleave(groups, dim=1) if groups > 1 else visible)

    def replay(self, l: int, cache: LayerCache, k, v, init, U0: int) -> torch.Tensor:
        """The block's steps on layer l's slots without attention: write each entry, let the policy
        decide (the loop's evict) -> when each entry of the block's attention (held at the start:
        0 .. U0-1, the block's own: U0 ..) was evicted [B, Hkv, U0 + m] (NEVER if it was not)."""
        loop = self.loop
        B, Hkv, m, _ = k.shape
        occupant = torch.arange(cache.k.shape[2], device=k.device).expand(B, Hkv, -1).clone()
        until = torch.full((B, Hkv, U0 + m), NEVER, dtype=torch.long, device=k.device)
        for i, t in enumerate(self.pos.tolist()):
            loop.t, one = t, slice(i, i + 1)
            occupant.scatter_(2, cache.free[:, :, None], U0 + i)
            cache.write(k[:, :, one], v[:, :, one], t, _rows(init, one))
            if loop.lost is not None:
                loop.lost.observe(l, t, cache.pos[:, :, : cache.used])
            victim = loop.evict(l, cache, cache.pos[:, :, : cache.used], None)
            if victim is not None:
                until.scatter_(2, occupant.gather(2, victim[:, :, None]), t)
            loop.occupancy[t, l] = cache.count
        return until


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
    scheduled: bool,
) -> tuple[dict[str, torch.Tensor], TokenLoop]:
    """Stream tokens [B, T] on a block path, `block` steps at a time -> (metrics by name, the loop state)."""
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    B, n = inp.shape
    rec = Recorder(tgt, None, ref)
    loop = TokenLoop(model, policy, budgets, mode, B, n, doc, ref)
    attend = BlockedLoop(loop, scheduled)
    for s in range(0, n, block):
        e = min(n, s + block)
        attend.pos = torch.arange(s, e, device=tokens.device)
        rec.add(s, model.forward_with(inp[:, s:e], attend.pos, attend))
    out = rec.out
    if loop.lost is not None:
        out["lost"] = loop.lost.values
    return out, loop
