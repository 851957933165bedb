"""The streaming engine: teacher-forced decoding of a batch of documents through a fixed-budget KV cache.

Three exact paths, chosen from the policy's own flags (``spec.force_loop`` always takes the token loop):

* **parallel** - position-static policies (`static_keep`) in ``original`` mode, and shift-invariant ones
  (a contiguous window: the same relative distances after re-indexing) in ``cache`` mode too: one
  forward with a per-layer keep mask.
* **loop** - one token per step over preallocated slot buffers (eval/loop.py).
* **recompute** - policies that keep no cache (`recompute`): every prediction is a fresh forward over the
  last budget+1 tokens, run as batched forwards over all windows.

Step t processes the token at position t and predicts token t+1 (t = 0 .. T-2). The query attends to
the entries kept after step t-1 (at most `budget`) plus itself; then the cache is evicted to budget.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from evictlab.cache.budget import budgets_for
from evictlab.cache.policies import Policy
from evictlab.errors import ConfigError
from evictlab.eval.full import FullReference, token_metrics
from evictlab.eval.loop import stream_loop
from evictlab.eval.spec import DEFAULT, PositionMode, StreamSpec, check_positions
from evictlab.models.gpt import GPT


@dataclass
class StreamOutput:
    nll: torch.Tensor  # [B, n] per predicted token
    correct: torch.Tensor  # [B, n] 1 where the policy's top-1 prediction is the true token
    occupancy: torch.Tensor  # [n, L] entries held after each step
    path: str  # parallel | loop | recompute
    budgets: list[int]  # per layer
    kl: torch.Tensor | None = None  # [B, n] KL(p_full || p_policy)
    agree: torch.Tensor | None = None  # [B, n] top-1 agreement with the full cache
    lost: torch.Tensor | None = None  # [B, n, L] full-cache attention on entries the policy does not hold
    sink_mass: torch.Tensor | None = None  # [B, n, L] (full-cache attention on the first positions)
    seconds: float = 0.0
    policy_seconds: float = 0.0  # time inside policy scoring and victim selection
    kept: list[torch.Tensor] = field(default_factory=list)  # per layer [B, Hkv, S] final positions (loop)


def parallel_ok(policy: Policy, mode: PositionMode) -> bool:
    if policy.recompute or policy.static_keep(1, 1, torch.device("cpu")) is None:
        return False
    return mode is PositionMode.original or policy.shift_invariant


class _MaskedAttention:
    """Each layer's attention over the whole stream under its keep mask [n, n]."""

    def __init__(self, pos: torch.Tensor, keeps: list[torch.Tensor]):
        self.pos, self.keeps = pos, keeps

    def __call__(self, l: int, a, h: torch.Tensor) -> torch.Tensor:
        q, k, v = a.project(h)
        return a.out(a.attend(a.rotate(q, self.pos), a.rotate(k, self.pos), v, mask=self.keeps[l]))


def _static_output(logits, tgt, budgets, keeps, ref: FullReference | None, path: str) -> StreamOutput:
    """Per-token outputs of a path whose held entries follow a static keep mask per layer."""
    m = token_metrics(F.log_softmax(logits, dim=-1), tgt, None if ref is None else ref.logp)
    lost = None
    if ref is not None and ref.attn is not None:
        lost = torch.stack([1 - (a * k).sum(-1).mean(1) for a, k in zip(ref.attn, keeps, strict=True)], -1)
    steps = torch.arange(1, tgt.shape[1] + 1, device=tgt.device)
    occupancy = torch.stack([steps.clamp(max=b) for b in budgets], dim=-1)
    return StreamOutput(**m, occupancy=occupancy, path=path, budgets=budgets, lost=lost)


@torch.no_grad()
def _stream_parallel(model, tokens, policy, budgets, ref) -> StreamOutput:
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    n = inp.shape[1]
    pos = torch.arange(n, device=tokens.device)
    keeps = [policy.static_keep(n, b, tokens.device) for b in budgets]
    logits = model.forward_with(inp, pos, _MaskedAttention(pos, keeps))
    return _static_output(logits, tgt, budgets, keeps, ref, "parallel")


def recompute_windows(inp: torch.Tensor, W: int, mode: PositionMode):
    """The windows of the steps t = W .. n-1 of inp [B, n]: tokens [B * (n-W), W] (step t sees t-W+1 .. t)
    and their positions: 0 .. W-1 (re-encoded from position 0, `cache`) or the text positions (`original`)."""
    B, n = inp.shape
    rows = inp.unfold(1, W, 1)[:, 1:].reshape(-1, W)  # [B * (n-W), W]
    k = torch.arange(W, device=inp.device)
    if mode is PositionMode.cache:
        return rows, k
    starts = torch.arange(1, n - W + 1, device=inp.device).repeat(B)
    return rows, starts[:, None] + k


