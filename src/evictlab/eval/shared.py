"""The full-cache reference computed once per (checkpoint, streams): the runs of a sweep share it.

Every run of a sweep compares its policy with the full cache on the same streams through the same
checkpoint, so without sharing each run repeats the same forward (O(T^2) per stream: about two minutes
for one 65,536-token stream here). `SharedReferences` keeps the full cache's log-probs under
outputs/cache/references/<key>.safetensors: the first run that needs one computes it while holding the
file's lock, the others wait and read it. The key holds what the numbers depend on: the checkpoint (its
folder name and weights hash), the exact tokens (cut to the reference's cap), the block size, dtype and
device. How a reference is computed stays in `evaluate.reference_for`; this module only stores it.

With `eval.diagnostics=false` the entry is the chunked reference's log-probs only. With diagnostics on it
also holds the attention rows, [B, H, n, n] per layer (8 x 4 x 512 x 512 x 4 layers of float32 = 134 MB
for the default sweep's streams on gpt_small), since the attention-lost diagnostic of every policy reads
them; the oracle's future attention is derived from them on load. The two kinds are separate entries
(their log-probs differ by rounding).
An entry over MAX_BYTES (1 GiB: the attention rows of a long stream) is not stored: each run computes it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import torch
from filelock import FileLock
from safetensors.torch import load_file, save_file

from evictlab.eval.full import FullReference, future_attention
from evictlab.eval.spec import StreamSpec
from evictlab.models.gpt import GPT
from evictlab.store import stable_hash, write_atomic

MAX_BYTES = 1 << 30  # larger entries (attention rows of long streams) are computed by each run, not stored


class SharedReferences:
    """Full-cache log-probs by (checkpoint, tokens, settings), computed once and read by every later run."""

    def __init__(self, root: str | Path, checkpoint: str):
        self.root, self.checkpoint = Path(root), checkpoint
        self.computed = self.read = 0  # batches this process computed / read from the store

    def key(self, model: GPT, batch: torch.Tensor, spec: StreamSpec, attention: bool) -> str:
        tokens = hashlib.sha256(batch.detach().cpu().numpy().tobytes()).hexdigest()
        dtype, device = model.wte.weight.dtype, batch.device.type
        settings = {"shape": list(batch.shape), "dtype": str(dtype), "device": device, "attention": attention}
        settings["block"] = None if attention else spec.block  # the explicit forward has no blocks
        return stable_hash({"checkpoint": self.checkpoint, "tokens": tokens, **settings})

    def reference(
        self,
        model: GPT,
        batch: torch.Tensor,
        spec: StreamSpec,
        attention: bool,
        future: bool,
        compute: Callable[[], FullReference],
    ) -> FullReference:
        """The full-cache run of batch [B, n + 1] (already cut to the reference's cap): log-probs [B, n, V]
        and, with `attention`, the attention rows per layer (and the future attention when asked), read
        from the store, or `compute()`d and stored."""
        path = self.root / f"{self.key(model, batch, spec, attention)}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        L, n = model.cfg.n_layer, batch.shape[1] - 1
        with FileLock(str(path) + ".lock"):
            stored = self._load(path, L if attention else 0, (batch.shape[0], n))
            if stored is not None:
                self.read += 1
                stored = {k: v.to(batch.device) for k, v in stored.items()}
                attn = [stored[f"attn{l}"] for l in range(L)] if attention else None
                fut = future_attention(attn, model.cfg.kv_heads) if future else None
                return FullReference(logp=stored["logp"], attn=attn, future=fut)
            ref = compute()
            tensors = {"logp": ref.logp, **{f"attn{l}": w for l, w in enumerate(ref.attn or [])}}
            self.computed += 1
            if sum(v.numel() * v.element_size() for v in tensors.values()) > MAX_BYTES:
                return ref
            tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
            write_atomic(path, lambda p: save_file(tensors, str(p)))
            return ref

    @staticmethod
    def _load(path: Path, layers: int, shape: tuple[int, int]) -> dict[str, torch.Tensor] | None:
        """The stored tensors, or None if absent, unreadable or not what the request needs (then recomputed
        and rewritten)."""
        if not path.exists():
            return None
        try:
            stored = load_file(str(path))
        except Exception:  # a damaged file is recomputed, like a damaged checkpoint
            return None
        names = {"logp", *(f"attn{l}" for l in range(layers))}
        if set(stored) != names or tuple(stored["logp"].shape[:2]) != shape:
            return None
        return stored if all(torch.isfinite(v).all() for v in stored.values()) else None
