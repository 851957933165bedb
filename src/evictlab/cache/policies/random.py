from dataclasses import dataclass
from typing import ClassVar

import torch

from evictlab.cache.policies import register
from evictlab.cache.policies.base import Policy, StepContext, protect
from evictlab.errors import ConfigError

_MASK = 0xFFFFFFFF
_CHUNK = 256  # steps of per-(document, head) hash keys computed at once, per layer


def _mix(x: torch.Tensor | int) -> torch.Tensor | int:
    """A 32-bit integer hash on int64 tensors or Python ints, the same values (multipliers < 2**31, so
    products never overflow)."""
    x = x & _MASK
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _MASK
    return x ^ (x >> 16)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """`_mix` in place on an int32 tensor holding 32-bit values in two's complement: the same bits, at
    half the memory traffic (the multiplies wrap modulo 2**32, and the masks after each arithmetic
    shift clear the sign's copies, which makes it a logical shift)."""
    x ^= (x >> 16) & 0xFFFF
    x *= 0x7FEB352D
    x ^= (x >> 15) & 0x1FFFF
    x *= 0x2C1B3C6D
    x ^= (x >> 16) & 0xFFFF
    return x


def _int32(h: torch.Tensor) -> torch.Tensor:
    """Values in [0, 2**32) (int64) -> the int32 with the same 32 bits."""
    return ((h ^ 0x80000000) - 0x80000000).to(torch.int32)


@register
@dataclass
class Random(Policy):
    """Evict a uniformly random entry each step. The draw is a hash of (seed, document, layer, step,
    head, position), so it is reproducible and independent of batching or slot layout."""

    name: ClassVar[str] = "random"
    order: ClassVar[int] = 8
    reads_values: ClassVar[bool] = False  # (hashes of positions: `verify.decides`)
    seed: int = 0
    n_sink: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self._keys: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}  # layer -> (doc, t0, keys)

    def check_params(self) -> None:
        for key in ("seed", "n_sink"):
            if getattr(self, key) < 0:
                raise ConfigError(f"strategy.params.{key}={getattr(self, key)} must be >= 0")

    def min_budget(self) -> int:
        return self.n_sink + 1

    def hash_keys(
        self, doc: torch.Tensor, layer: int | torch.Tensor, t: int | torch.Tensor, Hkv: int
    ) -> torch.Tensor:
        """The hash of (seed, document, layer, step, head) for steps t (an int, a 0-dim or a 1-d tensor)
        -> int64 [B, steps, Hkv] (steps = 1 for a scalar t); or, with layer and t [B, 1, 1] (each row its
        own layer and step: the wavefront), [B, 1, Hkv]."""
        B = doc.shape[0]
        h = _mix(_mix(self.seed + 0x9E3779B) ^ doc.view(B, 1, 1))  # (the seed's mix on the host)
        per_row = isinstance(t, torch.Tensor) and t.dim() == 3
        steps = t.view(1, -1, 1) if isinstance(t, torch.Tensor) and not per_row else t
        h = _mix(h ^ (layer * 0x10001 + steps * 0x3F1))
        return _mix(h ^ torch.arange(Hkv, device=doc.device).view(1, 1, Hkv))

    def step_keys(self, ctx: StepContext) -> torch.Tensor:
        """`hash_keys` of the context's step as int32 [B, Hkv, 1], read from a table that holds _CHUNK
        steps per layer (computed once per chunk instead of ~30 small tensor operations per step)."""
        Hkv = ctx.pos.shape[1]
        if not isinstance(ctx.t, int):  # a tensor step (compiled loop, wavefront): no host-side table lookup
            return _int32(self.hash_keys(ctx.doc, ctx.layer, ctx.t, Hkv)).view(-1, Hkv, 1)
        doc, t0, keys = self._keys.get(ctx.layer, (None, -1, None))
        same_doc = doc is ctx.doc or (
            doc is not None and doc.device == ctx.doc.device and torch.equal(doc, ctx.doc)
        )
        if not (same_doc and keys.shape[2] == Hkv and t0 <= ctx.t < t0 + _CHUNK):
            t0 = ctx.t - ctx.t % _CHUNK
            steps = torch.arange(t0, t0 + _CHUNK, device=ctx.doc.device)
            keys = _int32(self.hash_keys(ctx.doc, ctx.layer, steps, Hkv))
            self._keys[ctx.layer] = (ctx.doc, t0, keys)
        return keys[:, ctx.t - t0, :, None]

    def scores(self, ctx: StepContext) -> torch.Tensor:
        h = _mix32_(ctx.pos.to(torch.int32) ^ self.step_keys(ctx))  # (empty slots' draws are not read)
        # the 32-bit value over 2**32; half floats through float32 (2**32 overflows float16)
        dtype = torch.float32 if ctx.keys.dtype == torch.float16 else ctx.keys.dtype
        draw = (h.view(torch.uint32).to(dtype) * 2.0**-32).to(ctx.keys.dtype)
        return protect(draw, ctx, n_sink=self.n_sink) if self.n_sink else draw
