"""The reference loop: the lesson's style on purpose (batch 1, `torch.cat`, explicit attention).

It is the test oracle for the engine and the benchmark's naive baseline. It shares only the model's
projection/RoPE steps and each policy's `scores` with the engine; cache layout, slot reuse, masking,
position re-indexing and batching are all done here the simple way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from evictlab.cache.policies import Policy, StepContext, choose_victim
from evictlab.eval.engine import FullReference, PositionMode, budgets_for, check_position_mode
from evictlab.models.gpt import GPT, PosEmb


@torch.no_grad()
def reference_stream(
    model: GPT,
    tokens: torch.Tensor,
    policy: Policy,
    budget: int,
    *,
    position_mode: PositionMode | str = PositionMode.original,
    allocation: str = "uniform",
    reference: FullReference | None = None,
    doc: int = 0,
    row: int = 0,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Stream one document tokens [T]; returns per-token NLL [T-1] and each layer's final positions.

    `reference`/`row`: the full-cache run (and this document's row in it), for the oracle.
    """
    mode = check_position_mode(model, position_mode)
    cfg = model.cfg
    n = tokens.shape[0] - 1
    budgets = budgets_for(model.cfg.n_layer, policy, budget, allocation, n)
    rope = cfg.pos_emb is PosEmb.rope
    H, Hkv, D = cfg.n_head, cfg.kv_heads, cfg.head_dim
    G = H // Hkv
    L = cfg.n_layer
    if policy.recompute:
        return _reference_recompute(model, tokens, budgets[0], mode), []
    K: list[torch.Tensor | None] = [None] * L
    V: list[torch.Tensor | None] = [None] * L
    P: list[torch.Tensor | None] = [None] * L
    S: list[dict[str, torch.Tensor] | None] = [None] * L
    nll = []
    for t in range(n):
        x = model.embed(tokens[None, t : t + 1], torch.tensor([t]))
        for l, block in enumerate(model.blocks):
            a = block.attn

            def attn_fn(h, l=l, a=a, t=t):
                q, k, v = a.project(h)
                fresh = {**policy.init_state(1, Hkv, 1, k), **policy.entry_state(k)}
                if rope and mode is PositionMode.original:
                    q, k = a.rotate(q, torch.tensor([t])), a.rotate(k, torch.tensor([t]))
                if K[l] is None:
                    K[l], V[l], P[l], S[l] = k, v, torch.full((1, Hkv, 1), t), fresh
                else:
                    K[l] = torch.cat([K[l], k], dim=2)
                    V[l] = torch.cat([V[l], v], dim=2)
                    P[l] = torch.cat([P[l], torch.full((1, Hkv, 1), t)], dim=2)
                    S[l] = {name: torch.cat([S[l][name], fresh[name]], dim=2) for name in fresh}
                m = K[l].shape[2]
                keys, qq = K[l], q
                if rope and mode is PositionMode.cache:
                    keys = a.rotate(K[l], torch.arange(m))
                    qq = a.rotate(q, torch.tensor([m - 1]))
                scores = qq @ keys.repeat_interleave(G, dim=1).transpose(-1, -2) / D**0.5
                w = F.softmax(scores, dim=-1)  # [1, H, 1, m]
                y = (w @ V[l].repeat_interleave(G, dim=1)).transpose(1, 2).reshape(1, 1, H * D)
                if policy.evicts:
                    future = None
                    if reference is not None and reference.future is not None:
                        fut_row = reference.future[l][row : row + 1, :, t]  # [1, Hkv, n]

                        def future(pos, fut_row=fut_row):
                            return fut_row.gather(-1, pos)

                    ctx = StepContext(t, l, budgets[l], P[l], K[l], w.view(1, Hkv, G, m).mean(2), S[l],
                                      torch.tensor([doc]), future)  # fmt: skip
                    policy.observe(ctx)
                    if m > budgets[l]:
                        victim = choose_victim(policy.scores(ctx), P[l])  # [1, Hkv]
                        keep = torch.arange(m)[None, None, :] != victim[..., None]  # [1, Hkv, m]
                        K[l] = K[l][keep[..., None].expand_as(K[l])].view(1, Hkv, m - 1, D)
                        V[l] = V[l][keep[..., None].expand_as(V[l])].view(1, Hkv, m - 1, D)
                        P[l] = P[l][keep].view(1, Hkv, m - 1)
                        S[l] = {
                            name: st[keep.view(1, Hkv, m, *[1] * (st.dim() - 3)).expand_as(st)].view(
                                1, Hkv, m - 1, *st.shape[3:]
                            )
                            for name, st in S[l].items()
                        }
                return a.out(y)

            x = block(x, attn=attn_fn)
        logp = F.log_softmax(model.head(x)[0, 0], dim=-1)
        nll.append(-logp[tokens[t + 1]])
    return torch.stack(nll), [p for p in P if p is not None]


def _reference_recompute(model: GPT, tokens: torch.Tensor, budget: int, mode: PositionMode) -> torch.Tensor:
    """Sliding window with re-computation, one window at a time."""
    nll = []
    for t in range(tokens.shape[0] - 1):
        lo = max(0, t - budget)
        win = tokens[None, lo : t + 1]
        pos = torch.arange(win.shape[1]) + (lo if mode is PositionMode.original else 0)
        x = model.embed(win, pos)
        for block in model.blocks:
            x = block(x, pos)
        logp = F.log_softmax(model.head(x)[0, -1], dim=-1)
        nll.append(-logp[tokens[t + 1]])
    return torch.stack(nll)
