"""The streaming engine: teacher-forced decoding of a batch of documents through a fixed-budget KV cache.

Three exact paths, chosen automatically (``force_loop=True`` always takes the token loop):

* **parallel** - position-static policies (full, window, streaming_llm) in ``original`` mode, and full /
  window in ``cache`` mode (a contiguous window has the same relative distances after re-indexing):
  one forward with a per-layer keep mask.
* **loop** - one token per step over preallocated slot buffers ``[B, Hkv, budget + 1, D]`` with a
  position buffer; the new entry overwrites the slot freed by the last eviction (no ``torch.cat``);
  per-token results stay on the device until the end.
* **recompute** - ``recompute_window``: every prediction is a fresh forward over the last budget+1
  tokens, run as one batched forward over all windows.

Step t processes the token at position t and predicts token t+1 (t = 0 .. T-2). The query attends to
the entries kept after step t-1 (at most `budget`) plus itself; then the cache is evicted to budget.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.nn.functional as F

from evictlab.cache.budget import Allocation, allocate
from evictlab.cache.policies import Policy, StepContext, choose_victim
from evictlab.cache.policies.window import Window
from evictlab.errors import ConfigError
from evictlab.models.gpt import GPT, PosEmb, rope_angles, rotate

N_SINK_DIAG = 4  # "sink" positions for the attention-mass diagnostic


class PositionMode(str, Enum):
    original = "original"  # each key keeps the RoPE phase of its text position
    cache = "cache"  # positions re-indexed inside the cache every step (keys stored before RoPE)


@dataclass
class FullReference:
    """The full-cache run of the same model on the same tokens (one teacher-forced forward)."""

    logp: torch.Tensor  # [B, n, V] log-probs of step t's prediction
    attn: list[torch.Tensor] | None  # per layer [B, H, n, n]: query step i's attention on key j
    future: list[torch.Tensor] | None = None  # per layer [B, Hkv, n, n]: attention on key j from steps > i

    def attention_by_key(self) -> torch.Tensor | None:
        """[L, n]: mean attention each key position receives from the queries that can see it
        (averaged over documents, heads and later queries): where does the model attend?"""
        if self.attn is None:
            return None
        B, H, n, _ = self.attn[0].shape
        seen = B * H * torch.arange(n, 0, -1, device=self.attn[0].device, dtype=self.attn[0].dtype)
        return torch.stack([a.sum(dim=(0, 1, 2)) / seen for a in self.attn])

    def first_position_mass(self) -> torch.Tensor | None:
        """[L, H]: attention on position 0, mean over documents and queries, per layer and head."""
        if self.attn is None:
            return None
        return torch.stack([a[..., 0].mean(dim=(0, 2)) for a in self.attn])

    @property
    def sink_mass(self) -> torch.Tensor | None:
        """[B, n, L]: attention on the first N_SINK_DIAG positions, mean over heads."""
        if self.attn is None:
            return None
        return torch.stack([a[..., :N_SINK_DIAG].sum(-1).mean(1) for a in self.attn], dim=-1)


@dataclass
class StreamOutput:
    nll: torch.Tensor  # [B, n] per predicted token
    occupancy: torch.Tensor  # [n, L] entries held after each step
    path: str  # parallel | loop | recompute
    budgets: list[int]  # per layer
    kl: torch.Tensor | None = None  # [B, n] KL(p_full || p_policy)
    agree: torch.Tensor | None = None  # [B, n] top-1 agreement with the full cache
    lost: torch.Tensor | None = None  # [B, n, L] full-cache attention on entries the policy does not hold
    sink_mass: torch.Tensor | None = None  # [B, n, L] (full-cache attention on the first positions)
    correct: torch.Tensor | None = None  # [B, n] 1 where the policy's top-1 prediction is the true token
    seconds: float = 0.0
    policy_seconds: float = 0.0  # time inside policy scoring and victim selection
    kept: list[torch.Tensor] = field(default_factory=list)  # per layer [B, Hkv, S] final positions (loop)
    generated: torch.Tensor | None = None  # [B, n_new] greedy tokens (generate only)


# ------------------------------------------------------------------------------------------- helpers


def _rope_tables(model: GPT, n: int, device: torch.device, dtype: torch.dtype):
    if model.cfg.pos_emb is not PosEmb.rope:
        return None, None
    cos, sin = rope_angles(torch.arange(n, device=device), model.cfg.rope_dims, model.cfg.rope_base)
    return cos.to(dtype), sin.to(dtype)


def _ranks(pos: torch.Tensor) -> torch.Tensor:
    """Rank of each valid slot's position among the valid slots of its (doc, head); invalid slots last."""
    key = pos.masked_fill(pos < 0, torch.iinfo(pos.dtype).max)
    order = key.argsort(dim=-1)
    ar = torch.arange(pos.shape[-1], device=pos.device).expand_as(pos)
    return torch.empty_like(pos).scatter_(-1, order, ar)


