"""The pass-key recall task: stream construction, and accuracy teacher-forced and by greedy decoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from evictlab.cache import make_policy
from evictlab.data import load_corpus
from evictlab.data.recall import ANSWER, NEEDLE, QUERY, recall_streams
from evictlab.errors import ConfigError
from evictlab.eval import StreamSpec
from evictlab.eval.engine import generate
from evictlab.eval.evaluate import recall_accuracy
from tests.conftest import make_cfg


@pytest.fixture(scope="module")
def corpus(session_outputs):
    cfg = make_cfg(session_outputs)
    return load_corpus(cfg.dataset, cfg.tokenizer, cfg.outputs)


def test_streams_plant_the_needle_at_the_depth_and_ask_at_the_end(corpus):
    b = recall_streams(corpus, 2, 400, sink_token=False, depths=(0.0, 0.5, 1.0), seed=3)
    tok = corpus.tokenizer
    assert b.tokens.shape == (6, 400) and (b.tokens[:, 0] == tok.bos_id).all()
    for i in range(6):
        v = b.values[i]
        row = b.tokens[i].tolist()
        s, n = b.answer_start[i], b.answer_len[i]
        assert tok.decode(row[s : s + n]) == ANSWER.format(v=v) and s + n == 400
        assert tok.decode(row[s - len(QUERY) : s]) == QUERY
        needle = NEEDLE.format(v=v)
        assert tok.decode(row[b.needle_pos[i] : b.needle_pos[i] + len(needle)]) == needle
        assert b.answer[i].sum() == n and b.answer[i, s - 1 : s - 1 + n].all()
    pos = b.needle_pos.reshape(3, 2)
    assert (pos[0] == 1).all() and (pos[1] > pos[0]).all() and (pos[2] > pos[1]).all()
    again = recall_streams(corpus, 2, 400, sink_token=False, depths=(0.0, 0.5, 1.0), seed=3)
    assert torch.equal(again.tokens, b.tokens) and again.values == b.values
    with pytest.raises(ConfigError, match="filler tokens"):
        recall_streams(corpus, 1, 60, sink_token=False)


@pytest.mark.parametrize("name", ["full", "window", "streaming_llm", "h2o", "recompute_window"])
def test_greedy_exact_match_equals_teacher_forced_exact_match(tiny_checkpoint, corpus, name):
    """Until its first wrong token, greedy decoding sees the true answer prefix, so a causal policy's
    greedy exact match and teacher-forced exact match must agree stream by stream."""
    model = tiny_checkpoint.model
    b = recall_streams(corpus, 3, 200, sink_token=False, depths=(0.2, 0.8), seed=0)
    # make some answers the model's own greedy continuation, so both kinds of outcome occur
    for i in range(0, len(b.values), 2):
        s, n = int(b.answer_start[i]), int(b.answer_len[i])
        b.tokens[i, s : s + n] = generate(model, b.tokens[i : i + 1, :s], make_policy(name), 32, n)[0]
    f = recall_accuracy(model, b, make_policy(name), 32, StreamSpec(batch_size=4))
    assert len(f) == 6 and set(f["depth"]) == {0.2, 0.8}
    assert (f["exact_greedy"] == f["exact_teacher_forced"]).all()
    assert f["exact_greedy"].iloc[::2].all()  # the planted greedy answers are recalled exactly
    assert ((0 <= f["token_accuracy"]) & (f["token_accuracy"] <= 1)).all() and (f["ppl"] > 1).all()


def test_oracle_recall_is_teacher_forced_only(tiny_checkpoint, corpus):
    b = recall_streams(corpus, 1, 200, sink_token=False, depths=(0.5,), seed=1)
    f = recall_accuracy(tiny_checkpoint.model, b, make_policy("oracle"), 32)
    assert "exact_greedy" not in f and np.isfinite(f["answer_nll"]).all()


def test_a_recall_run_records_accuracy_by_depth(tmp_path):
    import json

    import pandas as pd

    from evictlab import run as run_mod
    from tests.test_pipeline import cfg_for

    overrides = ["strategy=h2o", "budget=b32", "logger=none", "eval.task=recall", "eval.stream_len=160",
                 "eval.recall_per_depth=2", "eval.recall_depths=[0.25,0.75]"]  # fmt: skip
    cfg = cfg_for(tmp_path / "outputs", *overrides)
    m = run_mod.run(cfg)
    rec = pd.read_parquet(run_mod.run_dir(cfg) / "recall.parquet")
    assert len(rec) == 4 and m["n_streams"] == 4 and sorted(set(rec["depth"])) == [0.25, 0.75]
    assert m["recall_exact_teacher_forced"] == pytest.approx(rec["exact_teacher_forced"].mean())
    assert json.loads((run_mod.run_dir(cfg) / "metrics.json").read_text())["status"] == "ok"
    from evictlab.analysis import figures as F
    from evictlab.analysis.aggregate import aggregate
    from evictlab.analysis.report import load_tables
    from evictlab.data import load_documents

    aggregate([run_mod.run_dir(cfg).parent], run_mod.run_dir(cfg).parent)
    tables = load_tables(run_mod.run_dir(cfg).parent)
    assert len(tables["recall"]) == 4 and set(tables["recall"]["strategy"]) == {"h2o"}
    filler = load_documents(cfg.dataset)  # each stream names the documents its filler comes from
    assert set(
        tables["streams"]["documents"].str.split(" | ", regex=False).explode().str.split("@").str[0]
    ) <= {d.id for d in filler}
    assert "recall_heatmaps" in F.draw_all(tables)
    with pytest.raises(ConfigError, match="recall_depths"):
        cfg_for(tmp_path / "outputs", "eval.task=recall", "eval.recall_depths=[1.5]")
    # without greedy decoding: the same teacher-forced numbers, no greedy column, another run key
    quick = cfg_for(tmp_path / "outputs", *overrides, "eval.recall_greedy=false")
    assert run_mod.run_dir(quick) != run_mod.run_dir(cfg)
    q = run_mod.run(quick)
    fast = pd.read_parquet(run_mod.run_dir(quick) / "recall.parquet")
    assert "exact_greedy" in rec and "exact_greedy" not in fast and "recall_exact_greedy" not in q
    pd.testing.assert_frame_equal(fast, rec.drop(columns="exact_greedy"))
    assert q["recall_exact_teacher_forced"] == m["recall_exact_teacher_forced"]


def test_dataset_recall_trains_with_pass_keys_and_evaluates_recall(tmp_path):
    from dataclasses import replace

    from tests.test_pipeline import cfg_for

    cfg = cfg_for(tmp_path / "outputs", "dataset=recall")
    assert cfg.dataset.name == "recall" and cfg.eval.task.value == "recall" and cfg.train.recall_share > 0
    plain = cfg_for(tmp_path / "outputs", "eval.task=recall", f"train.recall_share={cfg.train.recall_share}",
                    f"train.recall_queries={cfg.train.recall_queries}")  # fmt: skip
    assert cfg.train.recall_queries > 1
    assert replace(cfg.dataset, name="pydoc_topics") == plain.dataset  # the same text as filler
    assert cfg.train == plain.train and cfg.eval == plain.eval
    # the command line still wins over what the dataset sets
    assert cfg_for(tmp_path / "outputs", "dataset=recall", "train.recall_share=0.1").train.recall_share == 0.1


def test_training_documents_can_ask_for_the_key_many_times(corpus):
    from evictlab.data.recall import make_recall_sequence

    tok, prefix = corpus.tokenizer, np.array([corpus.tokenizer.bos_id])
    filler = corpus.splits["train"].ids
    one = make_recall_sequence(tok, prefix, filler, 300, 0.2, np.random.default_rng(5))
    four = make_recall_sequence(tok, prefix, filler, 300, 0.2, np.random.default_rng(5), queries=4)
    for seq, n_q in ((one[0], 1), (four[0], 4)):
        text = tok.decode(seq.tolist())
        assert len(seq) == 300 and text.count(QUERY + ANSWER.format(v=four[4])) == n_q
        assert text.index(NEEDLE.format(v=four[4])) < text.index(QUERY)  # every question after the needle
        assert text.endswith(QUERY + ANSWER.format(v=four[4]))
    assert one[4] == four[4] and one[3] > four[3]  # same key; less filler, so the same depth comes sooner
    with pytest.raises(ConfigError, match="filler tokens"):
        make_recall_sequence(tok, prefix, filler, 120, 0.5, np.random.default_rng(0), queries=8)


def test_recall_queries_default_keeps_checkpoint_and_run_keys(tmp_path):
    from evictlab.checkpoints import checkpoint_key
    from evictlab.run import run_key
    from tests.test_pipeline import cfg_for

    base, same, more = (
        cfg_for(tmp_path, *o) for o in ([], ["train.recall_queries=1"], ["train.recall_queries=3"])
    )
    corpus = load_corpus(base.dataset, base.tokenizer, base.outputs)
    assert checkpoint_key(base, corpus) == checkpoint_key(same, corpus) != checkpoint_key(more, corpus)
    assert run_key(base) == run_key(same) != run_key(more)
    with pytest.raises(ConfigError, match="recall_queries"):
        cfg_for(tmp_path, "train.recall_queries=0")


def test_smear_keys_off_is_left_out_of_checkpoint_and_run_keys(tmp_path, monkeypatch):
    """model.smear_keys came after checkpoints existed: at its default (false) it is in no key, so the keys
    of older checkpoints and runs stay valid; switched on, it changes both."""
    import evictlab.checkpoints as store_mod
    from evictlab.run import run_key
    from tests.test_pipeline import cfg_for

    base, on = cfg_for(tmp_path), cfg_for(tmp_path, "model.smear_keys=true")
    corpus = load_corpus(base.dataset, base.tokenizer, base.outputs)
    assert store_mod.checkpoint_key(base, corpus) != store_mod.checkpoint_key(on, corpus)
    assert run_key(base) != run_key(on)
    hashed = []
    monkeypatch.setattr(store_mod, "stable_hash", lambda d: hashed.append(d) or "k")
    store_mod.checkpoint_key(base, corpus), store_mod.checkpoint_key(on, corpus)
    assert "smear_keys" not in hashed[0]["model"] and hashed[0]["model"]["n_layer"] == base.model.n_layer
    assert hashed[1]["model"]["smear_keys"] is True


def test_verify_re_runs_a_recall_snapshot_answer_by_answer(session_outputs, tmp_path, monkeypatch):
    """make verify on a pass-key sweep: its first streams re-run and each answer's NLL, teacher-forced and
    greedy exact match compared with the snapshot's recall table; an answer NLL 1% off fails."""
    from evictlab import results as R
    from evictlab import run as run_mod
    from evictlab import verify as V
    from evictlab.analysis.aggregate import aggregate
    from tests.test_pipeline import FAST, cfg_for

    recall = [
        "eval.task=recall",
        "eval.stream_len=160",
        "eval.recall_per_depth=2",
        "eval.recall_depths=[0.25,0.75]",
    ]
    overrides = ["group=recall_verify", "strategy=tova", "budget=b32", "logger=none", *recall]
    cfg = cfg_for(session_outputs, *overrides)
    run_mod.run(cfg)
    folder = tmp_path / "recall_verify"
    aggregate([run_mod.run_dir(cfg).parent], folder / "snapshot")
    sampled = [V.Sampled(run_mod.run_key(cfg), "tova b32 original", [*FAST, *overrides], {}, None)]
    monkeypatch.setattr(V, "sample_runs", lambda results, experiment, every=False: sampled)
    now, notes = V.rerun(folder, "unused", streams=3, outputs=session_outputs)
    assert not notes and sorted(set(now["stream"])) == [0, 1, 2]
    tables = R.read_tables(folder / "snapshot")
    snapshot = V.snapshot_answers(tables["streams"], tables.get("tasks"), tables["recall"])
    rows = V.compare(snapshot, now)
    assert rows["ok"].all(), V.report(rows)
    assert {"answer_nll", "exact_teacher_forced", "exact_greedy"} <= set(rows["metric"])
    off = V.snapshot_answers(
        tables["streams"], tables["recall"].assign(answer_nll=tables["recall"]["answer_nll"] * 1.01)
    )
    bad = V.compare(off, now)
    assert set(bad.loc[~bad["ok"], "metric"]) == {"answer_nll"}
