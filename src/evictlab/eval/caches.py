"""Per-layer KV caches: one type, `LayerCache`, over the layouts the engine's paths hold (as transformers'
`CacheLayerMixin` is one over its dynamic, sliding-window and static layers).

    K, V, P = cache.update(k, v, pos, state)  # store entries at pos -> everything the queries attend to
    cache.evict(target)                       # back to what this layout keeps between steps

* `SlotCache` (token loop, blocked path): budget + 1 preallocated slots per document and KV head, each
  with the policy's state. `update` writes one entry into the slot the last eviction freed (`scatter_`,
  nothing copied); `evict` empties the policy's victim slot per document and head, or nothing (None).
* `BandCache` (parallel path: static windows, the full cache): the sinks and the last `lookback` positions,
  one contiguous run for all documents and heads. `update` appends a block of entries; `evict` drops
  whatever queries from the target position on cannot reach.
* `_NaiveCache` (eval/naive.py, the naive loop): growing tensors at batch 1. `update` is a
  `torch.cat`; `evict` deletes the victim's row.

A test runs every layout through the same sequence of `update` and `evict` calls (tests/test_engine.py).

The naive cache stays beside its loop, written the simple way on purpose: it is what the other two are
tested against.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

N_FIRST = 4  # the first positions whose eviction step a cache records (and whose attention full.py measures)


@runtime_checkable
class LayerCache(Protocol):
    """One layer's keys and values, whatever the layout.

    `update(k, v, pos, state)`: store entries k, v [B, Hkv, m, D] at `pos` (the step of one entry, an int or
    one per document; or a block's positions [m]), each with the policy's initial per-entry state (`state`,
    values [B, Hkv, m, ...]; None: zeros, or nothing where the layout keeps none) -> everything queries now
    attend to: K, V [B, Hkv, M, D] and their positions (-1: an empty slot).
    `evict(target)`: back to what the layout keeps between steps; `target` says what goes: a victim index
    [B, Hkv] per document and head (None: nothing), or, for a position-static window, the first query
    position still to come (what no later query reaches goes)."""

    def update(
        self, k: torch.Tensor, v: torch.Tensor, pos, state: dict[str, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def evict(self, target) -> None: ...


def last_attended(windows: list[tuple[int, int | None]], n: int) -> torch.Tensor:
    """[L, N_FIRST]: for a position-static window per layer, (n_sink, lookback) as `BandCache` keeps it, the
    last step whose query attends to each of the first positions (-1: every step of a stream of n). A key
    at p >= n_sink is attended by queries t <= p + lookback."""
    p = torch.arange(N_FIRST)
    rows = []
    for n_sink, lookback in windows:
        last = p + lookback if lookback is not None else torch.full_like(p, -1)
        rows.append(torch.where((p < n_sink) | (last >= n - 1), -1, last))
    return torch.stack(rows)


def held_share(last: torch.Tensor, n: int) -> torch.Tensor:
    """last [..., N_FIRST] (last_attended, or SlotCache.dropped: the step whose eviction removed each of
    the first positions, -1 never) -> the share of the steps t >= p of a stream of n predictions whose
    query attends to position p, same shape (float)."""
    p = torch.arange(N_FIRST, device=last.device)
    last = torch.where(last < 0, n - 1, last)
    return ((last - p + 1).clamp(min=0) / (n - p).clamp(min=1)).float()


class BandCache:
    """One layer's keys and values that later queries can still reach: positions < n_sink and the last
    `lookback` positions (all of them when lookback is None), contiguous and shared by every document and head
    (a position-static window keeps the same positions for all). Keys are stored rotated at their
    positions."""

    def __init__(self, n_sink: int, lookback: int | None):
        self.n_sink, self.lookback = n_sink, lookback
        self.k = self.v = self.pos = None
        self.last_raw = None  # the raw key of the last position seen (for smeared keys)

    def update(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        pos: torch.Tensor,
        state: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store a block's entries k, v [B, Hkv, m, D] at positions pos [m] after the held ones -> all of
        them: K, V [B, Hkv, M, D] and their positions [M] (ascending). A static window scores nothing, so it
        keeps no policy state: `state` must be empty."""
        if state:
            raise ValueError("a BandCache keeps no policy state")
        if self.k is not None:
            k, v, pos = torch.cat([self.k, k], 2), torch.cat([self.v, v], 2), torch.cat([self.pos, pos])
        self.k, self.v, self.pos = k, v, pos
        return k, v, pos

    def evict(self, target: int) -> None:
        """Keep only what queries from position `target` on can reach."""
        if self.lookback is None:
            return
        reach = (self.pos < self.n_sink) | (self.pos >= target - self.lookback)
        self.k, self.v, self.pos = self.k[:, :, reach], self.v[:, :, reach], self.pos[reach]

    def visible(self, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        """[b, m] bool: query at qpos[i] attends to the key at kpos[j]."""
        causal = kpos[None, :] <= qpos[:, None]
        if self.lookback is None:
            return causal
        return causal & ((kpos[None, :] < self.n_sink) | (kpos[None, :] >= qpos[:, None] - self.lookback))


_ROW_FIELDS = ("k", "v", "pos", "free", "last_raw", "dropped")  # SlotCache's tensors with a row per document


class SlotCache:
    """Preallocated slots of one layer (gpt-fast's KVCache, extended to eviction): k, v [B, Hkv, S, D],
    pos [B, Hkv, S] (-1 = empty) and the policy's per-slot state (each [B, Hkv, S, ...]), S = budget + 1.
    Each document and KV head holds its own positions."""

    def __init__(self, B: int, Hkv: int, S: int, D: int, like: torch.Tensor, state: dict[str, torch.Tensor]):
        self.k = like.new_zeros(B, Hkv, S, D)
        self.v = like.new_zeros(B, Hkv, S, D)
        self.pos = torch.full((B, Hkv, S), -1, dtype=torch.long, device=like.device)
        self.state = state
        self.free = torch.zeros(B, Hkv, dtype=torch.long, device=like.device)  # slot for the next entry
        self.last_raw = like.new_zeros(B, Hkv, 1, D)  # the previous token's raw key (for smeared keys)
        # the step whose eviction removed each of the first N_FIRST positions (-1: held so far): that step's
        # query still attended to it (held_share)
        self.dropped = torch.full((B, Hkv, N_FIRST), -1, dtype=torch.long, device=like.device)
        self.t: int | torch.Tensor = 0  # the step of the last update
        self.count = 0  # entries held (the same for every document and head)
        self.used = 0  # slots written at least once (slots fill in order until the first eviction)
        self.rank: torch.Tensor | None = None  # track_ranks(): each slot's rank by position among the held

    @classmethod
    def stacked(cls, caches: list[SlotCache]) -> SlotCache:
        """Several layers' caches as one (copied), stacked along the batch dim: row l * B + b is layer l's
        document b. They must hold the same shapes and counts (the wavefront's caches, eval/wavefront.py)."""
        first = caches[0]
        if any((c.count, c.used, c.k.shape) != (first.count, first.used, first.k.shape) for c in caches):
            raise ValueError("stacked caches must hold the same shapes and counts")
        out = cls.__new__(cls)
        for name in _ROW_FIELDS:
            setattr(out, name, torch.cat([getattr(c, name) for c in caches]))
        out.state = {name: torch.cat([c.state[name] for c in caches]) for name in first.state}
        out.count, out.used, out.t = first.count, first.used, first.t
        out.rank = None if first.rank is None else torch.cat([c.rank for c in caches])
        return out

    def rows(self, lo: int, hi: int) -> SlotCache:
        """Rows lo .. hi-1 as a cache of their own over the same storage (its updates and evictions are
        this cache's): the layers a wavefront step runs. Counts are copied (a steady step leaves them)."""
        out = SlotCache.__new__(SlotCache)
        for name in _ROW_FIELDS:
            setattr(out, name, getattr(self, name)[lo:hi])
        out.state = {name: st[lo:hi] for name, st in self.state.items()}
        out.count, out.used, out.t = self.count, self.used, self.t
        out.rank = None if self.rank is None else self.rank[lo:hi]
        return out

    def track_ranks(self) -> None:
        """Keep `rank` [B, Hkv, S] up to date on every write and eviction (cache mode re-indexes by it):
        the same values as `ranks(pos)` on the held slots without a sort per step; a free slot keeps a
        stale rank < S."""
        self.rank = torch.zeros_like(self.pos)

    def update(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        pos: int | torch.Tensor,
        state: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store k, v [B, Hkv, 1, D] of step `pos` (an int, or [B, 1, 1] one per row) in the free slot (that
        slot's state starts at `state`'s values [B, Hkv, 1, ...], or zero) -> the held entries as views over
        the slots written so far: K, V [B, Hkv, U, D] and pos [B, Hkv, U] (-1 where a slot is empty)."""
        t, init = pos, state or {}
        B, Hkv, _, D = k.shape
        slot = self.free[:, :, None]
        self.k.scatter_(2, slot[..., None].expand(B, Hkv, 1, D), k)
        self.v.scatter_(2, slot[..., None].expand(B, Hkv, 1, D), v)
        self.pos.scatter_(2, slot, t.expand(slot.shape) if isinstance(t, torch.Tensor) else t)
        self.t = t
        for name, st in self.state.items():
            idx = slot.view(B, Hkv, 1, *([1] * (st.dim() - 3))).expand(B, Hkv, 1, *st.shape[3:])
            if name in init:
                st.scatter_(2, idx, init[name].to(st.dtype))
            else:
                st.scatter_(2, idx, 0)
        if self.rank is not None:  # the newest position ranks after every held one
            self.rank.scatter_(2, slot, self.count)
        self.count += 1
        self.used = max(self.used, self.count)
        U = self.used
        return self.k[:, :, :U], self.v[:, :, :U], self.pos[:, :, :U]

    def held_state(self) -> dict[str, torch.Tensor]:
        return {name: st[:, :, : self.used] for name, st in self.state.items()}

    def evict(self, target: torch.Tensor | None) -> None:
        """Empty slot `target` [B, Hkv] (the next entry goes there), or with None evict nothing this step (the
        next entry goes to the next never-used slot)."""
        victim = target
        if victim is None:
            self.free.fill_(self.count)
            return
        gone = self.pos.gather(2, victim[:, :, None])  # [B, Hkv, 1]: each row's evicted position
        first = gone == torch.arange(N_FIRST, device=gone.device)  # [B, Hkv, N_FIRST]
        self.dropped.copy_(torch.where(first, self.t, self.dropped))  # (t: a step, or [B, 1, 1] one per row)
        self.pos.scatter_(2, victim[:, :, None], -1)
        if self.rank is not None:  # the entries after the victim move down one rank
            self.rank.add_(self.rank > self.rank.gather(2, victim[:, :, None]), alpha=-1)
        self.free.copy_(victim)  # the same buffer every step (a compiled step reads it as a graph input)
        self.count -= 1


def ranks(pos: torch.Tensor) -> torch.Tensor:
    """Rank of each valid slot's position among the valid slots of its (doc, head); invalid slots last."""
    key = pos.masked_fill(pos < 0, torch.iinfo(pos.dtype).max)
    order = key.argsort(dim=-1)
    ar = torch.arange(pos.shape[-1], device=pos.device).expand_as(pos)
    return torch.empty_like(pos).scatter_(-1, order, ar)
