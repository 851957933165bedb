"""The token loop: teacher-forced decoding one token at a time through a fixed-budget KV cache.

    for each step t:  logp = loop.decode_one_token(token_t, t, steady)   # every layer: attend, evict
                      record(t, logp)

The step index and whether the step is steady (`TokenLoop.steady_from`) are arguments of every step
function; the loop object holds the caches and what the steps record, nothing a caller sets.

Each layer's cache is a set of preallocated slots (gpt-fast's KVCache, extended to eviction): k, v
[B, Hkv, S, D] with S = budget + 1, the text position of each slot, and the policy's per-slot state. The
new entry overwrites the slot freed by the last eviction, so a step never copies the cache.

Step t processes the token at position t and predicts token t+1. The query attends to the entries kept
after step t-1 (at most `budget`) plus itself; then the cache is evicted back to budget.
"""

from __future__ import annotations

import copy
import time
import warnings
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from evictlab.cache.policies import Policy, StepContext, choose_victim
from evictlab.errors import ConfigError
from evictlab.eval.caches import SlotCache, ranks
from evictlab.eval.full import FullReference, gather_rows, token_metrics
from evictlab.eval.paths import Path, StreamOutput
from evictlab.eval.spec import PositionMode
from evictlab.models.gpt import GPT, CausalSelfAttention
from evictlab.models.rope import Rope, rotate

# Rows of rotated keys per pass in cache mode (`TokenLoop.attend_ranked`): small enough to stay in cache
# between the rotation that writes them and the scores that read them. Rotation + attention of SmolLM2's
# stacked rows at 1 thread (60 x 3 x 1,025 x 64 keys; 240 x 3 x 257): all rows at once 22.2 / 28.2 ms,
# 3-6 MiB per pass 17.3-17.9 / 19.5 ms, 0.8 MiB per pass 24.2 / 23.6 ms (2026-12-05, throwaway script).
ROTATED_BYTES = 4 << 20


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


