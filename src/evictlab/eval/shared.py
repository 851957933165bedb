"""The full-cache reference computed once per (checkpoint, streams): the runs of a sweep share it.

Every run of a sweep compares its policy with the full cache on the same streams through the same
checkpoint, so without sharing each run repeats the same forward (O(T^2) per stream: about two minutes
for one 65,536-token stream here). `SharedReferences` keeps the full cache's log-probs under
outputs/cache/references/<key>.safetensors: the first run that needs one computes it while holding the
file's lock, the others wait and read it. The key holds what the numbers depend on: the checkpoint (its
folder name and weights hash), the exact tokens, the reference's cap, the block size, dtype and device.

Only the log-probs are shared (the chunked reference of `eval.diagnostics=false` runs). With diagnostics
on, the attention rows a run needs are [B, H, n, n] per layer, and the policy-specific diagnostics read
them: those runs compute their reference themselves, as before (it is a short stream's forward).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from filelock import FileLock
from safetensors.torch import load_file, save_file

from evictlab.eval.spec import StreamSpec
from evictlab.eval.static import full_logp
from evictlab.models.gpt import GPT
from evictlab.store import stable_hash, write_atomic


class SharedReferences:
    """Full-cache log-probs by (checkpoint, tokens, settings), computed once and read by every later run."""

    def __init__(self, root: str | Path, checkpoint: str):
        self.root, self.checkpoint = Path(root), checkpoint
        self.computed = self.read = 0  # batches this process computed / read from the store

    def key(self, model: GPT, batch: torch.Tensor, spec: StreamSpec) -> str:
        tokens = hashlib.sha256(batch.detach().cpu().numpy().tobytes()).hexdigest()
        dtype, device = model.wte.weight.dtype, batch.device.type
        settings = {"shape": list(batch.shape), "block": spec.block, "dtype": str(dtype), "device": device}
        return stable_hash({"checkpoint": self.checkpoint, "tokens": tokens, **settings})

    def logp(self, model: GPT, batch: torch.Tensor, spec: StreamSpec) -> torch.Tensor:
        """[B, n, V] full-cache log-probs of batch [B, n + 1] (already cut to the reference's cap)."""
        path = self.root / f"{self.key(model, batch, spec)}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock"):
            stored = self._load(path, (batch.shape[0], batch.shape[1] - 1))
            if stored is not None:
                self.read += 1
                return stored.to(batch.device)
            logp = full_logp(model, batch, spec.block)
            write_atomic(path, lambda p: save_file({"logp": logp.detach().cpu().contiguous()}, str(p)))
            self.computed += 1
            return logp

    @staticmethod
    def _load(path: Path, shape: tuple[int, int]) -> torch.Tensor | None:
        """The stored log-probs, or None if absent or unreadable (then recomputed and rewritten)."""
        if not path.exists():
            return None
        try:
            logp = load_file(str(path))["logp"]
        except Exception:  # a damaged file is recomputed, like a damaged checkpoint
            return None
        return logp if tuple(logp.shape[:2]) == shape and torch.isfinite(logp).all() else None
