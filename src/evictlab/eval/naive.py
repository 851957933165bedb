"""The naive loop: the lesson's style on purpose (batch 1, `torch.cat`, explicit attention).

It is what the tests hold every engine path to, and the benchmark's baseline. It shares only the model's
projection/RoPE steps and each policy's `scores` with the engine; cache layout, slot reuse, masking,
position re-indexing and batching are all done here the simple way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from evictlab.cache.budget import budgets_for
from evictlab.cache.policies import Policy, StepContext, choose_victim
from evictlab.eval.caches import N_FIRST
from evictlab.eval.full import FullReference
from evictlab.eval.spec import DEFAULT, PositionMode, StreamSpec, check_positions
from evictlab.models.gpt import GPT, PosEmb


class _NaiveCache:
    """One layer's entries as growing tensors: k, v [1, Hkv, m, D], pos [1, Hkv, m], policy state."""

    def __init__(self):
        self.k = self.v = self.pos = None
        self.last_raw = None  # the previous token's raw key (for smeared keys)
        self.state: dict[str, torch.Tensor] = {}
        self.dropped: dict[tuple[int, int], int] = {}  # (head, position < N_FIRST) -> the step evicting it
        self.t = 0  # the step of the last update

    def update(self, k, v, pos: int, state: dict[str, torch.Tensor] | None = None):
        """Append k, v [1, Hkv, 1, D] of step `pos` with the policy's state for it -> all held entries."""
        self.t, fresh = pos, state or {}
        p = torch.full((1, k.shape[1], 1), pos)
        if self.k is None:
            self.k, self.v, self.pos, self.state = k, v, p, fresh
            return self.k, self.v, self.pos
        self.k, self.v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.pos = torch.cat([self.pos, p], dim=2)
        self.state = {name: torch.cat([self.state[name], fresh[name]], dim=2) for name in fresh}
        return self.k, self.v, self.pos

    def evict(self, target: torch.Tensor | None) -> None:
        """Delete the entry at index target [1, Hkv] of each head, at the step of the last update (rows
        shift down); None: nothing."""
        victim, t = target, self.t
        if victim is None:
            return
        _, Hkv, m, D = self.k.shape
        for h in range(Hkv):
            p = int(self.pos[0, h, victim[0, h]])
            if p < N_FIRST:
                self.dropped[h, p] = t
        keep = torch.arange(m)[None, None, :] != victim[..., None]  # [1, Hkv, m]
        self.k = self.k[keep[..., None].expand_as(self.k)].view(1, Hkv, m - 1, D)
        self.v = self.v[keep[..., None].expand_as(self.v)].view(1, Hkv, m - 1, D)
        self.pos = self.pos[keep].view(1, Hkv, m - 1)
        for name, st in self.state.items():
            mask = keep.view(1, Hkv, m, *[1] * (st.dim() - 3)).expand_as(st)
            self.state[name] = st[mask].view(1, Hkv, m - 1, *st.shape[3:])