class TokenLoop:
    """The decode state of one batch of documents under one policy: a SlotCache per layer."""

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
        slots = max(min(b + 1, n) for b in budgets)  # cache-mode ranks are 0 .. slots-1
        self.like, self.rope = like, Rope(cfg, like, slots)  # (the blocked path rotates with it too)
        rope = self.rope.enabled
        self.rotate_on_write = rope and mode is PositionMode.original  # keys stored at their text phase
        self.reindex = rope and mode is PositionMode.cache  # keys held unrotated (pair order), by rank
        self.caches = []
        for S in (min(b + 1, n) for b in budgets):
            state = policy.init_state(B, cfg.kv_heads, S, like)
            self.caches.append(SlotCache(B, cfg.kv_heads, S, cfg.head_dim, like, state))
            if self.reindex and not policy.position_only:
                self.caches[-1].track_ranks()  # each document and head holds its own positions
        self.lost = None
        if ref is not None and ref.attention is not None and ref.attention.has_rows:
            self.lost = LostAttention(ref, B, n, cfg.n_layer, like)
        # entries held after each step [n, L], written per step and layer: a numpy buffer (a scalar write
        # into a tensor costs ~9 us, 3% of SmolLM2's blocked path at batch 1; into numpy 0.3 us)
        self.held = np.empty((n, cfg.n_layer), dtype=np.int64)
        self.policy_seconds = 0.0
        self.compile_seconds = 0.0  # the first compiled step: tracing and code generation

    def record_held(self, start: int, end: int | None, count, layer: int | slice = slice(None)) -> None:
        """Entries held after steps start .. end-1 (in `layer`, default every layer), for the steps a path
        runs outside `step` (a block before any eviction; the steady steps, which hold the budgets)."""
        self.held[start:end, layer] = count

    def share_caches(self, stacked: SlotCache) -> None:
        """Each layer's cache becomes its rows of `stacked` (all layers' caches along the batch dim, one copy
        in memory: eval/wavefront.py), so what the wavefront writes is what `kept` and `dropped` read."""
        B = self.doc.shape[0]
        self.caches[:] = [stacked.rows(l * B, (l + 1) * B) for l in range(len(self.caches))]

    @property
    def occupancy(self) -> torch.Tensor:
        """[n, L] entries each layer held after each step."""
        return torch.from_numpy(self.held).to(self.doc.device)

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

    def decode_one_token(
        self, token: torch.Tensor, t: int | torch.Tensor, steady: bool = False
    ) -> torch.Tensor:
        """token [B, 1] at position t through every layer -> log-probs of the next token [B, V].
        A steady step (from `steady_from()` on) records no diagnostics or occupancy and takes t as a
        0-dim tensor, so one compiled graph serves every steady step."""
        pos = t.view(1) if isinstance(t, torch.Tensor) else torch.tensor([t], device=token.device)

        def attend(l: int, a: CausalSelfAttention, h: torch.Tensor) -> torch.Tensor:
            return self.attend(l, t, a, h, steady)

        return F.log_softmax(self.model.forward_with(token, pos, attend)[:, 0], dim=-1)

    def attend(
        self, l: int, t: int | torch.Tensor, a: CausalSelfAttention, h: torch.Tensor, steady: bool
    ) -> torch.Tensor:
        """Layer l of step t: project, store the new entry, attend to the held entries, evict to budget."""
        cache = self.caches[l]
        q, k, v = a.project(h)  # [B, H, 1, D], [B, Hkv, 1, D] x2
        if a.smear_logit is not None:  # smeared keys: keep this raw key for the next step (one buffer)
            raw, k = k, a.smear(k, cache.last_raw)
            cache.last_raw.copy_(raw)
        init = self.policy.entry_state(k) if cache.state else {}
        if self.rotate_on_write:
            cos, sin = self.rope.at(t)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        return a.out(self.step(l, t, q, k, v, init, steady))

    def step(
        self, l: int, t: int | torch.Tensor, q, k, v, init: dict[str, torch.Tensor], steady: bool = False
    ) -> torch.Tensor:
        """Layer l of step t from the projected entry (q [B, H, 1, D]; k, v [B, Hkv, 1, D], rotated at
        position t in original mode, unrotated in cache mode (held in pair order); `init` its policy
        state): store it, attend to the held entries, evict to budget -> the attention output [B, 1, C]
        (before c_proj). A steady step records nothing per step."""
        cache = self.caches[l]
        K, V, P = cache.update(self.rope.to_pairs(k) if self.reindex else k, v, t, init)
        valid = None if cache.count == cache.used else P >= 0
        if self.reindex:  # ranks 0..m-1 inside the cache (one layout for every document and head, or
            # each its own, tracked on write and evict)
            r = ranks(P[0, 0]) if self.policy.position_only else cache.rank[:, :, : cache.used]
            y, row = self.attend_ranked(q, K, V, r, cache.count - 1, valid)
        else:
            y, row = self.attention(q, K, V, valid)
        if steady:  # no diagnostics or occupancy to record: the caller fills occupancy in
            self.evict(l, t, cache, P, row, steady)
            return y
        if self.lost is not None:
            self.lost.observe(l, t, P)  # (only the steps the reference covers)
        self.evict(l, t, cache, P, row, steady)
        self.held[t, l] = cache.count
        return y

    def attend_ranked(self, q, K, V, r, at: int, valid) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Cache mode's `attention`: the held keys K (unrotated, in pair order) rotated at their ranks r
        ([S], shared, or [B, Hkv, S]) and the query at rank `at`, a few rows at a time: each pass's rotated
        keys are still in cache when their scores read them (they are rewritten at every step: on the
        wavefront's stacked rows, 30 layers x 2 documents x 1,025 slots, 47 MB). The same values as one
        pass over all rows: every op is per row."""
        rope = self.rope
        q = rope.rotate_ranks(rope.to_pairs(q), at)
        n = max(1, ROTATED_BYTES // (K[0].numel() * K.element_size()))  # rows per pass
        ys, rows = [], []
        for a in range(0, len(K), n):
            b = a + n
            Kr = rope.rotate_ranks(K[a:b], r if r.dim() == 1 else r[a:b], scratch=True)  # (valid until
            y, row = self.attention(q[a:b], Kr, V[a:b], None if valid is None else valid[a:b])  # the next)
            ys.append(y)
            rows.append(row)
        if len(ys) == 1:
            return ys[0], rows[0]
        return torch.cat(ys), None if rows[0] is None else torch.cat(rows)

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

    def fused_attention(self, q, K, V, valid) -> tuple[torch.Tensor, None]:
        """`attention` through torch's fused kernel (scaled_dot_product_attention; FlashAttention on a GPU):
        the same output without the weights, which it never materialises. For policies that read none."""
        B, H, _, D = q.shape
        mask = None if valid is None else valid[:, :, None].repeat_interleave(self.groups, dim=1)
        y = F.scaled_dot_product_attention(q, K, V, attn_mask=mask, enable_gqa=True)  # [B, H, 1, D]
        return y.reshape(B, 1, H * D), None

    def fork(self, fused: bool = False) -> TokenLoop:
        """A copy whose caches and policy state go on apart from this loop's (the model and policy are
        shared); `fused`: the copy attends through `fused_attention` (a policy that reads attention
        weights cannot: H2O, TOVA, Scissorhands)."""
        if fused and self.policy.needs_attention:
            raise ConfigError(f"{self.policy.name} reads attention weights: no fused attention kernel")
        twin = copy.deepcopy(self, {id(self.model): self.model, id(self.policy): self.policy})
        if fused:  # (a class-level switch: a bound method stored on the copy would be a reference cycle
            twin.__class__ = FusedTokenLoop  # that keeps its caches alive until the cycle collector runs)
        return twin

    def evict(
        self,
        l: int,
        t: int | torch.Tensor,
        cache: SlotCache,
        pos: torch.Tensor,
        row: torch.Tensor | None,
        steady: bool,
    ) -> None:
        """Let the policy observe step t, then evict its lowest-scored entry if the cache is over budget
        (a steady step is not timed: no host synchronisation per step)."""
        budget, policy = self.budgets[l], self.policy
        if not (policy.evicts and (policy.needs_attention or cache.count > budget)):
            cache.evict(None)
            return
        start = None if steady else time.perf_counter()
        ctx = StepContext(
            t=t,
            layer=l,
            budget=budget,
            pos=pos,
            keys=cache.k[:, :, : cache.used],
            attn=row,
            state=cache.held_state(),
            doc=self.doc,
            future=self.future_of(l, t),
        )
        policy.observe(ctx)
        if cache.count > budget:
            cache.evict(choose_victim(policy.scores(ctx), pos, all_valid=cache.count == cache.used))
        else:
            cache.evict(None)
        if start is not None:
            self.policy_seconds += time.perf_counter() - start

    def future_of(self, l: int, t: int | torch.Tensor):
        """For the oracle: pos [B, Hkv, S] -> the attention later full-cache queries put on them."""
        return self.future_for([(l, t)])

    def future_for(self, steps: list[tuple[int, int]]):
        """For the oracle, (layer, step) pairs -> (pos [len * B, Hkv, S] -> the attention each held key gets
        from its layer's full-cache queries after its step); None for a policy that does not read it."""
        if not self.policy.needs_future or self.ref is None or self.ref.attention is None:
            return None
        rows = torch.cat([self.ref.attention.future(l, t) for l, t in steps])  # [len * B, Hkv, n]
        return lambda pos: gather_rows(rows, pos)


@dataclass
class LoopPath(Path):
    """One token per step over preallocated slot buffers (`TokenLoop`): eval.force_loop (the engine's
    cross-check), eval.compile, and generate's reference.

    Once every layer's cache is full (`TokenLoop.steady_from`) each step is the same computation on the
    same shapes: the loop then passes the step index as a tensor and, with `plan.compiled`, runs the step
    through `torch.compile` (one graph for all steady steps; 3-15 s to compile here, then about 2.7x
    the eager token rate at batch 1: worth it on long streams, see benchmarks/README.md "Long streams")."""

    name: ClassVar[str] = "loop"

    def run(self, tokens, reference, doc, tick=None) -> StreamOutput:
        per_token, loop, _ = self.stream(tokens, reference, doc, tick=tick)
        lost = None if loop.lost is None else loop.lost.values
        return self.cache_output(per_token, loop, lost=lost, compile_seconds=loop.compile_seconds)

    @torch.no_grad()
    def stream(self, tokens, ref, doc, generate_from: int | None = None, tick=None):
        """Stream tokens [B, T] -> (per-token metrics [B, n] by name, the loop, the tokens). Metrics against
        the full cache are NaN past the steps its reference covers. With `generate_from=P`, tokens from
        position P on are generated greedily (each step's argmax is the next step's input) instead of
        read, and the tokens are returned with them filled in."""
        tokens = tokens.clone() if generate_from is not None else tokens
        inp, tgt = tokens[:, :-1], tokens[:, 1:]  # views: generated tokens become the next inputs
        B, n = inp.shape
        budgets, compile = list(self.plan.budgets), self.plan.compiled
        loop = TokenLoop(self.model, self.policy, budgets, self.spec.position_mode, B, n, doc, ref)
        covered = 0 if ref is None else ref.logp.shape[1]  # steps the full-cache reference covers
        names = ["nll", "correct"] + (["kl", "agree"] if ref is not None else [])
        per_token = {name: loop.like.new_full((B, n), float("nan")) for name in names}
        steady_from = loop.steady_from()
        step, steady = loop.decode_one_token, False
        for t in range(n):
            if t == steady_from:
                steady = True
                loop.record_held(t, None, budgets)
                step = torch.compile(loop.decode_one_token, dynamic=False) if compile else step
            first_compiled = compile and t == steady_from
            start = time.perf_counter() if first_compiled else 0.0
            t_in = torch.tensor(t, device=inp.device) if steady else t
            try:
                logp = step(inp[:, t : t + 1], t_in, steady)
            except Exception as e:  # compiling fails before the step runs: no C++ compiler, an unsupported op
                if not first_compiled:
                    raise
                step = _eager_after(e, loop)
                logp = step(inp[:, t : t + 1], t_in, steady)
            if first_compiled:
                loop.compile_seconds = time.perf_counter() - start
            if generate_from is not None and t + 1 >= generate_from:
                tokens[:, t + 1] = logp.argmax(-1)
            metrics = token_metrics(logp, tgt[:, t], ref.logp[:, t] if t < covered else None)
            for name, value in metrics.items():
                per_token[name][:, t] = value
            if tick is not None:
                tick(B)
        return per_token, loop, tokens


def _eager_after(error: Exception, loop: TokenLoop):
    """eval.compile's fallback: a warning naming why torch.compile failed, and the eager step."""
    first = (str(error).strip().splitlines() or [""])[0]
    why = f"{type(error).__name__}: {first}"
    warnings.warn(f"eval.compile: torch.compile failed ({why}); the loop runs eager", stacklevel=3)
    return loop.decode_one_token


class FusedTokenLoop(TokenLoop):
    """A TokenLoop whose per-step attention is `fused_attention` (TokenLoop.fork(fused=True))."""

    def attention(self, q, K, V, valid) -> tuple[torch.Tensor, None]:
        return self.fused_attention(q, K, V, valid)
