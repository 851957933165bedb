"""The full-cache reference: one teacher-forced forward that keeps what the diagnostics need of its
attention, and the per-token metrics every path computes against it (NLL, top-1 correctness, KL and
agreement with the full cache)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from evictlab.eval.caches import N_FIRST  # the first positions: `first4_mass` is the attention on them
from evictlab.models.gpt import GPT, CausalSelfAttention
from evictlab.models.rope import Rope

Tick = Callable[[int], None]  # told each block's token-steps as they are recorded (eval/progress.py)

ROW_BYTES = 256 << 20  # attention rows a reference computes (and keeps) at once, summed over its layers


def row_chunk(L: int, B: int, H: int, n: int) -> int:
    """Queries per chunk of attention rows: L layers' chunks of [B, H, chunk, n] floats fit ROW_BYTES."""
    return max(16, min(n, ROW_BYTES // max(1, 4 * L * B * H * n)))


def scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Scaled attention scores [B, H, m, e] of queries q [B, H, m, D] on keys k [B, Hkv, e, D]: each KV
    head's query heads are the rows of one matmul (grouped-query attention without repeating the keys)."""
    B, H, m, D = q.shape
    Hkv, e = k.shape[1], k.shape[-2]
    return (q.reshape(B, Hkv, (H // Hkv) * m, D) @ k.transpose(-1, -2)).view(B, H, m, e) * D**-0.5


def future_keys(s: int, e: int, device) -> torch.Tensor:
    """[e - s, e]: True where key j (0 .. e-1) lies after query i (at position s + i)."""
    return torch.arange(e, device=device)[None, :] > torch.arange(s, e, device=device)[:, None]


def causal_weights(q: torch.Tensor, k: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(causal attention weights [B, H, m, e], their log normaliser [B, H, m]) of the queries at positions
    s .. s+m-1 (q [B, H, m, D]) over the keys at positions 0 .. e-1 (k [B, Hkv, e, D], e = s + m)."""
    x = scores(q, k).masked_fill_(future_keys(s, k.shape[2], q.device), float("-inf"))
    lse = x.logsumexp(-1)
    return x.sub_(lse[..., None]).exp_(), lse


class FullAttention:
    """The full cache's attention, never held as L x [B, H, n, n] (a 30-layer model over 4,096 tokens
    would need 18 GB per stream): each layer's queries and keys as the full-cache forward rotated them,
    and the per-query summaries every run reads, computed once in the forward. Attention lost needs only
    the held keys' scores and the log normaliser; the oracle's future attention is recomputed from the
    rows a chunk of queries at a time (one chunk kept per layer).

    first [L, B, H, n]: attention on position 0; first4 [B, n, L]: on the first N_FIRST positions, mean
    over heads; by_key_sum [L, n]: attention each key receives, summed over documents, heads and queries;
    lse [L, B, H, n]: each query's log normaliser (logsumexp of its scores), so the full cache's attention
    on any set of keys is a sum over that set alone (`held_mass`: attention lost costs O(budget) per
    query, not O(n)). q, k (None when only the summaries were asked for): per layer [B, H, n, D] and
    [B, Hkv, n, D]."""

    def __init__(self, first, first4, by_key_sum, lse, q=None, k=None):
        self.first, self.first4, self.by_key_sum, self.lse = first, first4, by_key_sum, lse
        self.q, self.k = q, k
        L, B, H, n = first.shape
        self.n, self.chunk = n, row_chunk(L, B, H, n)
        self._rows: dict[int, tuple[int, torch.Tensor]] = {}  # layer -> (chunk start, `_chunk`'s suffix)
        self._after: dict[int, torch.Tensor] = {}  # layer -> attention from the queries after each chunk

    @property
    def has_rows(self) -> bool:
        return self.q is not None

    def rows(self, l: int, s: int, e: int) -> torch.Tensor:
        """[B, H, e-s, e]: the attention of the queries at s .. e-1 on the keys 0 .. e-1 in layer l."""
        if self.q is None:
            raise ValueError("this full-cache reference kept no queries and keys (rows=False)")
        x = scores(self.q[l][:, :, s:e], self.k[l][:, :, :e]) - self.lse[l][:, :, s:e, None]  # (its lse kept)
        return x.exp_().masked_fill_(future_keys(s, e, self.lse.device), 0)

    def held_mass(self, l: int, t: int, pos: torch.Tensor) -> torch.Tensor:
        """[B, H]: query t's full-cache attention in layer l on the positions pos [B, Hkv, S] (-1 = empty):
        exp(score - the query's log normaliser) summed over the held keys, each query head over its KV
        head's positions."""
        B, Hkv, S = pos.shape
        k = self.k[l].gather(2, pos.clamp(min=0)[..., None].expand(B, Hkv, S, self.k[l].shape[-1]))
        w = (scores(self.q[l][:, :, t : t + 1], k)[:, :, 0] - self.lse[l][:, :, t, None]).exp()  # [B, H, S]
        held = (pos >= 0).repeat_interleave(w.shape[1] // Hkv, 1)
        return (w * held).sum(-1)

    def held_mass_steps(self, l: int, s: int, pos: torch.Tensor) -> torch.Tensor:
        """[B, H, c]: `held_mass` of the queries s .. s+c-1 in layer l, each on its own held positions
        pos [B, Hkv, c, S] (a block of steps at once). The queries' scores on every key up to the last
        query, then each query's held ones picked out: one matmul instead of gathering S keys of D dims per
        query (which took 22 of SmolLM2 H2O's 76 s at batch 8 x 1,024 tokens under cProfile, 2026-12-05)."""
        B, Hkv, c, S = pos.shape
        H = self.q[l].shape[1]
        x = scores(self.q[l][:, :, s : s + c], self.k[l][:, :, : s + c])  # [B, H, c, s+c]
        idx = pos.repeat_interleave(H // Hkv, 1)  # [B, H, c, S]
        w = (x.gather(-1, idx.clamp(min=0)) - self.lse[l][:, :, s : s + c, None]).exp_()
        return w.masked_fill_(idx < 0, 0).sum(-1)

    def window_mass(self, l: int, s: int, e: int, window: tuple[int, int | None]) -> torch.Tensor:
        """[B, H, e-s]: the full-cache attention of the queries s .. e-1 in layer l on the keys a static
        window keeps (the first n_sink positions and the last `lookback` before each query; all when lookback
        is None), from the keys it can reach alone."""
        n_sink, lookback = window
        lo = 0 if lookback is None else max(0, s - lookback)
        keys = torch.arange(lo, e, device=self.lse.device)
        if n_sink and lo > 0:
            keys = torch.cat([torch.arange(min(n_sink, lo), device=keys.device), keys])
        qpos = torch.arange(s, e, device=keys.device)
        visible = keys[None, :] <= qpos[:, None]
        if lookback is not None:
            visible &= (keys[None, :] < n_sink) | (keys[None, :] >= qpos[:, None] - lookback)
        x = scores(self.q[l][:, :, s:e], self.k[l][:, :, keys]) - self.lse[l][:, :, s:e, None]
        return x.exp_().masked_fill_(~visible, 0).sum(-1)

    def _chunk(self, l: int, t: int) -> tuple[int, torch.Tensor]:
        """(start, suffix [B, Hkv, m, e]) of the chunk of queries holding t in layer l: suffix[..., j, :]
        is the attention each key gets from the chunk's queries after its j-th, summed over each KV head's
        query heads (computed once per chunk, so each step of the oracle costs O(n), not O(chunk x n))."""
        start = t - t % self.chunk
        if self._rows.get(l, (-1,))[0] != start:
            rows = self.rows(l, start, min(self.n, start + self.chunk))
            B, H, m, e = rows.shape
            Hkv = self.k[l].shape[1]
            per_kv = rows.view(B, Hkv, H // Hkv, m, e).sum(2)  # [B, Hkv, m, e]
            after = per_kv.flip(2).cumsum(2).flip(2)[:, :, 1:]  # from the queries after each one
            suffix = torch.cat([after, torch.zeros_like(per_kv[:, :, :1])], 2)  # (none after the last)
            self._rows[l] = (start, suffix)
        return self._rows[l]

    def future(self, l: int, t: int) -> torch.Tensor:
        """[B, Hkv, n]: the attention key j receives from the queries after t in layer l, summed over the
        query heads of each KV head (the oracle's score)."""
        start, suffix = self._chunk(l, t)
        if l not in self._after:
            self._after[l] = self._later_chunks(l)
        out = self._after[l][start // self.chunk].clone()
        out[..., : suffix.shape[-1]] += suffix[:, :, t - start]
        return out

    def _later_chunks(self, l: int) -> torch.Tensor:
        """[chunks, B, Hkv, n]: for each chunk, the attention from every query after it."""
        B, Hkv = self.k[l].shape[:2]
        starts = list(range(0, self.n, self.chunk))
        out = self.k[l].new_zeros(len(starts), B, Hkv, self.n)
        for i in range(len(starts) - 2, -1, -1):
            s, e = starts[i + 1], min(self.n, starts[i + 1] + self.chunk)
            out[i] = out[i + 1]
            out[i, ..., :e] += self.rows(l, s, e).reshape(B, Hkv, -1, e).sum(2)
        return out

    def summaries(self) -> FullAttention:
        """This without its queries and keys (nor the oracle's rows computed from them): what a run keeps of
        each batch once it is streamed (SmolLM2 at 5 x 2,047 tokens: 11 MB instead of about 1.3 GB)."""
        return FullAttention(self.first, self.first4, self.by_key_sum, self.lse)

    def first_position_mass(self) -> torch.Tensor:
        """[L, H]: attention on position 0, mean over documents and queries, per layer and head."""
        return self.first.mean(dim=(1, 3))

    def attention_by_key(self) -> torch.Tensor:
        """[L, n]: mean attention each key position receives from the queries that can see it (averaged
        over documents, heads and later queries): where does the model attend?"""
        L, B, H, n = self.first.shape
        seen = B * H * torch.arange(n, 0, -1, device=self.first.device, dtype=self.first.dtype)
        return self.by_key_sum / seen

    def tensors(self) -> dict[str, torch.Tensor]:
        """Everything this holds, by name (for eval/shared.py's store; `from_tensors` reads it back)."""
        out = {"first": self.first, "first4": self.first4, "by_key_sum": self.by_key_sum, "lse": self.lse}
        for l in range(len(self.q or [])):
            out[f"q{l}"], out[f"k{l}"] = self.q[l], self.k[l]
        return out

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> FullAttention:
        L = t["first"].shape[0]
        q = [t[f"q{l}"] for l in range(L)] if "q0" in t else None
        k = [t[f"k{l}"] for l in range(L)] if "k0" in t else None
        return cls(t["first"], t["first4"], t["by_key_sum"], t["lse"], q, k)


@dataclass
class FullReference:
    """The full-cache run of the same model on the same tokens (one teacher-forced forward)."""

    logp: torch.Tensor  # [B, n, V] log-probs of step t's prediction
    attention: FullAttention | None = None  # its attention (summaries, and rows on demand)


def token_metrics(
    logp: torch.Tensor, target: torch.Tensor, ref_logp: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """Per predicted token, from log-probs logp [..., V] and the true next tokens target [...]: nll, correct
    (the true token has the highest probability) and, given the full cache's log-probs, kl = KL(p_full ||
    p) and agree (the full cache's top-1 token has the policy's highest probability too).

    "Highest" is a comparison with the row's maximum, not an argmax index (a vocabulary-wide argmax costs
    5x a max on the CPU: 26 ms against 5 ms for 128 x 49,152 log-probs); they differ only on exact ties."""
    top = logp.amax(-1)
    nll = -logp.gather(-1, target[..., None])[..., 0]
    out = {"nll": nll, "correct": (-nll >= top).to(logp.dtype)}
    if ref_logp is not None:
        out["kl"] = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
        ref_top1 = ref_logp.argmax(-1, keepdim=True)
        out["agree"] = (logp.gather(-1, ref_top1)[..., 0] >= top).to(logp.dtype)
    return out


class Recorder:
    """Per-token metrics of a static path, block by block: nll and correct for every position, KL and
    agreement where the full-cache reference covers it (NaN beyond), attention lost where its attention
    does."""

    def __init__(
        self,
        tgt: torch.Tensor,
        windows: list[tuple[int, int | None]] | None,
        ref: FullReference | None,
        tick: Tick | None = None,
    ):
        self.tgt, self.windows, self.ref, self.tick = tgt, windows, ref, tick
        self.covered = 0 if ref is None else ref.logp.shape[1]  # the reference covers steps < covered
        self.out: dict[str, torch.Tensor] = {}

    def _write(self, name: str, s: int, value: torch.Tensor) -> None:
        if name not in self.out:  # NaN where a block never writes (beyond the reference)
            shape = (*self.tgt.shape, *value.shape[2:])
            self.out[name] = value.new_full(shape, float("nan"))
        self.out[name][:, s : s + value.shape[1]] = value

    ROWS = 32  # predictions per chunk of metrics (below)

    def add(self, s: int, logits: torch.Tensor) -> None:
        """Record the block of predictions for steps s .. s + logits.shape[1] - 1.

        A few steps at a time, about ROWS rows of [V]: the metrics pass over each row's vocabulary several
        times, and a whole block's temporaries ([8, 256, 49,152] on SmolLM2) go to memory on every pass
        (2.1 s against 0.6 s per block of 8 x 256, the same values: benchmarks/README.md)."""
        B, e = logits.shape[0], s + logits.shape[1]
        step = max(1, self.ROWS // B)
        for a in range(s, e, step):
            b = min(e, a + step)
            logp = F.log_softmax(logits[:, a - s : b - s], dim=-1)
            c = min(b, self.covered)  # the reference covers steps a .. c-1 of this chunk
            if c == b:
                metrics = token_metrics(logp, self.tgt[:, a:b], self.ref.logp[:, a:b])
            else:
                metrics = token_metrics(logp, self.tgt[:, a:b], None)
                if c > a:
                    part = token_metrics(logp[:, : c - a], self.tgt[:, a:c], self.ref.logp[:, a:c])
                    metrics |= {"kl": part["kl"], "agree": part["agree"]}  # shorter: written from a
            for name, value in metrics.items():
                self._write(name, a, value)
        if self.tick is not None:  # (eval/progress.py)
            self.tick(B * (e - s))
        if self.ref is None or s >= self.covered:
            return
        c = min(e, self.covered)
        attention = self.ref.attention
        if attention is not None and attention.has_rows and self.windows is not None:  # (blocked: its own)
            self._write("lost", s, self.lost(s, c))

    def lost(self, s: int, c: int) -> torch.Tensor:
        """[B, c-s, L]: the full-cache attention of steps s .. c-1 on keys outside each layer's window (from
        the keys the window holds alone, a chunk of steps at a time: eval/full.py `window_mass`)."""
        attention = self.ref.attention
        out = attention.lse.new_empty(self.tgt.shape[0], c - s, len(self.windows))
        for l, window in enumerate(self.windows):
            for a in range(s, c, attention.chunk):
                b = min(c, a + attention.chunk)
                out[:, a - s : b - s, l] = 1 - attention.window_mass(l, a, b, window).mean(1)
        return out


def gather_rows(rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """rows [..., n] indexed by pos [..., S] (-1 = empty slot, which gets 0)."""
    return rows.gather(-1, pos.clamp(min=0)).masked_fill(pos < 0, 0)


class _ChunkedExplicit:
    """Causal attention computed with explicit weights (SDPA does not return them) a chunk of queries at
    a time, so no layer ever holds [B, H, n, n]: each chunk's weights give its output and are reduced at
    once to the summaries FullAttention keeps (with `rows`, the rotated queries and keys are kept too)."""

    def __init__(self, pos: torch.Tensor, L: int, rows: bool, rope: Rope):
        self.pos, self.keep_rows, self.L, self.rope = pos, rows, L, rope
        self.first, self.first4, self.by_key, self.lse, self.q, self.k = [], [], [], [], [], []

    def __call__(self, l: int, a: CausalSelfAttention, h: torch.Tensor) -> torch.Tensor:
        q, k, v = a.project(h)
        q, k = self.rope(q, self.pos), self.rope(a.smear(k), self.pos)
        B, H, n, D = q.shape
        Hkv = k.shape[1]
        first, first4, by_key, lse = (
            q.new_empty(B, H, n),
            q.new_empty(B, n),
            q.new_zeros(n),
            q.new_empty(B, H, n),
        )
        y = q.new_empty(B, H, n, D)
        chunk = row_chunk(self.L, B, H, n)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            w, lse[:, :, s:e] = causal_weights(q[:, :, s:e], k[:, :, :e], s)  # [B, H, m, e], [B, H, m]
            y[:, :, s:e] = (w.reshape(B, Hkv, -1, e) @ v[:, :, :e]).view(B, H, e - s, D)
            first[:, :, s:e] = w[..., 0]
            first4[:, s:e] = w[..., :N_FIRST].sum(-1).mean(1)
            by_key[:e] += w.sum(dim=(0, 1, 2))
        self.first.append(first)
        self.first4.append(first4)
        self.by_key.append(by_key)
        self.lse.append(lse)
        if self.keep_rows:
            self.q.append(q)
            self.k.append(k)
        return a.out(y.transpose(1, 2).reshape(B, n, H * D))

    def attention(self) -> FullAttention:
        rows = (self.q, self.k) if self.keep_rows else (None, None)
        first, first4 = torch.stack(self.first), torch.stack(self.first4, -1)
        return FullAttention(first, first4, torch.stack(self.by_key), torch.stack(self.lse), *rows)


@torch.no_grad()
def full_reference(
    model: GPT, tokens: torch.Tensor, attention: bool = True, rows: bool = True
) -> FullReference:
    """One teacher-forced forward over tokens[:, :-1]; with `attention`, its attention (`FullAttention`:
    the summaries, and with `rows` the queries and keys its rows are recomputed from)."""
    inp = tokens[:, :-1]
    pos = torch.arange(inp.shape[1], device=tokens.device)
    attend = _ChunkedExplicit(
        pos, model.cfg.n_layer, rows and attention, Rope.for_model(model, tokens.device)
    )
    logp = F.log_softmax(model.forward_with(inp, pos, attend), dim=-1)
    return FullReference(logp=logp, attention=attend.attention() if attention else None)


@torch.no_grad()
def attention_summary(model: GPT, tokens: torch.Tensor) -> FullAttention:
    """The full cache's attention summaries over tokens [B, n] (no rows, and the head only at the last
    position: no [B, n, vocab] logits), for metrics of the model itself (eval/sinks.py)."""
    pos = torch.arange(tokens.shape[1], device=tokens.device)
    attend = _ChunkedExplicit(pos, model.cfg.n_layer, rows=False, rope=Rope.for_model(model, tokens.device))
    model.forward_with(tokens, pos, attend, last_only=True)
    return attend.attention()
