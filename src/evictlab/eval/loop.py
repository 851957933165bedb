"""The token loop: teacher-forced decoding one token at a time through a fixed-budget KV cache.

    for each step t:  logp = loop.decode_one_token(token_t, t)   # every layer: attend, then evict
                      record(t, logp)

Each layer's cache is a set of preallocated slots (gpt-fast's KVCache, extended to eviction): k, v
[B, Hkv, S, D] with S = budget + 1, the text position of each slot, and the policy's per-slot state. The
new entry overwrites the slot freed by the last eviction, so a step never copies the cache.

Step t processes the token at position t and predicts token t+1. The query attends to the entries kept
after step t-1 (at most `budget`) plus itself; then the cache is evicted back to budget.
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from evictlab.cache.policies import Policy, StepContext, choose_victim
from evictlab.eval.full import FullReference, gather_rows, token_metrics
from evictlab.eval.spec import PositionMode
from evictlab.models.gpt import GPT, CausalSelfAttention, PosEmb, rope_angles, rotate


class LayerCache:
    """Preallocated slots of one layer: k, v [B, Hkv, S, D], pos [B, Hkv, S] (-1 = empty) and the policy's
    per-slot state (each [B, Hkv, S, ...])."""

    def __init__(self, B: int, Hkv: int, S: int, D: int, like: torch.Tensor, state: dict[str, torch.Tensor]):
        self.k = like.new_zeros(B, Hkv, S, D)
        self.v = like.new_zeros(B, Hkv, S, D)
        self.pos = torch.full((B, Hkv, S), -1, dtype=torch.long, device=like.device)
        self.state = state
        self.free = torch.zeros(B, Hkv, dtype=torch.long, device=like.device)  # slot for the next entry
        self.last_raw = like.new_zeros(B, Hkv, 1, D)  # the previous token's raw key (for smeared keys)
        self.count = 0  # entries held (the same for every document and head)
        self.used = 0  # slots written at least once (slots fill in order until the first eviction)
        self.rank: torch.Tensor | None = None  # track_ranks(): each slot's rank by position among the held

    def track_ranks(self) -> None:
        """Keep `rank` [B, Hkv, S] up to date on every write and eviction (cache mode re-indexes by it):
        the same values as `ranks(pos)` on the held slots without a sort per step; a free slot keeps a
        stale rank < S."""
        self.rank = torch.zeros_like(self.pos)

    def write(
        self, k: torch.Tensor, v: torch.Tensor, t: int | torch.Tensor, init: dict[str, torch.Tensor]
    ) -> None:
        """Store k, v [B, Hkv, 1, D] of position t in the free slot; that slot's state starts at `init`
        (values [B, Hkv, 1, ...]) or zero."""
        B, Hkv, _, D = k.shape
        slot = self.free[:, :, None]
        self.k.scatter_(2, slot[..., None].expand(B, Hkv, 1, D), k)
        self.v.scatter_(2, slot[..., None].expand(B, Hkv, 1, D), v)
        self.pos.scatter_(2, slot, t.expand(slot.shape) if isinstance(t, torch.Tensor) else t)
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

    def held(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views over the slots written so far: k, v [B, Hkv, U, D] and pos [B, Hkv, U]."""
        U = self.used
        return self.k[:, :, :U], self.v[:, :, :U], self.pos[:, :, :U]

    def held_state(self) -> dict[str, torch.Tensor]:
        return {name: st[:, :, : self.used] for name, st in self.state.items()}

    def evict(self, victim: torch.Tensor) -> None:
        """Empty slot victim [B, Hkv]; the next entry goes there."""
        self.pos.scatter_(2, victim[:, :, None], -1)
        if self.rank is not None:  # the entries after the victim move down one rank
            self.rank.add_(self.rank > self.rank.gather(2, victim[:, :, None]), alpha=-1)
        self.free.copy_(victim)  # the same buffer every step (a compiled step reads it as a graph input)
        self.count -= 1

    def advance(self) -> None:
        """No eviction this step: the next entry goes to the next never-used slot."""
        self.free.fill_(self.count)