def budgets_for(n_layer: int, policy: Policy, budget: int, allocation: Allocation | str, n: int) -> list[int]:
    """Per-layer budgets, validated for the policy (full keeps all n entries)."""
    if not policy.evicts:
        return [n] * n_layer
    budgets = allocate(budget, n_layer, allocation)
    for l, b in enumerate(budgets):
        try:
            policy.validate(b)
        except ConfigError as e:
            kind = Allocation(allocation).value
            where = "" if len(set(budgets)) == 1 else f" (layer {l} of the {kind} allocation)"
            raise ConfigError(f"{e}{where}") from None
    return budgets


def check_position_mode(model: GPT, mode: PositionMode | str) -> PositionMode:
    mode = PositionMode(mode)
    if mode is PositionMode.cache and model.cfg.pos_emb is not PosEmb.rope:
        raise ConfigError(
            "eval.position_mode=cache needs RoPE: positions cannot be re-indexed inside the cache for a "
            f"model with {model.cfg.pos_emb.value} absolute positions"
        )
    return mode


def _metrics_vs_full(logp: torch.Tensor, ref: FullReference | None, t: slice | int = slice(None)):
    """KL(p_full || p) and top-1 agreement for the given steps."""
    if ref is None:
        return None, None
    rl = ref.logp[:, t]
    kl = (rl.exp() * (rl - logp)).sum(-1)
    agree = (logp.argmax(-1) == rl.argmax(-1)).to(logp.dtype)
    return kl, agree


# ---------------------------------------------------------------------------------- full reference


@torch.no_grad()
def full_reference(
    model: GPT, tokens: torch.Tensor, attention: bool = True, future: bool = False
) -> FullReference:
    """One teacher-forced forward over tokens[:, :-1] with explicit attention weights."""
    inp = tokens[:, :-1]
    B, n = inp.shape
    H, Hkv = model.cfg.n_head, model.cfg.kv_heads
    pos = torch.arange(n, device=tokens.device)
    causal = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril()
    attns: list[torch.Tensor] = []

    def make_attn(a):
        def attn_fn(h):
            q, k, v = a.project(h)
            q, k = a.rotate(q, pos), a.rotate(k, pos)
            G = H // Hkv
            s = (q @ k.repeat_interleave(G, 1).transpose(-1, -2)) * a.head_dim**-0.5
            w = s.masked_fill(~causal, float("-inf")).softmax(-1)
            if attention or future:
                attns.append(w)
            y = (w @ v.repeat_interleave(G, 1)).transpose(1, 2).reshape(B, n, H * a.head_dim)
            return a.out(y)

        return attn_fn

    x = model.embed(inp, pos)
    for block in model.blocks:
        x = block(x, attn=make_attn(block.attn))
    logp = F.log_softmax(model.head(x), dim=-1)
    fut = None
    if future:
        G = H // Hkv
        fut = []
        for w in attns:
            wk = w.view(B, Hkv, G, n, n).sum(2)  # [B, Hkv, n, n]
            inclusive = wk.flip(2).cumsum(2).flip(2)  # sum over queries i' >= i
            fut.append(inclusive - wk)  # strictly later queries
    return FullReference(logp=logp, attn=attns if attention else None, future=fut)


