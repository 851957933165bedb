"""Import pretrained Hugging Face checkpoints into evictlab's own GPT (models/gpt.py).

Reads `config.json` and the weights (safetensors, sharded or not, or pytorch_model.bin) and maps them
onto the GPT module, so every policy, both position modes, the parallel path and the diagnostics work
unchanged. No transformers module runs at evaluation time.

Families: GPT-2 (learned positions, fused c_attn, Conv1D weights), Llama-family (RMSNorm, SwiGLU, RoPE
with rope_theta, grouped-query attention; q/k/v biases as in Qwen2: covers SmolLM, TinyLlama, Qwen2,
Mistral without sliding window) and GPT-NeoX (Pythia: partial rotary, parallel residual).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from evictlab.errors import ConfigError
from evictlab.models.gpt import GPT, GPTConfig

LLAMA_LIKE = ("llama", "mistral", "qwen2")
SUPPORTED = ("gpt2", "gpt_neox", *LLAMA_LIKE)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve(name_or_path: str) -> Path:
    """A local folder as is; a hub id downloaded (or taken from the local HF cache)."""
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        return p
    if p.exists() or name_or_path.startswith((".", "/", "~")):
        raise ConfigError(f"model.name_or_path={name_or_path!r} is not a folder with a config.json")
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.bin", "*.model", "*.txt"]
        return Path(snapshot_download(name_or_path, allow_patterns=patterns))
    except Exception as e:  # noqa: BLE001 - offline, 404, auth: one line either way
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            f"model.name_or_path={name_or_path!r}: could not fetch it from the Hugging Face hub ({first}). "
            "Offline? Save the model with save_pretrained() on a machine with a network and point "
            "model.name_or_path at that folder."
        ) from None


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """rope parameters from either the transformers 5 `rope_parameters` or the older flat keys."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ConfigError(f"RoPE scaling {kind!r} is not supported (only the default rotary embedding)")
    theta = params.get("rope_theta", cfg.get("rope_theta", cfg.get("rotary_emb_base", 10000.0)))
    partial = params.get(
        "partial_rotary_factor", cfg.get("partial_rotary_factor", cfg.get("rotary_pct", 1.0))
    )
    return {"theta": float(theta), "partial": float(partial)}


