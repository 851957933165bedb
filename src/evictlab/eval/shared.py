"""The full-cache reference computed once per (checkpoint, streams): the runs of a sweep share it.

Every run of a sweep compares its policy with the full cache on the same streams through the same
checkpoint, so without sharing each run repeats the same forward (O(T^2) per stream: about two minutes
for one 65,536-token stream here). `SharedReferences` keeps the full cache's log-probs under
outputs/cache/references/<key>.safetensors: the first run that needs one computes it while holding the
file's lock, the others wait and read it. The key holds what the numbers depend on: the checkpoint (its
folder name and weights hash), the exact tokens (cut to the reference's cap), the block size, dtype and
device. How a reference is computed stays in `evaluate.reference_for`; this module only stores it.

A run of several batches asks `busy` before each batch and streams first a batch whose entry no other
process is computing: the two first runs of a cold sweep then compute different batches side by side
instead of one waiting for the other's (smollm2_long: 5-6 minutes per batch).

With `eval.diagnostics=false` the entry is the chunked reference's log-probs only. With diagnostics on it
also holds the full cache's attention as `FullAttention` keeps it: each layer's rotated queries and keys
(rows are recomputed from them) and the per-query summaries (attention on position 0 and on the first
positions, attention by key), 30 x 8 x 12 x 1,024 x 64 floats = 755 MB for 8 streams of 1,024 tokens on
SmolLM2-135M, never the L x [B, H, n, n] rows themselves. The two kinds are separate entries (their
log-probs differ by rounding). An entry over MAX_BYTES is not stored: each run computes it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from evictlab.eval.full import FullAttention, FullReference
from evictlab.eval.spec import StreamSpec
from evictlab.models.gpt import GPT
from evictlab.store import file_lock, stable_hash, write_atomic

# 4: `sink` stored as `first4`; 3: FullAttention with its log normalisers (2: without; 1: the rows)
STORE_FORMAT = 4
MAX_BYTES = 8 << 30  # larger entries are computed by each run, not stored (log-probs: B x n x vocab floats)


class SharedReferences:
    """Full-cache log-probs by (checkpoint, tokens, settings), computed once and read by every later run."""

    def __init__(self, root: str | Path, checkpoint: str, keep_attention: bool = True):
        self.root, self.checkpoint = Path(root), checkpoint
        self.keep_attention = keep_attention  # False: entries with attention are computed, never kept
        self.computed = self.read = 0  # batches this process computed / read from the store

    def key(self, model: GPT, batch: torch.Tensor, spec: StreamSpec, attention: bool) -> str:
        tokens = hashlib.sha256(batch.detach().cpu().numpy().tobytes()).hexdigest()
        dtype, device = model.wte.weight.dtype, batch.device.type
        settings = {"shape": list(batch.shape), "dtype": str(dtype), "device": device, "attention": attention}
        settings["format"] = STORE_FORMAT
        settings["block"] = None if attention else spec.block  # the explicit forward has no blocks
        return stable_hash({"checkpoint": self.checkpoint, "tokens": tokens, **settings})

    def path(self, model: GPT, batch: torch.Tensor, spec: StreamSpec, attention: bool) -> Path:
        return self.root / f"{self.key(model, batch, spec, attention)}.safetensors"

    def busy(self, model: GPT, batch: torch.Tensor, spec: StreamSpec, attention: bool) -> bool:
        """Whether another process holds this entry's lock while it is not yet stored (it is computing it):
        `reference` would wait for it."""
        from filelock import Timeout

        path = self.path(model, batch, spec, attention)
        if path.exists():
            return False
        lock = file_lock(path)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            return True
        lock.release()
        return False

    def reference(
        self,
        model: GPT,
        batch: torch.Tensor,
        spec: StreamSpec,
        attention: bool,
        compute: Callable[[], FullReference],
    ) -> FullReference:
        """The full-cache run of batch [B, n + 1] (already cut to the reference's cap): log-probs [B, n, V]
        and, with `attention`, its FullAttention, read from the store, or `compute()`d and stored (not with
        `attention` where the store keeps none: a scratch store of log-probs, as a noise pass uses)."""
        if attention and not self.keep_attention:
            return compute()
        path = self.path(model, batch, spec, attention)
        path.parent.mkdir(parents=True, exist_ok=True)
        L, n = model.cfg.n_layer, batch.shape[1] - 1
        with file_lock(path):
            stored = self._load(path, L if attention else 0, (batch.shape[0], n))
            if stored is not None:
                self.read += 1
                stored = {k: v.to(batch.device) for k, v in stored.items()}
                logp = stored.pop("logp")
                return FullReference(logp, FullAttention.from_tensors(stored) if attention else None)
            ref = compute()
            tensors = {"logp": ref.logp, **(ref.attention.tensors() if ref.attention else {})}
            self.computed += 1
            if sum(v.numel() * v.element_size() for v in tensors.values()) > MAX_BYTES:
                return ref
            tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
            write_atomic(path, lambda p: save_file(tensors, str(p)))
            return ref

    def continuation(
        self, model: GPT, prompt: torch.Tensor, n_new: int, compute: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        """The full cache's greedy continuation [B, n_new] of prompt [B, P] (eval.generate_tokens: every
        run of a sweep compares its own with it), read from the store or `compute()`d and stored."""
        tokens = hashlib.sha256(prompt.detach().cpu().numpy().tobytes()).hexdigest()
        dtype = str(model.wte.weight.dtype)
        key = {"checkpoint": self.checkpoint, "tokens": tokens, "shape": list(prompt.shape), "dtype": dtype}
        path = (
            self.root
            / f"generate-{stable_hash({**key, 'n_new': n_new, 'device': prompt.device.type})}.safetensors"
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(path):
            try:
                stored = load_file(str(path))["tokens"] if path.exists() else None
            except Exception:  # damaged: computed again
                stored = None
            if stored is not None and tuple(stored.shape) == (prompt.shape[0], n_new):
                self.read += 1
                return stored.to(prompt.device)
            out = compute()
            self.computed += 1
            write_atomic(path, lambda p: save_file({"tokens": out.detach().cpu().contiguous()}, str(p)))
            return out

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
        names = {"logp"}
        if layers:
            rows = {f"{x}{l}" for l in range(layers) for x in "qk"}
            names |= {"first", "first4", "by_key_sum", "lse", *rows}
        if set(stored) != names or tuple(stored["logp"].shape[:2]) != shape:
            return None
        return stored  # (written atomically: a file that loads is whole; no pass over its gigabytes)