# ------------------------------------------------------------------------------------ parallel path


def _static_output(logits, tgt, budgets, keeps, ref, path: str) -> StreamOutput:
    """Per-token outputs of a path whose held entries follow a static keep mask per layer."""
    logp = F.log_softmax(logits, dim=-1)
    nll = -logp.gather(-1, tgt[..., None])[..., 0]
    kl, agree = _metrics_vs_full(logp, ref)
    lost = None
    if ref is not None and ref.attn is not None:
        lost = torch.stack([1 - (a * k).sum(-1).mean(1) for a, k in zip(ref.attn, keeps, strict=True)], -1)
    steps = torch.arange(1, tgt.shape[1] + 1, device=tgt.device)
    occupancy = torch.stack([steps.clamp(max=b) for b in budgets], dim=-1)
    out = StreamOutput(nll, occupancy, path, budgets, kl, agree, lost)
    out.correct = (logp.argmax(-1) == tgt).to(logp.dtype)
    return out


def parallel_ok(policy: Policy, mode: PositionMode) -> bool:
    if policy.recompute or policy.static_keep(1, 1, torch.device("cpu")) is None:
        return False
    return mode is PositionMode.original or policy.name in ("full", "window")


@torch.no_grad()
def _stream_parallel(model, tokens, policy, budgets, ref) -> StreamOutput:
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    B, n = inp.shape
    pos = torch.arange(n, device=tokens.device)
    keeps = [policy.static_keep(n, b, tokens.device) for b in budgets]

    def make_attn(a, keep):
        def attn_fn(h):
            q, k, v = a.project(h)
            return a.out(a.attend(a.rotate(q, pos), a.rotate(k, pos), v, mask=keep))

        return attn_fn

    x = model.embed(inp, pos)
    for block, keep in zip(model.blocks, keeps, strict=True):
        x = block(x, attn=make_attn(block.attn, keep))
    return _static_output(model.head(x), tgt, budgets, keeps, ref, "parallel")


# ----------------------------------------------------------------------------------- recompute path


