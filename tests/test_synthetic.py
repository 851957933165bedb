"""Synthetic in-context training documents (train.synthetic_share) and the attention-sink metrics."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from evictlab.data.synthetic import PRINTABLE, TRIGGERS, make_copy_sequence, make_synthetic_sequence
from evictlab.data.tokenizers import ByteTokenizer
from evictlab.eval import sinks
from tests.conftest import make_cfg


@pytest.fixture(scope="module")
def corpus(session_outputs):
    from evictlab.data import load_corpus

    cfg = make_cfg(session_outputs)
    return load_corpus(cfg.dataset, cfg.tokenizer, cfg.outputs)


def _documents(corpus, make, seeds: int, **kw):
    """(tokenizer, prefix, seed, document) of `make` for each seed, after checking that each document has
    exactly 513 tokens, starts with the prefix and is a pure function of its generator's seed."""
    tok, prefix = corpus.tokenizer, np.array(corpus.prefix(False))
    filler = corpus.splits["train"].ids
    for seed in range(seeds):
        seq = make(tok, prefix, filler, 513, np.random.default_rng(seed), **kw)
        again = make(tok, prefix, filler, 513, np.random.default_rng(seed), **kw)
        assert len(seq) == 513 and np.array_equal(seq, again) and np.array_equal(seq[: len(prefix)], prefix)
        yield tok, prefix, seed, seq


def test_a_synthetic_document_has_its_length_prefix_and_in_context_jobs(corpus):
    for tok, prefix, seed, seq in _documents(corpus, make_synthetic_sequence, 5):
        text = tok.decode(seq[len(prefix) :])
        # every trigger character is followed by the same character throughout the document
        for t in TRIGGERS:
            followers = {text[i + 1] for i in range(len(text) - 1) if text[i] == t}
            assert len(followers) <= 1, (seed, repr(t), followers)
        # every answered key-value query repeats the value recorded earlier
        records = dict(part.split("=", 1) for part in text.split("@")[1:] if "=" in part[:3])
        for part in text.split("@")[1:]:
            if part[2:3] == "?" and part.count(";"):
                key, value = part[:2], part[3 : part.index(";")]
                assert records.get(key, value)[: len(value)] == value
    assert (
        len(
            {
                tuple(
                    make_synthetic_sequence(
                        tok, prefix, corpus.splits["train"].ids, 200, np.random.default_rng(s)
                    )
                )
                for s in range(4)
            }
        )
        == 4
    )


def test_synthetic_share_mixes_documents_into_training_and_zero_changes_nothing(corpus):
    from evictlab.data.sampler import WindowSampler

    split = corpus.splits["train"]
    plain = WindowSampler(split, corpus, 128, False, seed=3).batch(8)
    zero = WindowSampler(split, corpus, 128, False, seed=3, synthetic_share=0.0).batch(8)
    assert all(torch.equal(a, b) for a, b in zip(plain, zero, strict=True))  # the neutral value
    x, _ = WindowSampler(split, corpus, 128, False, seed=3, synthetic_share=0.9).batch(32)
    triggers = torch.tensor([ord(t) for t in TRIGGERS])
    with_jobs = torch.isin(x, triggers).any(1) | (x == ord("@")).any(1)
    assert 20 <= int(with_jobs.sum()) <= 32 and x.shape == (32, 128)


def _repeated_share(seq: np.ndarray, k: int = 8) -> float:
    """Share of positions whose preceding k tokens occurred earlier in the sequence (copyable)."""
    seen, hits = set(), 0
    for i in range(k, len(seq)):
        gram = tuple(seq[i - k : i])
        hits += gram in seen
        seen.add(gram)
    return hits / (len(seq) - k)


def test_a_copy_document_is_mostly_copies_and_without_filler_in_warmup(corpus):
    for _, _, seed, seq in _documents(corpus, make_copy_sequence, 4):
        assert 0.15 <= _repeated_share(seq) <= 0.8, seed
    for tok, prefix, _, tight in _documents(corpus, make_copy_sequence, 4, filler_max=0):
        assert set(tok.decode(tight[len(prefix) :])) <= set(PRINTABLE)  # no natural text at all
        assert _repeated_share(tight) > 0.3


def test_the_synthetic_warmup_trains_on_synthetic_documents_only_then_mixes(corpus):
    from evictlab.data.sampler import WindowSampler

    split = corpus.splits["train"]
    sampler = WindowSampler(split, corpus, 128, False, seed=1, synthetic_kind="copy", synthetic_warmup=2)
    text = [corpus.tokenizer.decode(sampler.batch(16)[0].flatten().tolist()) for _ in range(3)]
    allowed = set(PRINTABLE) | {"<", ">", "b", "o", "s"}  # <bos> decodes as text
    assert set(text[0]) <= allowed and set(text[1]) <= allowed  # warmup: copy documents without filler
    assert not set(text[2]) <= allowed  # then natural text (synthetic_share 0)