@torch.no_grad()
def _stream_recompute(model, tokens, policy, budgets, mode, ref, chunk_tokens: int = 2048) -> StreamOutput:
    """Window of the last W = budget + 1 tokens, re-encoded for every prediction.

    While t < W the window is the whole prefix 0..t at positions 0..t in both modes, i.e. the full
    cache: one causal forward covers those steps. Every later step is a full window of W tokens; all
    of them run as batched causal forwards (no padding, so the fused causal kernel applies), in chunks
    of about `chunk_tokens` tokens: larger chunks fall out of the CPU caches and run slower.
    """
    if len(set(budgets)) != 1:
        raise ConfigError(f"{policy.name} re-encodes one window for all layers: use allocation=uniform")
    W = budgets[0] + 1  # budget kept entries + the token itself
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    B, n = inp.shape
    parts = [model(inp[:, : min(W, n)])]  # steps 0 .. W-1: the window is the prefix
    if n > W:
        rows, pos = recompute_windows(inp, W, mode)
        step = max(1, chunk_tokens // W)
        tail = [
            model.forward_with(
                rows[r : r + step], pos if pos.dim() == 1 else pos[r : r + step], last_only=True
            )
            for r in range(0, rows.shape[0], step)
        ]
        parts.append(torch.cat(tail).view(B, n - W, -1))
    keeps = [policy.static_keep(n, b, tokens.device) for b in budgets]  # the tokens each window holds
    return _static_output(torch.cat(parts, dim=1), tgt, budgets, keeps, ref, "recompute")


def _loop_output(model, tokens, policy, budgets, mode, ref, doc) -> StreamOutput:
    per_token, loop, _ = stream_loop(model, tokens, policy, budgets, mode, ref, doc)
    lost = None if loop.lost is None else loop.lost.values
    return StreamOutput(
        **per_token,
        occupancy=loop.occupancy,
        path="loop",
        budgets=budgets,
        lost=lost,
        policy_seconds=loop.policy_seconds,
        kept=[c.pos.clone() for c in loop.caches],
    )


def stream(
    model: GPT,
    tokens: torch.Tensor,
    policy: Policy,
    budget: int,
    spec: StreamSpec = DEFAULT,
    *,
    reference: FullReference | None = None,
    doc: torch.Tensor | None = None,
) -> StreamOutput:
    """Stream tokens [B, T] (each row a document starting with its prefix) under `policy` at `budget`.

    `reference` (from `full_reference`) enables KL / agreement / attention diagnostics; a policy that
    `needs_future` needs one built with `future=True`. `doc`: the rows' global document indices.
    """
    check_positions(model.cfg, spec.position_mode)
    B, T = tokens.shape
    if T < 2:
        raise ConfigError(f"a stream needs at least 2 tokens, got {T}")
    budgets = budgets_for(model.cfg.n_layer, policy, budget, spec.allocation, T - 1)
    if policy.needs_future and (reference is None or reference.future is None):
        raise ConfigError(f"strategy {policy.name!r} needs reference=full_reference(..., future=True)")
    doc = doc if doc is not None else torch.arange(B, device=tokens.device)
    model.eval()
    start = time.perf_counter()
    if policy.recompute:
        out = _stream_recompute(model, tokens, policy, budgets, spec.position_mode, reference)
    elif parallel_ok(policy, spec.position_mode) and not spec.force_loop:
        out = _stream_parallel(model, tokens, policy, budgets, reference)
    else:
        out = _loop_output(model, tokens, policy, budgets, spec.position_mode, reference, doc)
    out.seconds = time.perf_counter() - start
    if reference is not None:
        out.sink_mass = reference.sink_mass()
    return out


@torch.no_grad()
def _generate_recompute(model: GPT, prompt: torch.Tensor, W: int, n_new: int, mode: PositionMode):
    """Greedy continuation without a cache: a fresh forward over the last W tokens for each new token."""
    seq = prompt
    for _ in range(n_new):
        lo = max(0, seq.shape[1] - W)
        pos = torch.arange(seq.shape[1] - lo, device=seq.device) + (
            lo if mode is PositionMode.original else 0
        )
        logits = model.forward_with(seq[:, lo:], pos, last_only=True)
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    return seq[:, prompt.shape[1] :]


@torch.no_grad()
def generate(
    model: GPT,
    prompt: torch.Tensor,
    policy: Policy,
    budget: int,
    n_new: int,
    spec: StreamSpec = DEFAULT,
    *,
    doc: torch.Tensor | None = None,
) -> torch.Tensor:
    """Greedy continuation [B, n_new] of prompt [B, P] with the cache evicted to `budget` every step
    (the prompt is streamed token by token under the policy first, exactly as in `stream`)."""
    check_positions(model.cfg, spec.position_mode)
    if policy.needs_future:
        raise ConfigError(f"strategy {policy.name!r} cannot generate: it needs the full-cache run's future")
    B, P = prompt.shape
    if P < 1 or n_new < 1:
        raise ConfigError(f"generation needs a prompt and n_new >= 1 (got P={P}, n_new={n_new})")
    tokens = torch.cat([prompt, prompt.new_zeros(B, n_new)], dim=1)
    budgets = budgets_for(model.cfg.n_layer, policy, budget, spec.allocation, tokens.shape[1] - 1)
    model.eval()
    if policy.recompute:
        return _generate_recompute(model, prompt, budgets[0] + 1, n_new, spec.position_mode)
    doc = doc if doc is not None else torch.arange(B, device=prompt.device)
    _, _, filled = stream_loop(model, tokens, policy, budgets, spec.position_mode, None, doc, generate_from=P)
    return filled[:, P:]