def ranks(pos: torch.Tensor) -> torch.Tensor:
    """Rank of each valid slot's position among the valid slots of its (doc, head); invalid slots last."""
    key = pos.masked_fill(pos < 0, torch.iinfo(pos.dtype).max)
    order = key.argsort(dim=-1)
    ar = torch.arange(pos.shape[-1], device=pos.device).expand_as(pos)
    return torch.empty_like(pos).scatter_(-1, order, ar)


class LostAttention:
    """Diagnostic: the full-cache attention that step t's query puts on entries the policy no longer holds
    (1 - the full-cache attention on the held positions, mean over heads), per step and layer [B, n, L]."""

    def __init__(self, ref: FullReference, B: int, n: int, L: int, like: torch.Tensor):
        self.attention = ref.attention
        self.covered = ref.attention.n  # steps the reference's attention covers (NaN after)
        self.values = like.new_full((B, n, L), float("nan"))

    def observe(self, l: int, t: int, pos: torch.Tensor) -> None:
        if t >= self.covered:
            return
        self.values[:, t, l] = 1 - self.attention.held_mass(l, t, pos).mean(1)


class RopeTable:
    """cos, sin of RoPE by position: text positions computed `chunk` at a time (flat memory in stream
    length), cache ranks 0 .. slots-1 from one fixed table; the values equal a table over the stream."""

    def __init__(self, cfg, like: torch.Tensor, slots: int, chunk: int = 4096):
        self.dims, self.base, self.like, self.chunk = cfg.rope_dims, cfg.rope_base, like, chunk
        self.rank_cos, self.rank_sin = self._table(0, slots)
        # cache mode: rank rows as complex numbers (none for half types: no complex type matches them), and
        # the head's dims from rotate-half order to pair order and back
        complex_ok = like.dtype in (torch.float32, torch.float64)
        self.rank_cis = torch.complex(self.rank_cos, self.rank_sin) if complex_ok else None
        half = self.dims // 2
        pairs = torch.stack([torch.arange(half), torch.arange(half) + half], 1).flatten()
        self.pair_order = torch.cat([pairs, torch.arange(self.dims, cfg.head_dim)]).to(like.device)
        self.half_order = torch.argsort(self.pair_order)
        self.start, self.cos, self.sin = 0, self.rank_cos, self.rank_sin
        self.scratch = torch.empty(0, dtype=self.rank_cis.dtype if complex_ok else like.dtype)

    def _table(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._angles(torch.arange(start, start + n, device=self.like.device))

    def _angles(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_angles(pos, self.dims, self.base)
        return cos.to(self.like.dtype), sin.to(self.like.dtype)

    def at(self, t: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of text position t (a 0-dim tensor t is computed in place: the same values)."""
        if isinstance(t, torch.Tensor):
            cos, sin = self._angles(t.view(1))
            return cos[0], sin[0]
        if not self.start <= t < self.start + len(self.cos):
            self.start = t - t % self.chunk
            self.cos, self.sin = self._table(self.start, self.chunk)
        return self.cos[t - self.start], self.sin[t - self.start]

    def ranks(self, r: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of ranks inside a cache (all < slots)."""
        return self.rank_cos[r], self.rank_sin[r]

    def to_pairs(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] with its rotary dims in rotate-half order (x1_0..x1_{R/2-1}, x2_0..) -> the pair order
        (x1_0, x2_0, x1_1, x2_1, ..., then the dims that do not rotate). Scores are dot products, so queries
        and keys in the same order give the same attention."""
        return x.index_select(-1, self.pair_order)

    def rotate_ranks(self, x: torch.Tensor, r: torch.Tensor | int, scratch: bool = False) -> torch.Tensor:
        """RoPE of x [..., D] in pair order at ranks r (broadcastable to x's leading dims): one complex
        multiply, (x1 + i x2)(cos + i sin), the same products and sums as `rotate`'s, in one kernel
        instead of six plus a gather per table (make bench: H2O in cache mode re-rotates every held key
        at every step). With `scratch` and r [...] (one rank per row of x) the table rows are gathered
        into, and multiplied in, one buffer the table keeps (no allocation per step): the result is then
        valid until the next such call."""
        if self.rank_cis is None:  # half types: rotate in rotate-half order
            return self.to_pairs(rotate(x.index_select(-1, self.half_order), *self.ranks(r)))
        R = self.dims
        rot = torch.view_as_complex((x if R == x.shape[-1] else x[..., :R]).unflatten(-1, (R // 2, 2)))
        if not (isinstance(r, torch.Tensor) and r.dim() > 0):
            prod = rot * self.rank_cis[r]
        elif scratch and r.shape == rot.shape[:-1]:
            n = r.numel() * (R // 2)
            if self.scratch.numel() < n or self.scratch.device != x.device:
                self.scratch = torch.empty(n, dtype=self.rank_cis.dtype, device=x.device)
            cis = self.scratch[:n].view(r.numel(), R // 2)
            cis = torch.index_select(self.rank_cis, 0, r.reshape(-1), out=cis).view(*r.shape, -1)
            prod = torch.mul(rot, cis, out=cis)  # (the bits of rot * cis: operand order kept)
        else:
            prod = rot * self.rank_cis.index_select(0, r.reshape(-1)).view(*r.shape, -1)
        out = torch.view_as_real(prod).flatten(-2)
        return out if R == x.shape[-1] else torch.cat([out, x[..., R:]], -1)


class TokenLoop:
    """The decode state of one batch of documents under one policy: a LayerCache per layer."""

    def __init__(
        self,
        model: GPT,
        policy: Policy,
        budgets: list[int],
        mode: PositionMode,
        B: int,
        n: int,
        doc: torch.Tensor,
        ref: FullReference | None = None,
    ):
        cfg = model.cfg
        self.model, self.policy, self.budgets, self.doc, self.ref = model, policy, budgets, doc, ref
        self.groups, self.scale = cfg.n_head // cfg.kv_heads, cfg.head_dim**-0.5
        like = torch.empty(0, dtype=model.wte.weight.dtype, device=doc.device)
        rope = cfg.pos_emb is PosEmb.rope
        self.rotate_on_write = rope and mode is PositionMode.original  # keys stored at their text phase
        self.reindex = rope and mode is PositionMode.cache  # keys held unrotated (pair order), by rank
        self.caches = []
        for S in (min(b + 1, n) for b in budgets):
            state = policy.init_state(B, cfg.kv_heads, S, like)
            self.caches.append(LayerCache(B, cfg.kv_heads, S, cfg.head_dim, like, state))
            if self.reindex and not policy.position_only:
                self.caches[-1].track_ranks()  # each document and head holds its own positions
        slots = max(min(b + 1, n) for b in budgets)  # cache-mode ranks are 0 .. slots-1
        self.like, self.rope = like, RopeTable(cfg, like, slots) if rope else None
        self.lost = None
        if ref is not None and ref.attention is not None and ref.attention.has_rows:
            self.lost = LostAttention(ref, B, n, cfg.n_layer, like)
        self.occupancy = torch.empty(n, cfg.n_layer, dtype=torch.long, device=doc.device)
        self.policy_seconds = 0.0
        self.compile_seconds = 0.0  # the first compiled step: tracing and code generation
        self.t: int | torch.Tensor = 0
        self.steady = False  # set by steady_from's caller: steps run without per-step host bookkeeping

    def steady_from(self) -> int | None:
        """The first step from which every step is the same computation on the same shapes: each layer
        enters it holding exactly its budget, all of its slots written (step budget + 1 on), writes one
        entry and evicts one, and no diagnostic reads the step index. None if the stream never gets there."""
        p = self.policy
        never_full = any(b + 1 > c.k.shape[2] for b, c in zip(self.budgets, self.caches, strict=True))
        if not p.evicts or p.needs_future or never_full:
            return None
        # a layer with budget b fills its last never-used slot at step b: from step b + 1 on it enters
        # every step with b entries in all b + 1 slots
        return max([*(b + 1 for b in self.budgets), self.lost.covered if self.lost is not None else 0])

    def decode_one_token(self, token: torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
        """token [B, 1] at position t through every layer -> log-probs of the next token [B, V].
        In steady state (`self.steady`) t is a 0-dim tensor, so one compiled graph serves every step."""
        self.t = t
        pos = t.view(1) if isinstance(t, torch.Tensor) else torch.tensor([t], device=token.device)
        return F.log_softmax(self.model.forward_with(token, pos, self.attend)[:, 0], dim=-1)

    def attend(self, l: int, a: CausalSelfAttention, h: torch.Tensor) -> torch.Tensor:
        """Layer l of step t: project, store the new entry, attend to the held entries, evict to budget."""
        cache, t = self.caches[l], self.t
        q, k, v = a.project(h)  # [B, H, 1, D], [B, Hkv, 1, D] x2
        if a.smear_logit is not None:  # smeared keys: keep this raw key for the next step (one buffer)
            raw, k = k, a.smear(k, cache.last_raw)
            cache.last_raw.copy_(raw)
        init = self.policy.entry_state(k) if cache.state else {}
        if self.rotate_on_write:
            cos, sin = self.rope.at(t)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        return a.out(self.step(l, q, k, v, init))

    def step(self, l: int, q, k, v, init: dict[str, torch.Tensor]) -> torch.Tensor:
        """Layer l of step t from the projected entry (q [B, H, 1, D]; k, v [B, Hkv, 1, D], rotated at
        position t in original mode, unrotated in cache mode (held in pair order); `init` its policy
        state): store it, attend to the held entries, evict to budget -> the attention output [B, 1, C]
        (before c_proj)."""
        cache, t = self.caches[l], self.t
        cache.write(self.rope.to_pairs(k) if self.reindex else k, v, t, init)
        K, V, P = cache.held()
        if self.reindex:  # ranks 0..m-1 inside the cache, the query last (keys are held in pair order)
            # one layout for every document and head, or each its own (tracked on write and evict)
            r = ranks(P[0, 0]) if self.policy.position_only else cache.rank[:, :, : cache.used]
            K = self.rope.rotate_ranks(K, r, scratch=True)  # (read before the next layer's step)
            q = self.rope.rotate_ranks(self.rope.to_pairs(q), cache.count - 1)
        y, row = self.attention(q, K, V, None if cache.count == cache.used else P >= 0)
        if self.steady:  # no diagnostics or occupancy to record: the caller fills occupancy in
            self.evict(l, cache, P, row)
            return y
        if self.lost is not None:
            self.lost.observe(l, t, P)  # (only the steps the reference covers)
        self.evict(l, cache, P, row)
        self.occupancy[t, l] = cache.count
        return y

    def attention(self, q, K, V, valid) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The query's attention over the held entries (valid [B, Hkv, U]: the slots that hold one; None
        when all do) -> (output [B, 1, C], the attention row [B, Hkv, U] averaged over each KV head's
        query heads, or None when the policy does not read it).

        Two batched matmuls over the KV heads (each KV head's query heads are the rows of one GEMM), the
        same for every policy: no einsum (it copied K to a permuted layout every step), no masked SDPA
        (not faster here for one query: make bench's loop rows within noise of it, 2026-12-01)."""
        B, H, _, D = q.shape
        qg = q.view(B, H // self.groups, self.groups, D)  # [B, Hkv, g, D]
        s = (qg @ K.transpose(-1, -2)).mul_(self.scale)  # [B, Hkv, g, U]
        w = (s if valid is None else s.masked_fill_(~valid[:, :, None], float("-inf"))).softmax(-1)
        y = (w @ V).reshape(B, 1, H * D)
        if not self.policy.needs_attention:
            return y, None
        return y, (w[:, :, 0] if self.groups == 1 else w.mean(2))

    def evict(self, l: int, cache: LayerCache, pos: torch.Tensor, row: torch.Tensor | None) -> None:
        """Let the policy observe the step, then evict its lowest-scored entry if the cache is over budget."""
        budget, policy = self.budgets[l], self.policy
        if not (policy.evicts and (policy.needs_attention or cache.count > budget)):
            cache.advance()
            return
        start = None if self.steady else time.perf_counter()
        ctx = StepContext(
            t=self.t,
            layer=l,
            budget=budget,
            pos=pos,
            keys=cache.k[:, :, : cache.used],
            attn=row,
            state=cache.held_state(),
            doc=self.doc,
            future=self.future_of(l),
        )
        policy.observe(ctx)
        if cache.count > budget:
            cache.evict(choose_victim(policy.scores(ctx), pos, all_valid=cache.count == cache.used))
        else:
            cache.advance()
        if start is not None:
            self.policy_seconds += time.perf_counter() - start

    def future_of(self, l: int):
        """For the oracle: pos [B, Hkv, S] -> the attention later full-cache queries put on them."""
        if not self.policy.needs_future or self.ref is None or self.ref.attention is None:
            return None
        row = self.ref.attention.future(l, self.t)  # [B, Hkv, n]
        return lambda pos: gather_rows(row, pos)


@torch.no_grad()
def stream_loop(
    model: GPT,
    tokens: torch.Tensor,
    policy: Policy,
    budgets: list[int],
    mode: PositionMode,
    ref: FullReference | None,
    doc: torch.Tensor,
    generate_from: int | None = None,
    progress: bool = False,
    compile: bool = False,
):
    """Stream tokens [B, T] through the token loop -> (per-token metrics [B, n] by name, the loop).
    Metrics against the full cache are NaN past the steps its reference covers.
    With `generate_from=P`, tokens from position P on are generated greedily (each step's argmax is the
    next step's input) instead of read, and `tokens` is returned with them filled in.

    Once every layer's cache is full (`TokenLoop.steady_from`) each step is the same computation on the
    same shapes: the loop then passes the step index as a tensor and, with `compile`, runs the step
    through `torch.compile` (one graph for all steady steps; 3-15 s to compile here, then about 2.7x
    the eager token rate at batch 1: worth it on long streams, see benchmarks/README.md "Long streams")."""
    tokens = tokens.clone() if generate_from is not None else tokens
    inp, tgt = tokens[:, :-1], tokens[:, 1:]  # views: generated tokens become the next inputs
    B, n = inp.shape
    loop = TokenLoop(model, policy, budgets, mode, B, n, doc, ref)
    covered = 0 if ref is None else ref.logp.shape[1]  # steps the full-cache reference covers
    names = ["nll", "correct"] + (["kl", "agree"] if ref is not None else [])
    per_token = {name: loop.like.new_full((B, n), float("nan")) for name in names}
    steady = loop.steady_from()
    step = loop.decode_one_token
    for t in tqdm(range(n), desc=f"{policy.name} stream", unit="tok", disable=not progress, mininterval=2):
        if t == steady:
            loop.steady = True
            loop.occupancy[t:] = torch.tensor(budgets, device=loop.occupancy.device)
            step = torch.compile(loop.decode_one_token, dynamic=False) if compile else step
        first_compiled = compile and t == steady
        start = time.perf_counter() if first_compiled else 0.0
        t_in = torch.tensor(t, device=inp.device) if loop.steady else t
        try:
            logp = step(inp[:, t : t + 1], t_in)
        except Exception as e:  # compilation fails before the step runs: no C++ compiler, an unsupported op
            if not first_compiled:
                raise
            first = (str(e).strip().splitlines() or [""])[0]
            why = f"{type(e).__name__}: {first}"
            warnings.warn(f"eval.compile: torch.compile failed ({why}); the loop runs eager", stacklevel=2)
            step = loop.decode_one_token
            logp = step(inp[:, t : t + 1], t_in)
        if first_compiled:
            loop.compile_seconds = time.perf_counter() - start
        if generate_from is not None and t + 1 >= generate_from:
            tokens[:, t + 1] = logp.argmax(-1)
        metrics = token_metrics(logp, tgt[:, t], ref.logp[:, t] if t < covered else None)
        for name, value in metrics.items():
            per_token[name][:, t] = value
    return per_token, loop, tokens