def test_sink_metrics_follow_gu_et_al(monkeypatch, corpus):
    # 3 layers x 2 heads; alpha (mean attention on position 0 over queries) set per head
    alpha = torch.tensor([[0.9, 0.1], [0.2, 0.5], [0.31, 0.29]])

    def fake(model, tokens):
        B, n = tokens.shape[0], tokens.shape[1] - 1
        return alpha[:, None, :, None].expand(3, B, 2, n).clone()  # [L, B, H, n]

    monkeypatch.setattr(sinks, "_first_position_attention", fake)
    scalars, layers = sinks.sink_metrics(torch.nn.Linear(1, 1), corpus, 64, False)
    assert scalars["sink_head_fraction"] == pytest.approx(3 / 6)  # 0.9, 0.5, 0.31 exceed 0.3
    assert scalars["sink_head_fraction_deep"] == pytest.approx(2 / 4)  # layers >= 1: 0.5, 0.31
    # Gu et al.'s metric at three thresholds (strictly above): 0.1 -> five heads, 0.2 -> four, 0.3 as above
    assert [scalars[f"sink_head_fraction_eps{e}"] for e in (10, 20, 30)] == pytest.approx(
        [5 / 6, 4 / 6, 3 / 6]
    )
    last = layers[layers["metric"] == "last_query_first_mass"].sort_values("layer")["value"]
    assert last.tolist() == pytest.approx([0.5, 0.35, 0.3])  # mean over heads
    a = layers[layers["metric"] == "sink_alpha"].pivot(index="layer", columns="head", values="value")
    np.testing.assert_allclose(a.to_numpy(), alpha.numpy(), rtol=1e-6)
    # every query of a head attends alike here: its percentiles are its alpha, and the query shares the
    # head shares
    for q in (10, 50, 90):
        p = layers[layers["metric"] == f"sink_alpha_p{q}"].pivot(
            index="layer", columns="head", values="value"
        )
        np.testing.assert_allclose(p.to_numpy(), alpha.numpy(), rtol=1e-6)
    assert [scalars[f"sink_query_share_eps{e}"] for e in (10, 20, 30)] == pytest.approx([5 / 6, 4 / 6, 3 / 6])


def test_the_per_query_distribution_sees_what_the_mean_hides(monkeypatch, corpus):
    """Two heads with the same alpha (about 0.2, below Gu's 0.3): one gives every query 0.2, the other gives
    a fifth of its queries everything and the rest nothing. The percentiles and the query share tell them
    apart; query 0 (attention 1 on itself) is not part of the distribution."""

    def fake(model, tokens):
        B, n = tokens.shape[0], tokens.shape[1] - 1
        out = torch.zeros(1, B, 2, n)
        out[0, :, 0] = 0.2
        out[0, :, 1, ::5] = 1.0  # queries 0, 5, 10, ...: every fifth
        out[..., 0] = 1.0  # query 0 sees only itself
        return out

    monkeypatch.setattr(sinks, "_first_position_attention", fake)
    scalars, layers = sinks.sink_metrics(torch.nn.Linear(1, 1), corpus, 64, False)
    pct = {
        (m, int(h)): v
        for m, h, v in layers[layers["metric"].str.startswith("sink_alpha_p")][
            ["metric", "head", "value"]
        ].values
    }
    assert pct[("sink_alpha_p50", 0)] == pytest.approx(0.2) and pct[("sink_alpha_p90", 0)] == pytest.approx(
        0.2
    )
    assert pct[("sink_alpha_p50", 1)] == 0.0 and pct[("sink_alpha_p90", 1)] == 1.0
    assert scalars["sink_head_fraction_eps30"] == 0.0  # neither head's mean reaches 0.3
    n = 63  # queries 1 .. 63 of each 64-token sequence
    assert scalars["sink_query_share_eps30"] == pytest.approx(len(range(5, 64, 5)) / n / 2)


def test_cached_sink_metrics_are_measured_again_for_streams_without_bos(monkeypatch, corpus, tmp_path):
    """Without <bos> position 0 is the first text token: the subject's sink metrics differ, so a cached
    measurement with <bos> must not be read for it (smollm2_sinks once got the <bos> values for both)."""
    import dataclasses

    starts = []

    def fake(model, tokens):  # records what position 0 holds; "attends" to it fully iff it is <bos>
        starts.append(int(tokens[0, 0]))
        B, n = tokens.shape[0], tokens.shape[1] - 1
        on_bos = (tokens[:, 0] == corpus.tokenizer.bos_id).float()
        return on_bos[None, :, None, None].expand(2, B, 2, n).clone()  # [L, B, H, n]

    monkeypatch.setattr(sinks, "_first_position_attention", fake)
    model = torch.nn.Embedding(4, 2)
    model.wte = model  # cached_sink_metrics reads the weights' dtype and device from model.wte
    no_bos = dataclasses.replace(corpus, bos=False)
    args = ("ck:abc", model)
    with_bos, _ = sinks.cached_sink_metrics(tmp_path, *args, corpus, 64, False, "test")
    again, _ = sinks.cached_sink_metrics(tmp_path, *args, corpus, 64, False, "test")
    without, _ = sinks.cached_sink_metrics(tmp_path, *args, no_bos, 64, False, "test")
    assert with_bos == again and len(starts) == 4  # measured once (two passes), then read
    assert with_bos["sink_head_fraction"] == 1.0 and without["sink_head_fraction"] == 0.0
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_runs_and_checkpoints_record_the_sink_metrics(tiny_checkpoint, tmp_path):
    from evictlab import run as run_mod
    from tests.test_pipeline import cfg_for

    meta = tiny_checkpoint.meta
    assert 0 <= meta["sink_head_fraction"] <= 1 and len(meta["last_query_first_mass"]) == 2
    cfg = cfg_for(tmp_path / "outputs", "strategy=window", "budget=b16", "logger=none")
    m = run_mod.run(cfg)
    assert {"sink_head_fraction", "sink_head_fraction_deep"} <= set(m)
    layers = pd.read_parquet(run_mod.run_dir(cfg) / "layers.parquet")
    assert {"sink_alpha", "sink_alpha_p50", "last_query_first_mass"} <= set(layers["metric"])
    assert {"sink_query_share_eps30"} <= set(m)
    assert ByteTokenizer().encode("@")[0] == ord("@")  # the byte tokenizer maps bytes to their ids