@torch.no_grad()
def _stream_recompute(model, tokens, budgets, mode, ref, chunk_tokens: int = 2048) -> StreamOutput:
    """Window of the last W = budget + 1 tokens, re-encoded for every prediction.

    While t < W the window is the whole prefix 0..t at positions 0..t in both modes, i.e. the full
    cache: one causal forward covers those steps. Every later step is a full window of W tokens; all
    of them run as batched causal forwards (no padding, so the fused causal kernel applies), in chunks
    of about `chunk_tokens` tokens: larger chunks fall out of the CPU caches and run slower.
    """
    if len(set(budgets)) != 1:
        raise ConfigError("recompute_window re-encodes one window for all layers: use allocation=uniform")
    W = budgets[0] + 1  # budget kept entries + the token itself
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    B, n = inp.shape
    head = min(W, n)
    parts = [model(inp[:, :head])]  # steps 0 .. head-1: the window is the prefix
    if n > W:
        windows = inp.unfold(1, W, 1)[:, 1:]  # [B, n-W, W]: window of step t = W .. n-1 starts at t-W+1
        starts = torch.arange(1, n - W + 1, device=tokens.device)
        rows, row_start = windows.reshape(-1, W), starts.repeat(B)
        k = torch.arange(W, device=tokens.device)
        tail, chunk_rows = [], max(1, chunk_tokens // W)
        for r0 in range(0, rows.shape[0], chunk_rows):
            win = rows[r0 : r0 + chunk_rows]
            # cache mode: re-encoded from position 0; original: the window's text positions
            pos = k if mode is PositionMode.cache else row_start[r0 : r0 + chunk_rows, None] + k
            x = model.embed(win, pos)
            rope_pos = pos if pos.dim() == 1 else pos[:, None, :]  # broadcast over heads
            for block in model.blocks:
                x = block(x, rope_pos)
            tail.append(model.head(x[:, -1]))
        parts.append(torch.cat(tail).view(B, n - W, -1))
    keeps = [Window().static_keep(n, b, tokens.device) for b in budgets]  # the tokens each window holds
    return _static_output(torch.cat(parts, dim=1), tgt, budgets, keeps, ref, "recompute")


# ---------------------------------------------------------------------------------------- token loop


class LayerCache:
    """Preallocated slots of one layer: k, v [B, Hkv, S, D], pos [B, Hkv, S] (-1 = empty)."""

    def __init__(self, B: int, Hkv: int, S: int, D: int, like: torch.Tensor):
        self.k = like.new_zeros(B, Hkv, S, D)
        self.v = like.new_zeros(B, Hkv, S, D)
        self.pos = torch.full((B, Hkv, S), -1, dtype=torch.long, device=like.device)
        self.free = torch.zeros(B, Hkv, dtype=torch.long, device=like.device)  # slot for the next entry
        self.count = 0  # entries held (the same for every document and head)
        self.used = 0  # slots written at least once (slots fill in order until the first eviction)

    def write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        t: int,
        state: dict[str, torch.Tensor],
        init: dict[str, torch.Tensor],
    ) -> None:
        """Store k, v [B, Hkv, 1, D] at position t into the free slot; reset that slot's policy state
        to `init` (values [B, Hkv, 1, ...]) or zero."""
        B, Hkv, _, D = k.shape
        slot = self.free[:, :, None]
        self.k.scatter_(2, slot[..., None].expand(B, Hkv, 1, D), k)
        self.v.scatter_(2, slot[..., None].expand(B, Hkv, 1, D), v)
        self.pos.scatter_(2, slot, t)
        for name, st in state.items():
            idx = slot.view(B, Hkv, 1, *([1] * (st.dim() - 3))).expand(B, Hkv, 1, *st.shape[3:])
            st.scatter_(2, idx, init[name].to(st.dtype) if name in init else st.new_zeros(idx.shape))
        self.count += 1
        self.used = max(self.used, self.count)

    def evict(self, victim: torch.Tensor) -> None:
        self.pos.scatter_(2, victim[:, :, None], -1)
        self.free = victim
        self.count -= 1

    def advance(self) -> None:
        """No eviction this step: the next entry goes to the next never-used slot."""
        self.free.fill_(self.count)


