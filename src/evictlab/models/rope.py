"""Rotary position embedding (RoPE): the functions the model applies, and `Rope`, the tables one stream
computes once and every engine path reads.

Rotate-half layout (GPT-NeoX/Llama): a head's first R dims (R = model.rope_dims; all of them unless the model
rotates a fraction) are two halves x1, x2, rotated as (x1 cos - x2 sin, x1 sin + x2 cos) with angle
pos * base^(-2i/R); the other dims pass through. Cache position mode re-rotates held keys by rank at every
step, in pair order (x1_0, x2_0, x1_1, ...) as one complex multiply (`Rope.rotate_ranks`); queries and
keys in the same order give the same scores.
"""

from __future__ import annotations

import torch


def rope_angles(pos: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape pos.shape + [head_dim // 2], computed in float64 for exact positions."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=pos.device) / head_dim)
    angles = pos.to(torch.float64)[..., None] * inv_freq
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [..., D] with cos/sin [..., R/2] broadcastable to x's leading dims; the
    first R dims rotate and the rest pass through (partial rotary when R < D)."""
    r = 2 * cos.shape[-1]
    rot, rest = (x, None) if r == x.shape[-1] else (x[..., :r], x[..., r:])
    x1, x2 = rot.chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out if rest is None else torch.cat((out, rest), dim=-1)


def apply_rope(x: torch.Tensor, pos: torch.Tensor, base: float, dims: int | None = None) -> torch.Tensor:
    """Rotate the first `dims` (default all) of x [..., T, D] by positions pos (broadcastable)."""
    cos, sin = rope_angles(pos, dims or x.shape[-1], base)
    return rotate(x, cos.to(x.dtype), sin.to(x.dtype))


class Rope:
    """RoPE for one stream, built once by the path that runs it: cos, sin by text position computed `chunk`
    positions at a time (flat memory in stream length; the values equal a table over the whole stream and
    the model's own `apply_rope`), and for cache mode the rows of ranks 0 .. slots-1 from one fixed table.
    For a model with learned positions (`cfg.pos_emb` not rope) it is the identity (`enabled` False)."""

    def __init__(self, cfg, like: torch.Tensor, slots: int = 1, chunk: int = 4096):
        self.enabled = cfg.pos_emb == "rope"
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

    @classmethod
    def for_model(cls, model, device: torch.device, slots: int = 1) -> Rope:
        """The tables of `model` (a GPT) in its weights' dtype on `device`."""
        return cls(model.cfg, torch.empty(0, dtype=model.wte.weight.dtype, device=device), slots)

    def _table(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._angles(torch.arange(start, start + n, device=self.like.device))

    def _angles(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_angles(pos, self.dims, self.base)
        return cos.to(self.like.dtype), sin.to(self.like.dtype)

    def __call__(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [B, H, m, D] rotated at text positions pos [m] (shared by the rows) or [B, m] (per row)."""
        if not self.enabled:
            return x
        cos, sin = self.rows(pos)
        return rotate(x, *((cos, sin) if pos.dim() == 1 else (cos[:, None], sin[:, None])))

    def rows(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [*pos.shape, R/2] of text positions pos (any shape), from the current chunk's table,
        moved to the chunk that holds the lowest position when pos leaves it."""
        self._cover(int(pos.min()), int(pos.max()))
        idx = pos - self.start
        return self.cos[idx], self.sin[idx]

    def _cover(self, lo: int, hi: int) -> None:
        """Make the text-position table hold positions lo .. hi: unchanged when it does, else a table
        from the chunk boundary at or below lo, at least `chunk` rows long."""
        if not (self.start <= lo and hi < self.start + len(self.cos)):
            self.start = lo - lo % self.chunk
            self.cos, self.sin = self._table(self.start, max(self.chunk, hi + 1 - self.start))

    def at(self, t: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of text position t (a 0-dim tensor t is computed in place: the same values)."""
        if isinstance(t, torch.Tensor):
            cos, sin = self._angles(t.view(1))
            return cos[0], sin[0]
        self._cover(t, t)
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
