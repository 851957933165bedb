"""The full-cache reference: one teacher-forced forward with explicit attention weights, and the per-token
metrics every path computes against it (NLL, top-1 correctness, KL and agreement with the full cache)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from evictlab.models.gpt import GPT, CausalSelfAttention

N_SINK_DIAG = 4  # "sink" positions for the attention-mass diagnostic


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

    def sink_mass(self) -> torch.Tensor | None:
        """[B, n, L]: attention on the first N_SINK_DIAG positions, mean over heads."""
        if self.attn is None:
            return None
        return torch.stack([a[..., :N_SINK_DIAG].sum(-1).mean(1) for a in self.attn], dim=-1)


def token_metrics(
    logp: torch.Tensor, target: torch.Tensor, ref_logp: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """Per predicted token, from log-probs logp [..., V] and the true next tokens target [...]: nll, correct
    (top-1 is the true token) and, given the full cache's log-probs, kl = KL(p_full || p) and agree (the
    same top-1 as the full cache)."""
    top1 = logp.argmax(-1)
    out = {
        "nll": -logp.gather(-1, target[..., None])[..., 0],
        "correct": (top1 == target).to(logp.dtype),
    }
    if ref_logp is not None:
        out["kl"] = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
        out["agree"] = (top1 == ref_logp.argmax(-1)).to(logp.dtype)
    return out


def gather_rows(rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """rows [..., n] indexed by pos [..., S] (-1 = empty slot, which gets 0)."""
    return rows.gather(-1, pos.clamp(min=0)).masked_fill(pos < 0, 0)


class _ExplicitCausal:
    """Causal attention with the weights kept (SDPA does not return them), per layer in order."""

    def __init__(self, n: int, pos: torch.Tensor, keep: bool):
        self.pos, self.keep, self.weights = pos, keep, []
        self.causal = torch.ones(n, n, dtype=torch.bool, device=pos.device).tril()

    def __call__(self, l: int, a: CausalSelfAttention, h: torch.Tensor) -> torch.Tensor:
        q, k, v = a.project(h)
        q, k = a.rotate(q, self.pos), a.rotate(a.smear(k), self.pos)
        B, H, n, D = q.shape
        G = H // k.shape[1]
        s = (q @ k.repeat_interleave(G, 1).transpose(-1, -2)) * D**-0.5
        w = s.masked_fill(~self.causal, float("-inf")).softmax(-1)
        if self.keep:
            self.weights.append(w)
        return a.out((w @ v.repeat_interleave(G, 1)).transpose(1, 2).reshape(B, n, H * D))


def future_attention(weights: list[torch.Tensor], Hkv: int) -> list[torch.Tensor]:
    """Per layer [B, Hkv, n, n]: the attention key j receives from the queries after step i, summed over
    the query heads of each KV head."""
    out = []
    for w in weights:
        B, H, n, _ = w.shape
        wk = w.view(B, Hkv, H // Hkv, n, n).sum(2)  # [B, Hkv, n, n]
        inclusive = wk.flip(2).cumsum(2).flip(2)  # sum over queries i' >= i
        out.append(inclusive - wk)  # strictly later queries
    return out


@torch.no_grad()
def full_reference(
    model: GPT, tokens: torch.Tensor, attention: bool = True, future: bool = False
) -> FullReference:
    """One teacher-forced forward over tokens[:, :-1] with explicit attention weights."""
    inp = tokens[:, :-1]
    pos = torch.arange(inp.shape[1], device=tokens.device)
    attend = _ExplicitCausal(inp.shape[1], pos, keep=attention or future)
    logp = F.log_softmax(model.forward_with(inp, pos, attend), dim=-1)
    fut = future_attention(attend.weights, model.cfg.kv_heads) if future else None
    return FullReference(logp=logp, attn=attend.weights if attention else None, future=fut)