@torch.no_grad()
def _stream_loop(
    model, tokens, policy, budgets, mode, ref, doc, generate_from: int | None = None
) -> StreamOutput:
    """The token loop. With `generate_from=P`, tokens from position P on are not read from `tokens`
    but generated greedily (each step's argmax is the next step's input); see `generate`."""
    cfg = model.cfg
    if generate_from is not None:
        tokens = tokens.clone()
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    B, n = inp.shape
    H, Hkv, D, L = cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.n_layer
    G = H // Hkv
    device, dtype = tokens.device, model.wte.weight.dtype
    like = torch.empty(0, dtype=dtype, device=device)
    slots = [min(b + 1, n) for b in budgets]
    caches = [LayerCache(B, Hkv, S, D, like) for S in slots]
    states = [policy.init_state(B, Hkv, S, like) for S in slots]
    cos, sin = _rope_tables(model, n, device, dtype)
    rope, cache_mode = cos is not None, mode is PositionMode.cache
    scale = D**-0.5

    nll = torch.empty(B, n, dtype=dtype, device=device)
    correct = torch.empty(B, n, dtype=dtype, device=device)
    kl = torch.empty(B, n, dtype=dtype, device=device) if ref is not None else None
    agree = torch.empty(B, n, dtype=dtype, device=device) if ref is not None else None
    lost = (
        torch.empty(B, n, L, dtype=dtype, device=device) if ref is not None and ref.attn is not None else None
    )
    occupancy = torch.empty(n, L, dtype=torch.long, device=device)
    policy_s = 0.0

    def make_attn(l: int, t: int):
        a, c, st, budget = model.blocks[l].attn, caches[l], states[l], budgets[l]

        def attn_fn(h):
            nonlocal policy_s
            q, k, v = a.project(h)  # [B, H, 1, D], [B, Hkv, 1, D] x2
            init = policy.entry_state(k) if st else {}
            if rope and not cache_mode:  # keys stored rotated at their text position
                q, k = rotate(q, cos[t], sin[t]), rotate(k, cos[t], sin[t])
            c.write(k, v, t, st, init)
            U = c.used
            K, V, P = c.k[:, :, :U], c.v[:, :, :U], c.pos[:, :, :U]
            valid = P >= 0
            if rope and cache_mode:  # re-index: ranks 0..m-1 inside the cache, the query last
                r = _ranks(P[0, 0]) if policy.position_only else _ranks(P)  # one layout, or per doc/head
                K = rotate(K, cos[r], sin[r])
                q = rotate(q, cos[c.count - 1], sin[c.count - 1])
            row = None
            if policy.needs_attention:
                qg = q.view(B, Hkv, G, D)
                s = torch.einsum("bkgd,bksd->bkgs", qg, K) * scale
                w = s.masked_fill(~valid[:, :, None], float("-inf")).softmax(-1)
                y = torch.einsum("bkgs,bksd->bkgd", w, V).reshape(B, 1, H * D)
                row = w.mean(2)
            else:
                mask = valid[:, :, None, :].repeat_interleave(G, 1)
                y = a.attend(q, K, V, mask=mask)
            if lost is not None:
                full_row = ref.attn[l][:, :, t]  # [B, H, n]
                Ph = P.repeat_interleave(G, 1)
                held = full_row.gather(-1, Ph.clamp(min=0)).masked_fill(Ph < 0, 0).sum(-1)
                lost[:, t, l] = 1 - held.mean(1)
            if policy.evicts and (policy.needs_attention or c.count > budget):
                t0 = time.perf_counter()
                future = None
                if ref is not None and ref.future is not None:
                    fut_row = ref.future[l][:, :, t]  # [B, Hkv, n]

                    def future(pos, fut_row=fut_row):
                        return fut_row.gather(-1, pos.clamp(min=0)).masked_fill(pos < 0, 0)

                stv = {name: s_[:, :, :U] for name, s_ in st.items()}
                ctx = StepContext(t, l, budget, P, c.k[:, :, :U], row, stv, doc, future)
                policy.observe(ctx)
                if c.count > budget:
                    c.evict(choose_victim(policy.scores(ctx), P))
                else:
                    c.advance()
                policy_s += time.perf_counter() - t0
            else:
                c.advance()
            occupancy[t, l] = c.count
            return a.out(y)

        return attn_fn

    for t in range(n):
        x = model.embed(inp[:, t : t + 1], torch.tensor([t], device=device))
        for l, block in enumerate(model.blocks):
            x = block(x, attn=make_attn(l, t))
        logp = F.log_softmax(model.head(x)[:, 0], dim=-1)  # [B, V]
        if generate_from is not None and t + 1 >= generate_from:
            tokens[:, t + 1] = logp.argmax(-1)  # tgt and inp are views of tokens
        nll[:, t] = -logp.gather(-1, tgt[:, t : t + 1])[:, 0]
        correct[:, t] = logp.argmax(-1) == tgt[:, t]
        if ref is not None:
            kl[:, t], agree[:, t] = _metrics_vs_full(logp, ref, t)
    out = StreamOutput(nll, occupancy, "loop", budgets, kl, agree, lost, correct=correct)
    out.policy_seconds = policy_s
    out.kept = [c.pos.clone() for c in caches]
    if generate_from is not None:
        out.generated = tokens[:, generate_from:]
    return out