def config_from_hf(hf: dict[str, Any], name: str) -> GPTConfig:
    """evictlab's GPTConfig for a Hugging Face config.json."""
    mt = hf.get("model_type")
    if mt not in SUPPORTED:
        raise ConfigError(
            f"unsupported architecture {mt!r} (config.json model_type); supported: {', '.join(SUPPORTED)}"
        )
    if mt == "gpt2":
        act = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}.get(
            hf.get("activation_function", "gelu_new")
        )
        if act is None:
            raise ConfigError(f"gpt2 activation_function={hf.get('activation_function')!r} is not supported")
        return GPTConfig(
            name=name, vocab_size=hf["vocab_size"], n_layer=hf["n_layer"], n_head=hf["n_head"],
            n_embd=hf["n_embd"], mlp_hidden=hf.get("n_inner") or 4 * hf["n_embd"], pos_emb="learned",
            block_size=hf["n_positions"], norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            act=act, bias=True, tie_embeddings=hf.get("tie_word_embeddings", True),
        )  # fmt: skip
    rope = _rope(hf)
    heads, d = hf["num_attention_heads"], hf["hidden_size"]
    if hf.get("head_dim") not in (None, d // heads):
        raise ConfigError(f"head_dim={hf['head_dim']} != hidden_size / num_attention_heads is not supported")
    if mt == "gpt_neox":
        if hf.get("hidden_act", "gelu") not in ("gelu", "gelu_new", "gelu_fast"):
            raise ConfigError(f"gpt_neox hidden_act={hf.get('hidden_act')!r} is not supported")
        return GPTConfig(
            name=name, vocab_size=hf["vocab_size"], n_layer=hf["num_hidden_layers"], n_head=heads, n_embd=d,
            mlp_hidden=hf["intermediate_size"], pos_emb="rope", rope_base=rope["theta"],
            rotary_dim=int(d // heads * rope["partial"]), block_size=hf.get("max_position_embeddings", 2048),
            norm="layernorm", norm_eps=hf.get("layer_norm_eps", 1e-5),
            act="gelu" if hf.get("hidden_act", "gelu") == "gelu" else "gelu_tanh", bias=True,
            parallel_residual=hf.get("use_parallel_residual", True),
            tie_embeddings=hf.get("tie_word_embeddings", False),
        )  # fmt: skip
    # llama-like
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(
            f"{mt} hidden_act={hf.get('hidden_act')!r} is not supported (SwiGLU with silu only)"
        )
    if hf.get("mlp_bias") or (mt != "qwen2" and hf.get("attention_bias")):
        raise ConfigError(f"{mt} with attention_bias/mlp_bias on the output projections is not supported")
    if hf.get("sliding_window") and hf.get("use_sliding_window", mt == "mistral"):
        raise ConfigError(f"{mt} with a sliding attention window is not supported")
    return GPTConfig(
        name=name, vocab_size=hf["vocab_size"], n_layer=hf["num_hidden_layers"], n_head=heads,
        n_kv_head=hf.get("num_key_value_heads") or heads, n_embd=d, mlp_hidden=hf["intermediate_size"],
        pos_emb="rope", rope_base=rope["theta"], block_size=hf.get("max_position_embeddings", 2048),
        norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6), act="swiglu", qkv_bias=mt == "qwen2",
        tie_embeddings=hf.get("tie_word_embeddings", False),
    )  # fmt: skip


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder: model.safetensors, its shards, or pytorch_model.bin."""
    from safetensors.torch import load_file

    if (path / "model.safetensors").exists():
        return load_file(str(path / "model.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.exists():
        out: dict[str, torch.Tensor] = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            out |= load_file(str(path / shard))
        return out
    if (path / "pytorch_model.bin").exists():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ConfigError(f"no weights in {path}: expected model.safetensors(.index.json) or pytorch_model.bin")


def _strip(sd: dict[str, torch.Tensor], prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        for p in prefixes:
            if k.startswith(p):
                k = k[len(p) :]
                break
        out[k] = v
    return out


def map_weights(mt: str, sd: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> GPT state dict names (and layouts)."""
    out: dict[str, torch.Tensor] = {}
    H, D, C = cfg.n_head, cfg.head_dim, cfg.n_embd
    if mt == "gpt2":
        sd = _strip(sd, ("transformer.",))
        out["wte.weight"], out["wpe.weight"] = sd["wte.weight"], sd["wpe.weight"]
        for i in range(cfg.n_layer):
            h = f"h.{i}."
            for ln in ("ln_1", "ln_2"):
                out[f"blocks.{i}.{ln}.weight"], out[f"blocks.{i}.{ln}.bias"] = (
                    sd[h + ln + ".weight"],
                    sd[h + ln + ".bias"],
                )
            for src, dst in (("attn.c_attn", "attn.c_attn"), ("attn.c_proj", "attn.c_proj"),
                             ("mlp.c_fc", "mlp.c_fc"), ("mlp.c_proj", "mlp.c_proj")):  # fmt: skip
                out[f"blocks.{i}.{dst}.weight"] = sd[f"{h}{src}.weight"].t()  # Conv1D stores [in, out]
                out[f"blocks.{i}.{dst}.bias"] = sd[f"{h}{src}.bias"]
        out["ln_f.weight"], out["ln_f.bias"] = sd["ln_f.weight"], sd["ln_f.bias"]
    elif mt == "gpt_neox":
        sd = _strip(sd, ("gpt_neox.",))
        out["wte.weight"] = sd["embed_in.weight"]
        for i in range(cfg.n_layer):
            p = f"layers.{i}."
            for src, dst in (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2"),
                             ("attention.dense", "attn.c_proj"), ("mlp.dense_h_to_4h", "mlp.c_fc"),
                             ("mlp.dense_4h_to_h", "mlp.c_proj")):  # fmt: skip
                out[f"blocks.{i}.{dst}.weight"] = sd[f"{p}{src}.weight"]
                out[f"blocks.{i}.{dst}.bias"] = sd[f"{p}{src}.bias"]
            w, b = sd[f"{p}attention.query_key_value.weight"], sd[f"{p}attention.query_key_value.bias"]
            w, b = w.view(H, 3, D, C), b.view(H, 3, D)  # per head: q, k, v
            out[f"blocks.{i}.attn.c_attn.weight"] = torch.cat([w[:, j].reshape(H * D, C) for j in range(3)])
            out[f"blocks.{i}.attn.c_attn.bias"] = torch.cat([b[:, j].reshape(H * D) for j in range(3)])
        out["ln_f.weight"], out["ln_f.bias"] = sd["final_layer_norm.weight"], sd["final_layer_norm.bias"]
        if not cfg.tie_embeddings:
            out["lm_head.weight"] = sd["embed_out.weight"]
    else:  # llama-like
        head = sd.get("lm_head.weight")
        sd = _strip(sd, ("model.",))
        out["wte.weight"] = sd["embed_tokens.weight"]
        for i in range(cfg.n_layer):
            p = f"layers.{i}."
            out[f"blocks.{i}.ln_1.weight"] = sd[f"{p}input_layernorm.weight"]
            out[f"blocks.{i}.ln_2.weight"] = sd[f"{p}post_attention_layernorm.weight"]
            qkv = [sd[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"]
            out[f"blocks.{i}.attn.c_attn.weight"] = torch.cat(qkv)
            if cfg.qkv_bias:
                out[f"blocks.{i}.attn.c_attn.bias"] = torch.cat(
                    [sd[f"{p}self_attn.{x}_proj.bias"] for x in "qkv"]
                )
            out[f"blocks.{i}.attn.c_proj.weight"] = sd[f"{p}self_attn.o_proj.weight"]
            out[f"blocks.{i}.mlp.c_gate.weight"] = sd[f"{p}mlp.gate_proj.weight"]
            out[f"blocks.{i}.mlp.c_fc.weight"] = sd[f"{p}mlp.up_proj.weight"]
            out[f"blocks.{i}.mlp.c_proj.weight"] = sd[f"{p}mlp.down_proj.weight"]
        out["ln_f.weight"] = sd["norm.weight"]
        if not cfg.tie_embeddings:
            out["lm_head.weight"] = head if head is not None else sd["embed_tokens.weight"]
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["wte.weight"]
    return out


def load_hf_model(name_or_path: str, dtype: str = "float32") -> tuple[GPT, dict[str, Any]]:
    """(model in eval mode, info) for a hub id or a local save_pretrained() folder."""
    if dtype not in DTYPES:
        raise ConfigError(f"model.dtype={dtype!r} must be one of {', '.join(DTYPES)}")
    path = resolve(name_or_path)
    if not (path / "config.json").exists():
        raise ConfigError(f"no config.json in {path}")
    hf = json.loads((path / "config.json").read_text())
    cfg = config_from_hf(hf, Path(str(name_or_path)).name or str(name_or_path))
    model = GPT(cfg)
    try:
        state = map_weights(hf["model_type"], read_weights(path), cfg)
    except KeyError as e:
        raise ConfigError(f"{path}: weight {e} is missing for a {hf['model_type']} checkpoint") from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(
            f"{path}: weights do not fit the {hf['model_type']} mapping "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    model = model.to(DTYPES[dtype]).eval()
    return model, {"model_type": hf["model_type"], "path": str(path), "config": hf, "dtype": dtype}