class _NaiveStep:
    """Every layer's attention and eviction for one document, step by step."""

    def __init__(self, model: GPT, policy: Policy, budgets, mode, reference, doc: int, row: int):
        self.model, self.policy, self.budgets, self.mode = model, policy, budgets, mode
        self.reference, self.doc, self.row = reference, doc, row
        self.rope = model.cfg.pos_emb is PosEmb.rope
        self.caches = [_NaiveCache() for _ in range(model.cfg.n_layer)]
        self.ablated = policy.ablated(model.cfg.n_layer) if policy.ablation else [False] * model.cfg.n_layer

    def __call__(self, l: int, t: int, a, h: torch.Tensor) -> torch.Tensor:
        cfg, c = self.model.cfg, self.caches[l]
        H, Hkv, D = cfg.n_head, cfg.kv_heads, cfg.head_dim
        q, k, v = a.project(h)
        k, c.last_raw = a.smear(k, c.last_raw), k
        fresh = {**self.policy.init_state(1, Hkv, 1, k), **self.policy.entry_state(k)}
        if self.rope and self.mode is PositionMode.original:
            q, k = a.rotate(q, torch.tensor([t])), a.rotate(k, torch.tensor([t]))
        c.update(k, v, t, fresh)
        m = c.k.shape[2]
        keys, qq = c.k, q
        if self.rope and self.mode is PositionMode.cache:
            keys, qq = a.rotate(c.k, torch.arange(m)), a.rotate(q, torch.tensor([m - 1]))
        scores = qq @ keys.repeat_interleave(H // Hkv, dim=1).transpose(-1, -2) / D**0.5
        values = c.v
        if self.ablated[l] and t > 0:  # bos_ablation: position 0's key hidden, or its value zero
            first = (c.pos[0, 0] == 0).view(1, 1, 1, m)
            if self.policy.part == "key":
                scores = scores.masked_fill(first, float("-inf"))
            else:
                values = values * ~first.view(1, 1, m, 1)
        w = F.softmax(scores, dim=-1)  # [1, H, 1, m]
        y = (w @ values.repeat_interleave(H // Hkv, dim=1)).transpose(1, 2).reshape(1, 1, H * D)
        if self.policy.evicts:
            self.evict(l, t, c, w.view(1, Hkv, H // Hkv, m).mean(2))
        return a.out(y)

    def evict(self, l: int, t: int, c: _NaiveCache, row: torch.Tensor) -> None:
        future = None
        if self.policy.needs_future and self.reference is not None and self.reference.attention is not None:
            fut_row = self.reference.attention.future(l, t)[self.row : self.row + 1]  # [1, Hkv, n]

            def future(pos, fut_row=fut_row):
                return fut_row.gather(-1, pos)

        ctx = StepContext(t, l, self.budgets[l], c.pos, c.k, row, c.state, torch.tensor([self.doc]), future)
        self.policy.observe(ctx)
        if c.k.shape[2] > self.budgets[l]:
            c.evict(choose_victim(self.policy.scores(ctx), c.pos))


@torch.no_grad()
def naive_stream(
    model: GPT,
    tokens: torch.Tensor,
    policy: Policy,
    budget: int,
    spec: StreamSpec = DEFAULT,
    *,
    reference: FullReference | None = None,
    doc: int = 0,
    row: int = 0,
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Stream one document tokens [T]; returns per-token NLL [T-1], each layer's final positions and, per
    layer and KV head, the step whose eviction removed each of the first N_FIRST positions (-1: never):
    [L, Hkv, N_FIRST] (a recompute window: the last step whose window holds it, [L, 1, N_FIRST]).

    `reference`/`row`: the full-cache run (and this document's row in it), for the oracle.
    """
    check_positions(model.cfg, spec.position_mode)
    n = tokens.shape[0] - 1
    L, Hkv = model.cfg.n_layer, model.cfg.kv_heads
    budgets = budgets_for(L, policy, budget, spec.allocation, n)
    if policy.recompute:
        nll, last = _naive_recompute(model, tokens, budgets[0], policy.n_sink)
        return nll, [], last.expand(L, 1, N_FIRST)
    step = _NaiveStep(model, policy, budgets, spec.position_mode, reference, doc, row)
    nll = []
    for t in range(n):
        logits = model.forward_with(
            tokens[None, t : t + 1], torch.tensor([t]), lambda l, a, h, t=t: step(l, t, a, h)
        )
        nll.append(-F.log_softmax(logits[0, 0], dim=-1)[tokens[t + 1]])
    dropped = torch.full((L, Hkv, N_FIRST), -1, dtype=torch.long)
    for l, c in enumerate(step.caches):
        for (h, p), t in c.dropped.items():
            dropped[l, h, p] = t
    return torch.stack(nll), [c.pos for c in step.caches if c.pos is not None], dropped


def _naive_recompute(model: GPT, tokens: torch.Tensor, budget: int, n_sink: int = 0):
    """Sliding window with re-computation, one window at a time, re-encoded from position 0 (the first
    n_sink tokens first, once the prefix no longer fits) -> (NLL [T-1], [N_FIRST] the last step whose window
    holds each of the first positions, -1 every step)."""
    nll, n = [], tokens.shape[0] - 1
    last = torch.full((N_FIRST,), -1, dtype=torch.long)
    for t in range(n):
        if t <= budget:
            win, held = tokens[None, : t + 1], list(range(t + 1))
        else:
            win = torch.cat([tokens[:n_sink], tokens[t - budget + n_sink : t + 1]])[None]
            held = [*range(n_sink), *range(t - budget + n_sink, t + 1)]
        for p in range(N_FIRST):
            if p in held and t < n - 1:
                last[p] = t
            elif p in held:  # held at the last step: held at every step from p on
                last[p] = -1
        pos = torch.arange(win.shape[1])
        logp = F.log_softmax(model.forward_with(win, pos)[0, -1], dim=-1)
        nll.append(-logp[tokens[t + 1]])
    return torch.stack(nll), last