# ------------------------------------------------------------------------------------------- public


def stream(
    model: GPT,
    tokens: torch.Tensor,
    policy: Policy,
    budget: int,
    *,
    position_mode: PositionMode | str = PositionMode.original,
    allocation: Allocation | str = Allocation.uniform,
    reference: FullReference | None = None,
    force_loop: bool = False,
    doc: torch.Tensor | None = None,
) -> StreamOutput:
    """Stream tokens [B, T] (each row a document starting with its prefix) under `policy` at `budget`.

    `reference` (from `full_reference`) enables KL / agreement / attention diagnostics; the oracle
    needs one built with `future=True`.
    """
    mode = check_position_mode(model, position_mode)
    B, T = tokens.shape
    if T < 2:
        raise ConfigError(f"a stream needs at least 2 tokens, got {T}")
    n = T - 1
    budgets = budgets_for(model.cfg.n_layer, policy, budget, allocation, n)
    if policy.needs_future and (reference is None or reference.future is None):
        raise ValueError(f"strategy {policy.name!r} needs reference=full_reference(..., future=True)")
    doc = doc if doc is not None else torch.arange(B, device=tokens.device)
    model.eval()
    start = time.perf_counter()
    if policy.recompute:
        out = _stream_recompute(model, tokens, budgets, mode, reference)
    elif parallel_ok(policy, mode) and not force_loop:
        out = _stream_parallel(model, tokens, policy, budgets, reference)
    else:
        out = _stream_loop(model, tokens, policy, budgets, mode, reference, doc)
    out.seconds = time.perf_counter() - start
    if reference is not None:
        out.sink_mass = reference.sink_mass
    return out


@torch.no_grad()
def generate(
    model: GPT,
    prompt: torch.Tensor,
    policy: Policy,
    budget: int,
    n_new: int,
    *,
    position_mode: PositionMode | str = PositionMode.original,
    allocation: Allocation | str = Allocation.uniform,
    doc: torch.Tensor | None = None,
) -> torch.Tensor:
    """Greedy continuation [B, n_new] of prompt [B, P] with the cache evicted to `budget` every step
    (the prompt is streamed token by token under the policy first, exactly as in `stream`)."""
    mode = check_position_mode(model, position_mode)
    if policy.needs_future:
        raise ConfigError(f"strategy {policy.name!r} cannot generate: it needs the full-cache run's future")
    B, P = prompt.shape
    if P < 1 or n_new < 1:
        raise ConfigError(f"generation needs a prompt and n_new >= 1 (got P={P}, n_new={n_new})")
    tokens = torch.cat([prompt, prompt.new_zeros(B, n_new)], dim=1)
    budgets = budgets_for(model.cfg.n_layer, policy, budget, allocation, tokens.shape[1] - 1)
    model.eval()
    if not policy.recompute:
        doc = doc if doc is not None else torch.arange(B, device=prompt.device)
        return _stream_loop(model, tokens, policy, budgets, mode, None, doc, generate_from=P).generated
    W = budgets[0] + 1  # recompute: a fresh forward over the last W tokens for each new token
    seq = prompt
    for _ in range(n_new):
        lo = max(0, seq.shape[1] - W)
        pos = torch.arange(seq.shape[1] - lo, device=seq.device) + (
            lo if mode is PositionMode.original else 0
        )
        x = model.embed(seq[:, lo:], pos)
        for block in model.blocks:
            x = block(x, pos)
        seq = torch.cat([seq, model.head(x[:, -1]).argmax(-1, keepdim=True)], dim=1)
    return seq[:, P:]
