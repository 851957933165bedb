"""The scheduled path: policies whose decisions never read attention (random, l2norm), in original positions.

Such a policy's evictions in layer l depend only on layer l's keys, positions and its own state, so a
block of steps can be decided before any of its attention runs:

    for each block of queries s .. e-1, layer by layer:
        project the block's queries and values
        replay steps s .. e-1 on the slot bookkeeping alone (LayerCache + the policy's observe / scores,
            the token loop's own code, with no attention row), each step's key projected as the loop
            projects it: when each entry is evicted
        one masked attention for the whole block over the entries held at step s plus the block's own:
            query t sees entry p iff p <= t <= the step that evicted p

The replay is the token loop minus most of the model (a few small ops per step and layer); the
attention and the MLPs run as block-sized matmuls like the parallel path. Cache mode re-indexes RoPE
phases by rank among the held entries, which differs per query, so it stays on the token loop.
"""

from __future__ import annotations

import time

import torch

from evictlab.cache.policies import Policy
from evictlab.eval.full import FullReference
from evictlab.eval.loop import LayerCache, LostAttention, evict_step
from evictlab.eval.static import Recorder
from evictlab.models.gpt import GPT, CausalSelfAttention, rope_angles, rotate

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


class _ScheduledAttention:
    """Each layer's attention for one block of queries: replay the block's evictions, then attend."""

    def __init__(self, model: GPT, policy: Policy, budgets: list[int], B: int, n: int, doc, ref):
        cfg = model.cfg
        self.policy, self.budgets, self.doc = policy, budgets, doc
        self.groups = cfg.n_head // cfg.kv_heads
        like = torch.empty(0, dtype=model.wte.weight.dtype, device=doc.device)
        self.caches = []
        for S in (min(b + 1, n) for b in budgets):
            state = policy.init_state(B, cfg.kv_heads, S, like)
            self.caches.append(LayerCache(B, cfg.kv_heads, S, cfg.head_dim, like, state))
        self.lost = None
        if ref is not None and ref.attn is not None:
            self.lost = LostAttention(ref, self.groups, B, n, cfg.n_layer, like)
        self.occupancy = torch.empty(n, cfg.n_layer, dtype=torch.long, device=doc.device)
        self.pos: torch.Tensor | None = None  # the block's positions [m]
        self.policy_seconds = 0.0

    def __call__(self, l: int, a: CausalSelfAttention, h: torch.Tensor) -> torch.Tensor:
        cache, pos = self.caches[l], self.pos
        q, _, v = a.project(h)  # [B, H, m, D], [B, Hkv, m, D]
        q = a.rotate(q, pos)
        U0 = cache.used  # the entries held when the block starts come first, then the block's own
        K0, V0, P0 = (x[:, :, :U0] for x in (cache.k, cache.v, cache.pos))
        K0, V0, P0 = K0.clone(), V0.clone(), P0.clone()  # (the replay overwrites slots)
        k, until = self.replay(l, a, cache, h, v, U0)  # the block's rotated keys; when each entry left
        B, Hkv, m, _ = k.shape
        K, V = torch.cat([K0, k], 2), torch.cat([V0, v], 2)  # [B, Hkv, U0 + m, D]
        P = torch.cat([P0, pos.expand(B, Hkv, m)], 2)
        t = pos[:, None]  # [m, 1] query positions
        visible = (P[:, :, None, :] >= 0) & (P[:, :, None, :] <= t) & (t <= until[:, :, None, :])
        mask = visible.repeat_interleave(self.groups, dim=1) if self.groups > 1 else visible
        return a.out(a.attend(q, K, V, mask=mask))

    def replay(self, l: int, a: CausalSelfAttention, cache: LayerCache, h, v, U0: int):
        """Steps of the block on layer l's slots, as the token loop takes them: project the step's key,
        write the entry, let the policy decide; record when each entry of the block's attention (held at
        the start: 0 .. U0-1, the block's own: U0 ..) was evicted -> (keys [B, Hkv, m, D], until)."""
        B, Hkv, m, _ = v.shape
        occupant = torch.arange(cache.k.shape[2], device=v.device).expand(B, Hkv, -1).clone()
        until = torch.full((B, Hkv, U0 + m), NEVER, dtype=torch.long, device=v.device)
        keys = []
        if a.rope_base is not None:  # the block's RoPE rows once (the same values as one position's)
            cos, sin = (x.to(v.dtype) for x in rope_angles(self.pos, a.rope_dims, a.rope_base))
        start = time.perf_counter()
        for i, t in enumerate(self.pos.tolist()):
            # The key exactly as the loop computes it (one token per projection): a policy that scores
            # keys sees bit-identical values for equal tokens, so its ties break as in the loop.
            k = a.project(h[:, i : i + 1])[1]
            k, cache.last_raw = a.smear(k, cache.last_raw), k
            init = self.policy.entry_state(k) if cache.state else {}
            if a.rope_base is not None:
                k = rotate(k, cos[i], sin[i])
            keys.append(k)
            occupant.scatter_(2, cache.free[:, :, None], U0 + i)
            cache.write(k, v[:, :, i : i + 1], t, init)
            if self.lost is not None:
                self.lost.observe(l, t, cache.pos[:, :, : cache.used])
            victim = evict_step(self.policy, cache, t, l, self.budgets[l], self.doc)
            if victim is not None:
                until.scatter_(2, occupant.gather(2, victim[:, :, None]), t)
            self.occupancy[t, l] = cache.count
        self.policy_seconds += time.perf_counter() - start
        return torch.cat(keys, 2), until


@torch.no_grad()
def stream_scheduled(
    model: GPT,
    tokens: torch.Tensor,
    policy: Policy,
    budgets: list[int],
    ref: FullReference | None,
    doc: torch.Tensor,
    block: int,
) -> tuple[dict[str, torch.Tensor], _ScheduledAttention]:
    """Stream tokens [B, T] on the scheduled path, `block` queries at a time -> (metrics, the state)."""
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    B, n = inp.shape
    rec = Recorder(tgt, None, ref)
    attend = _ScheduledAttention(model, policy, budgets, B, n, doc, ref)
    for s in range(0, n, block):
        e = min(n, s + block)
        attend.pos = torch.arange(s, e, device=tokens.device)
        rec.add(s, model.forward_with(inp[:, s:e], attend.pos, attend))
    out = rec.out
    if attend.lost is not None:
        out["lost"] = attend.lost.values
    return out, attend
