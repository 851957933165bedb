"""A small decoder-only GPT in one readable file (nanoGPT-like).

Pre-LayerNorm blocks, causal multi-head attention with RoPE (or learned absolute positions),
optional grouped-query attention, GELU MLP, final norm and a head tied to the token embedding.
A few switches cover the pretrained families evictlab imports (models/hf.py): RMSNorm and a SwiGLU
MLP (Llama, Qwen2), linear biases and tanh-GELU (GPT-2), partial rotary and a parallel residual
(GPT-NeoX / Pythia), an untied head. Their defaults are the small GPT trained here.

Shapes: B batch, T tokens, C = n_embd, H = n_head, Hkv = n_kv_head, D = head_dim = C // H.

The attention is split into steps that a KV-cache engine can drive on its own:
``project`` (x -> pre-RoPE q, k, v), ``smear`` (the optional smeared keys, which need the previous
token's key), ``rotate`` (RoPE at explicit positions; models/rope.py) and ``attend`` (SDPA with a mask)
+ ``out``.
``GPT.forward_with`` runs embed -> blocks -> head and lets the caller compute each layer's attention
(``attend(layer, attn_module, h)``), so an engine owns the keys and values while the residual structure
stays here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.nn as nn
import torch.nn.functional as F

from evictlab.errors import ConfigError
from evictlab.models.rope import apply_rope


class PosEmb(str, Enum):
    rope = "rope"  # rotary position embedding on q and k
    learned = "learned"  # GPT-2 style absolute position table added to the token embedding


class Norm(str, Enum):
    layernorm = "layernorm"
    rmsnorm = "rmsnorm"


class Act(str, Enum):
    gelu = "gelu"  # exact (erf) GELU MLP
    gelu_tanh = "gelu_tanh"  # GPT-2's tanh approximation
    swiglu = "swiglu"  # down(silu(gate(x)) * up(x)), Llama-style


@dataclass
class GPTConfig:
    name: str = "gpt_small"
    vocab_size: int = 0  # 0 = taken from the tokenizer at build time
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 0  # 0 = n_head (plain multi-head attention); fewer = grouped-query attention
    n_embd: int = 128
    mlp_ratio: int = 4
    pos_emb: PosEmb = PosEmb.rope
    rope_base: float = 10000.0
    block_size: int = 1024  # size of the learned position table (ignored by RoPE)
    sink_token: bool = False  # prepend a learnable dedicated <sink> token to every sequence
    # smeared keys (Olsson et al. 2022, "In-context Learning and Induction Heads"): each key mixes in the
    # previous token's, so one layer can match "the token after an earlier copy of mine" (see `smear`)
    # (metadata = config.neutral(False), spelled out: config imports this module)
    smear_keys: bool = field(default=False, metadata={"neutral": False})
    init_std: float = 0.02
    # switches for imported pretrained families (defaults: the small GPT trained here)
    norm: Norm = Norm.layernorm
    norm_eps: float = 1e-5
    act: Act = Act.gelu
    mlp_hidden: int = 0  # 0 = mlp_ratio * n_embd
    bias: bool = False  # biases on the attention output and MLP linears (and q, k, v)
    qkv_bias: bool = False  # biases on q, k, v only (Qwen2)
    rotary_dim: int = 0  # dims of each head that RoPE rotates; 0 = all (GPT-NeoX rotates a fraction)
    parallel_residual: bool = False  # x + attn(ln_1(x)) + mlp(ln_2(x)) (GPT-NeoX)
    tie_embeddings: bool = True
    # a pretrained checkpoint instead of training (model=hf): hub id or save_pretrained() folder
    name_or_path: str | None = None
    dtype: str = "float32"  # weights and KV cache: float32 | float16 | bfloat16

    def __post_init__(self) -> None:
        self.pos_emb, self.norm, self.act = PosEmb(self.pos_emb), Norm(self.norm), Act(self.act)
        if self.name == "hf" and not self.name_or_path:
            raise ConfigError("model=hf needs model.name_or_path=<hub id or save_pretrained() folder>")
        if self.rotary_dim < 0 or self.rotary_dim > self.n_embd // max(1, self.n_head) or self.rotary_dim % 2:
            raise ConfigError(
                f"model.rotary_dim={self.rotary_dim} must be even and in [0, head_dim] (0 = all)"
            )
        for key in ("n_layer", "n_head", "n_embd", "mlp_ratio", "block_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.{key}={getattr(self, key)} must be >= 1")
        if self.n_kv_head < 0:
            raise ConfigError(f"model.n_kv_head={self.n_kv_head} must be >= 0 (0 means n_head)")
        if self.n_embd % self.n_head:
            raise ConfigError(f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}")
        if self.n_head % self.kv_heads:
            raise ConfigError(
                f"model.n_head={self.n_head} is not divisible by model.n_kv_head={self.kv_heads}"
            )
        if self.pos_emb is PosEmb.rope and self.rope_dims % 2:
            raise ConfigError(f"RoPE needs an even head_dim; got n_embd/n_head={self.head_dim}")
        if not self.rope_base > 1:
            raise ConfigError(f"model.rope_base={self.rope_base} must be > 1")
        for key in ("norm_eps", "init_std"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"model.{key}={getattr(self, key)} must be > 0")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def rope_dims(self) -> int:
        """Leading dims of each head that RoPE rotates."""
        return self.rotary_dim or self.head_dim

    @property
    def hidden(self) -> int:
        return self.mlp_hidden or self.mlp_ratio * self.n_embd


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.rope_base = cfg.rope_base if cfg.pos_emb is PosEmb.rope else None
        self.rope_dims = cfg.rope_dims
        qkv_out = (self.n_head + 2 * self.n_kv_head) * self.head_dim
        self.c_attn = nn.Linear(cfg.n_embd, qkv_out, bias=cfg.bias or cfg.qkv_bias)  # fused q, k, v
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        # one logit per KV head: sigmoid(0) = 1/2 of the own key at init (1-D, so never weight-decayed)
        self.smear_logit = nn.Parameter(torch.zeros(self.n_kv_head)) if cfg.smear_keys else None

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, C] -> q [B, H, T, D], k [B, Hkv, T, D], v [B, Hkv, T, D], before RoPE."""
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).split(
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim],
            dim=-1,
        )
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        return q, k, v

    def project_keys(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, C] -> k [B, Hkv, T, D]: `project`'s keys alone, from c_attn's key rows (a fifth of its
        work for SmolLM2). For a single position (T = 1) equal to `project`'s k bit for bit
        (tests/test_model.py holds that on the machine it runs on): the blocked path projects the keys of a
        policy that scores them one token at a time this way (eval/blocked.py)."""
        B, T, _ = x.shape
        s, e = self.n_head * self.head_dim, (self.n_head + self.n_kv_head) * self.head_dim
        bias = None if self.c_attn.bias is None else self.c_attn.bias[s:e]
        k = F.linear(x, self.c_attn.weight[s:e], bias)
        return k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)

    def smear(self, k: torch.Tensor, prev: torch.Tensor | None = None) -> torch.Tensor:
        """Smeared keys: raw k [B, Hkv, T, D] -> s k_j + (1 - s) k_(j-1), s = sigmoid(smear_logit) per KV
        head, where k_(-1) = prev [B, Hkv, 1, D] (the raw key of the token before k's first; None = zeros:
        the sequence starts here). Identity without model.smear_keys. Applied before RoPE: the smeared key
        is the one key of position j, stored and rotated like any other."""
        if self.smear_logit is None:
            return k
        before = torch.zeros_like(k[:, :, :1]) if prev is None else prev
        before = torch.cat([before, k[:, :, :-1]], dim=2)
        s = torch.sigmoid(self.smear_logit).to(k.dtype)[:, None, None]  # [Hkv, 1, 1]
        return s * k + (1 - s) * before

    def rotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """RoPE of x [B, H, T, D] at positions pos [T] (shared) or [B, T] (per row); identity for learned
        absolute positions."""
        if self.rope_base is None:
            return x
        return apply_rope(x, pos if pos.dim() == 1 else pos[:, None, :], self.rope_base, self.rope_dims)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None = None,
        is_causal: bool = False,
        scale: float | None = None,
    ) -> torch.Tensor:
        """q [B, H, Tq, E], k [B, Hkv, Tk, E], v [B, Hkv, Tk, D], bool mask [.., Tq, Tk] (True = attend)
        -> [B, Tq, C]. Scores are scaled by `scale` (default E ** -0.5)."""
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=self.n_kv_head != self.n_head,
        )
        B, _, Tq, _ = q.shape
        return y.transpose(1, 2).reshape(B, Tq, self.n_head * self.head_dim)

    def out(self, y: torch.Tensor) -> torch.Tensor:
        return self.c_proj(y)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x)
        q, k = self.rotate(q, pos), self.rotate(self.smear(k), pos)
        return self.out(self.attend(q, k, v, is_causal=True))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.act = cfg.act
        self.c_fc = nn.Linear(cfg.n_embd, cfg.hidden, bias=cfg.bias)  # the "up" projection
        self.c_gate = nn.Linear(cfg.n_embd, cfg.hidden, bias=cfg.bias) if cfg.act is Act.swiglu else None
        self.c_proj = nn.Linear(cfg.hidden, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.c_gate is not None:
            return self.c_proj(F.silu(self.c_gate(x)) * self.c_fc(x))
        approximate = "tanh" if self.act is Act.gelu_tanh else "none"
        return self.c_proj(F.gelu(self.c_fc(x), approximate=approximate))


def make_norm(cfg: GPTConfig) -> nn.Module:
    if cfg.norm is Norm.rmsnorm:
        return nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps)


# (layer index, that layer's attention module, normed input h [B, T, C]) -> attention output [B, T, C]
AttendFn = Callable[[int, CausalSelfAttention, torch.Tensor], torch.Tensor]


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = make_norm(cfg)
        self.mlp = MLP(cfg)
        self.parallel = cfg.parallel_residual

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [B, T, C] at positions pos: plain causal attention over x, then the MLP."""
        return self.mix(x, self.attn(self.ln_1(x), pos))

    def mix(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """The residual structure around an attention output a = attention(ln_1(x)) [B, T, C]."""
        if self.parallel:  # GPT-NeoX: attention and MLP both read the block's input
            return x + a + self.mlp(self.ln_2(x))
        x = x + a
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.vocab_size < 1:
            raise ValueError("GPTConfig.vocab_size must be set (from the tokenizer) before building")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.pos_emb is PosEmb.learned else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by 1/sqrt(2 L)
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=cfg.init_std / math.sqrt(2 * cfg.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.cfg.init_std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def embed(self, idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """idx [B, T] token ids at absolute positions pos [T] or [B, T] -> x [B, T, C]."""
        x = self.wte(idx)
        if self.wpe is not None:
            if int(pos.max()) >= self.cfg.block_size:
                raise ValueError(
                    f"position {int(pos.max())} exceeds the learned position table "
                    f"(model.block_size={self.cfg.block_size})"
                )
            x = x + self.wpe(pos)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm + tied head: x [B, T, C] -> logits [B, T, V]."""
        return self.lm_head(self.ln_f(x))

    def forward_with(
        self, idx: torch.Tensor, pos: torch.Tensor, attend: AttendFn | None = None, last_only: bool = False
    ) -> torch.Tensor:
        """embed -> blocks -> head: idx [B, T] at positions pos [T] or [B, T] -> logits [B, T, V] (or
        [B, V] for the last position only). Each block's attention is plain causal attention over idx,
        or `attend(l, block.attn, h)` when an engine holds the keys and values."""
        x = self.embed(idx, pos)
        for l, block in enumerate(self.blocks):
            h = block.ln_1(x)
            x = block.mix(x, block.attn(h, pos) if attend is None else attend(l, block.attn, h))
        return self.head(x[:, -1] if last_only else x)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Teacher-forced forward from position 0: idx [B, T] -> logits [B, T, V] (and mean loss)."""
        logits = self.forward_with(idx, torch.arange(idx.shape[1], device=idx.device))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
        return logits, loss

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x non-embedding params + attention (PaLM appendix B)."""
        cfg = self.cfg
        # Every weight is a matmul except the position table; the tied embedding counts once, as the head.
        n = self.num_params() - (self.wpe.weight.numel() if self.wpe is not None else 0)
        return 6 * n + 6 * cfg.n_layer * cfg.n_embd * seq_len  # 12 L C T / 2 for causal masking
