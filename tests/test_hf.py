"""Pretrained-checkpoint import: tiny random models of each family, built offline with transformers'
config classes and save_pretrained, must give the same log-probs in evictlab as in transformers, and
the same step-by-step predictions as transformers' own KV-cache decoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from evictlab.cache import make_policy
from evictlab.errors import ConfigError
from evictlab.eval import StreamSpec, stream
from evictlab.models.hf import load_hf_model

V = 97


def _build(kind: str, vocab: int = V):
    t = transformers
    if kind == "gpt2":
        cfg = t.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
                           eos_token_id=0)  # fmt: skip
        return t.GPT2LMHeadModel(cfg)
    if kind == "llama":  # grouped-query attention, untied head, non-default rope_theta
        cfg = t.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            rope_theta=5000.0, tie_word_embeddings=False, bos_token_id=0,
                            eos_token_id=0)  # fmt: skip
        return t.LlamaForCausalLM(cfg)
    if kind == "qwen2":  # q/k/v biases, tied head
        cfg = t.Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)  # fmt: skip
        return t.Qwen2ForCausalLM(cfg)
    if kind == "gpt_neox":  # partial rotary, parallel residual, untied head
        cfg = t.GPTNeoXConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.5,
                              use_parallel_residual=True, tie_word_embeddings=False, bos_token_id=0,
                              eos_token_id=0)  # fmt: skip
        return t.GPTNeoXForCausalLM(cfg)
    raise ValueError(kind)


FAMILIES = ["gpt2", "llama", "qwen2", "gpt_neox"]


@pytest.fixture(scope="module", params=FAMILIES)
def saved(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = _build(request.param).eval()
    with torch.no_grad():  # random biases and norms, so every mapped tensor matters
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=request.param != "gpt2")  # gpt2 as pytorch_model.bin
    return request.param, hf, path


def test_full_forward_matches_transformers(saved):
    kind, hf, path = saved
    model, info = load_hf_model(str(path))
    assert info["model_type"] == kind
    idx = torch.randint(0, V, (2, 40))
    with torch.no_grad():
        ours = torch.log_softmax(model(idx).float(), -1)
        theirs = torch.log_softmax(hf(idx).logits.float(), -1)
    assert (ours - theirs).abs().max().item() <= 1e-4


@torch.no_grad()
def transformers_decoding_nll(hf, tokens: torch.Tensor) -> torch.Tensor:
    """[T - 1]: the NLL of each next token of tokens [1, T] under transformers' own KV-cache decoding,
    one token per step."""
    nll, past = [], None
    for t in range(tokens.shape[1] - 1):
        res = hf(tokens[:, t : t + 1], cache=past, use_cache=True)  # transformers 5: `cache`
        past = res.cache
        nll.append(-torch.log_softmax(res.logits[0, -1].float(), -1)[tokens[0, t + 1]])
    return torch.stack(nll)


def test_streaming_full_cache_matches_transformers_decoding(saved):
    kind, hf, path = saved
    model, _ = load_hf_model(str(path))
    tokens = torch.randint(0, V, (1, 33))
    out = stream(model, tokens, make_policy("full"), 32, StreamSpec(force_loop=True))
    assert (transformers_decoding_nll(hf, tokens) - out.nll[0]).abs().max().item() <= 1e-4
    if model.cfg.kv_heads != model.cfg.n_head:  # the cache holds KV heads, never repeated to query heads
        h2o = stream(model, tokens, make_policy("h2o"), 8)
        assert h2o.kept[0].shape[1] == model.cfg.kv_heads


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_weights_and_cache(saved, dtype):
    _, _, path = saved
    model, _ = load_hf_model(str(path), dtype=dtype)
    assert model.wte.weight.dtype == getattr(torch, dtype)
    out = stream(model, torch.randint(0, V, (1, 17)), make_policy("window"), 8, StreamSpec(force_loop=True))
    assert out.nll.dtype == getattr(torch, dtype) and torch.isfinite(out.nll).all()


def test_bad_checkpoints_fail_in_one_line(tmp_path: Path, monkeypatch):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(
        ConfigError, match="unsupported architecture 'bert'.*supported: gpt2, gpt_neox, llama"
    ):
        load_hf_model(str(tmp_path / "bert"))
    (tmp_path / "noweights").mkdir()
    _build("gpt2").config.save_pretrained(tmp_path / "noweights")
    with pytest.raises(ConfigError, match="no weights in"):
        load_hf_model(str(tmp_path / "noweights"))
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError) as err:
        load_hf_model("evictlab-test/not-a-cached-model")
    assert "\n" not in str(err.value) and "save_pretrained" in str(err.value)
    with pytest.raises(ConfigError, match="model.dtype"):
        load_hf_model(str(tmp_path / "bert"), dtype="float8")


# ---- a sweep over locally saved tiny checkpoints of each family, tokenizer included ----------------


def _save_with_tokenizer(kind: str, path: Path) -> None:
    """A tiny random checkpoint plus a byte-level BPE tokenizer (300 ids) trained on pydoc text."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet,
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator(list(topics.values())[:20], trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                                eos_token="<|endoftext|>")  # fmt: skip
    torch.manual_seed(0)
    model = _build(kind, vocab=len(fast))
    model.save_pretrained(path)
    fast.save_pretrained(path)


@pytest.mark.parametrize("kind", FAMILIES)
def test_sweep_over_a_local_checkpoint_runs_every_policy(kind, tmp_path: Path):
    from evictlab import run as run_mod
    from evictlab.cache import POLICIES
    from evictlab.config import compose, to_objects

    ckpt = tmp_path / kind
    _save_with_tokenizer(kind, ckpt)
    outputs = tmp_path / "outputs"
    for name in sorted(POLICIES):
        modes = ["original"] if kind == "gpt2" else ["original", "cache"]  # GPT-2: learned positions
        for mode in modes:
            cfg = to_objects(compose([
                "model=hf", f"model.name_or_path={ckpt}", f"strategy={name}", "budget=b16", "logger=none",
                "eval.n_streams=2", "eval.stream_len=48", f"eval.position_mode={mode}",
                f"paths.outputs={outputs}", "train.seq_len=48",
            ]))  # fmt: skip
            assert cfg.tokenizer.kind.value == "hf"
            m = run_mod.run(cfg)
            assert m["status"] == "ok" and m["scored_tokens"] == 2 * 47, (kind, name, mode)
            if name == "full":
                assert m["kl_mean"] == pytest.approx(0, abs=1e-5)
                # the recorded shape is the checkpoint's (hidden 32, 2 layers), not gpt_small's defaults
                info = json.loads((run_mod.run_dir(cfg) / "run_info.json").read_text())
                assert (info["model_config"]["n_embd"], info["model_config"]["n_layer"]) == (32, 2)
    assert not list(outputs.glob("checkpoints/*"))  # nothing was trained
