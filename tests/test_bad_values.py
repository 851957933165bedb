"""Every bad value fails before any work, in one line that names the key and the value (issue 14, item 6).

The table composes conf/ in process (as the command line would) and validates it with `to_objects`; the
command-line path itself (exit code 2, one `error:` line, nothing written) is tested in test_cli.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from evictlab.checkpoints import get_checkpoint
from evictlab.config import check_writable, compose, to_objects
from evictlab.data.corpora import DatasetConfig, load_documents
from evictlab.errors import ConfigError, DataError, DivergedError
from tests.conftest import TINY, make_cfg

BAD = [
    # (overrides, texts the error message must contain: the key and the value)
    # strategy parameters: type and range
    (["strategy=streaming_llm", "strategy.params.n_sink=2.5"], ["strategy.params.n_sink", "2.5", "integer"]),
    (["strategy=streaming_llm", "strategy.params.n_sink=-1"], ["strategy.params.n_sink", "-1"]),
    (["strategy=streaming_llm", "strategy.params.n_sink=true"], ["strategy.params.n_sink", "True"]),
    (["strategy=tova", "strategy.params.per_head=no"], ["strategy.params.per_head", "'no'", "true or false"]),
    (["strategy=tova", "strategy.params.per_head=1"], ["strategy.params.per_head", "1"]),
    (["strategy=scissorhands", "strategy.params.threshold=nan"], ["params.threshold", "nan", "finite"]),
    (["strategy=scissorhands", "strategy.params.threshold=inf"], ["strategy.params.threshold", "inf"]),
    (["strategy=scissorhands", "strategy.params.threshold=0"], ["strategy.params.threshold", "0"]),
    (["strategy=scissorhands", "strategy.params.history_window=4.5"], ["params.history_window", "4.5"]),
    (["strategy=scissorhands", "strategy.params.n_recent=-2"], ["strategy.params.n_recent", "-2"]),
    (["strategy=h2o", "strategy.params.recent_fraction=abc"], ["strategy.params.recent_fraction", "'abc'"]),
    (["strategy=h2o", "strategy.params.recent_fraction=1.5"], ["strategy.params.recent_fraction", "1.5"]),
    (["strategy=random", "strategy.params.seed=-1"], ["strategy.params.seed", "-1"]),
    (["strategy=random", "strategy.params.seed=0.5"], ["strategy.params.seed", "0.5"]),
    (["strategy=l2norm", "strategy.params.n_recent=-3"], ["strategy.params.n_recent", "-3"]),
    (["strategy=streaming_llm", "budget=b16", "strategy.params.n_sink=16"], ["strategy.params.n_sink=16"]),
    # a misspelt parameter: the valid names, as they are written on the command line
    (["strategy=streaming_llm", "+strategy.params.nsink=1"], ["nsink", "strategy.params.n_sink"]),
    (["strategy=h2o", "+strategy.params.recent=0.5"], ["recent", "strategy.params.recent_fraction"]),
    # non-finite or out-of-range numbers anywhere
    (["train.lr=nan"], ["train.lr", "nan"]),
    (["train.lr=inf"], ["train.lr", "inf"]),
    (["train.min_lr=nan"], ["train.min_lr", "nan"]),
    (["train.weight_decay=nan"], ["train.weight_decay", "nan"]),
    (["train.weight_decay=-0.1"], ["train.weight_decay", "-0.1"]),
    (["train.grad_clip=inf"], ["train.grad_clip", "inf"]),
    (["train.beta1=1.0"], ["train.beta1", "1.0"]),
    (["train.beta2=1.5"], ["train.beta2", "1.5"]),
    (["train.beta1=-0.1"], ["train.beta1", "-0.1"]),
    (["train.seed=-3"], ["train.seed", "-3"]),
    (["seed=-1"], ["seed", "-1"]),
    (["train.synthetic_share=nan"], ["train.synthetic_share", "nan"]),
    (["train.recall_share=inf"], ["train.recall_share", "inf"]),
    (["train.synthetic_warmup=-1"], ["train.synthetic_warmup", "-1"]),
    (["train.synthetic_warmup=999"], ["train.synthetic_warmup", "999"]),
    (["model.rope_base=nan"], ["model.rope_base", "nan"]),
    (["model.rope_base=inf"], ["model.rope_base", "inf"]),
    (["model.rope_base=0.5"], ["model.rope_base", "0.5"]),
    (["model.norm_eps=-1e-5"], ["model.norm_eps", "-1e-05"]),
    (["model.norm_eps=0"], ["model.norm_eps", "0"]),
    (["model.init_std=-0.02"], ["model.init_std", "-0.02"]),
    (["model.init_std=nan"], ["model.init_std", "nan"]),
    (["budget=frac1_2", "budget.fraction=nan"], ["budget.fraction", "nan"]),
    (["budget.tokens=0"], ["budget.tokens", "0"]),
    (["budget=0"], ["budget.tokens", "0"]),
    (["budget=64,b32"], ["budget=64,b32", "budget.tokens"]),
    (["budget=64,0.5"], ["budget=64,0.5", "not both"]),
    (["dataset.val_fraction=nan"], ["dataset.val_fraction", "nan"]),
    (["dataset.test_fraction=inf"], ["dataset.test_fraction", "inf"]),
    (["eval.recall_depths=[0.1,nan]"], ["eval.recall_depths", "nan"]),
    (["eval.full_max_len=0"], ["eval.full_max_len", "0"]),
    (["eval.generate_tokens=-1"], ["eval.generate_tokens", "-1"]),
    # where results go
    (["group=/tmp/elsewhere"], ["group", "/tmp/elsewhere"]),
    (["group=../up"], ["group", "../up"]),
    (["group="], ["group"]),
]


@pytest.mark.parametrize("overrides, expect", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_value_fails_in_one_line_naming_key_and_value(overrides, expect, tmp_path: Path):
    with pytest.raises(ConfigError) as err:
        to_objects(compose([*TINY, f"paths.outputs={tmp_path / 'out'}", *overrides]))
    msg = str(err.value)
    assert "\n" not in msg
    for text in expect:
        assert text in msg, msg
    assert not (tmp_path / "out").exists()


def test_the_table_is_at_least_thirty_inputs():
    assert len(BAD) >= 30


def test_good_values_next_to_the_bad_ones_pass(tmp_path: Path):
    """The checks refuse only what is wrong: the boundary values on the right side still validate."""
    good = [
        ["strategy=streaming_llm", "strategy.params.n_sink=0"],
        ["strategy=tova", "strategy.params.per_head=true"],
        ["strategy=scissorhands", "strategy.params.threshold=2"],  # an integer for a float parameter
        ["train.beta1=0", "train.weight_decay=0", "train.grad_clip=0", "seed=0"],
        ["group=a/b"],
    ]
    for overrides in good:
        to_objects(compose([*TINY, f"paths.outputs={tmp_path / 'out'}", *overrides]))


@pytest.mark.parametrize(
    "overrides, tokens, fraction, name",
    [
        (["budget=100"], 100, None, "b100"),
        (["budget=b256", "budget.tokens=100"], 100, None, "b100"),  # the label follows the value
        (["budget=0.25"], None, 0.25, "frac1_4"),
        (["budget=0.3"], None, 0.3, "frac0.3"),
        (["budget=frac1_16"], None, 0.0625, "frac1_16"),
        (["budget=b64"], 64, None, "b64"),
    ],
)
def test_a_budget_is_a_number_on_the_command_line(overrides, tokens, fraction, name, tmp_path: Path):
    b = to_objects(compose([*TINY, f"paths.outputs={tmp_path / 'out'}", *overrides])).budget
    assert (b.tokens, b.fraction, b.name) == (tokens, fraction, name)


def test_a_sweep_of_numeric_budgets_is_a_sweep_of_entries():
    from evictlab.config import budget_shorthand

    shorthand = budget_shorthand(["strategy=window", "budget=64,100"])
    assert shorthand == ["strategy=window", "budget.tokens=64,100"]
    assert budget_shorthand(["budget=0.5,0.25"]) == ["budget.fraction=0.5,0.25", "budget.tokens=null"]
    assert budget_shorthand(["budget=b16,b32", "budget.tokens=8"]) == ["budget=b16,b32", "budget.tokens=8"]


def test_outputs_that_is_a_file_or_not_writable_fails(tmp_path: Path, monkeypatch):
    blocker = tmp_path / "afile"
    blocker.write_text("")
    for path in (blocker, blocker / "sub"):
        with pytest.raises(ConfigError, match="is a file, not a folder"):
            make_cfg(path)
    # Read-only: root writes through any mode bits, so the permission answer is what the check reads.
    import evictlab.config as config_mod

    monkeypatch.setattr(config_mod.os, "access", lambda path, mode: False)
    with pytest.raises(ConfigError, match=r"paths.outputs=.*is not writable"):
        check_writable("paths.outputs", tmp_path / "new" / "outputs")


def test_text_files_of_binary_bytes_are_refused_and_a_few_bad_bytes_reported(tmp_path: Path, caplog):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "good.txt").write_text("plain text " * 200)
    (corpus / "blob.txt").write_bytes(bytes(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8)))
    cfg = DatasetConfig(name="t", kind="text_files", path=str(corpus))
    with pytest.raises(DataError, match=r"bytes are not UTF-8 text .*blob.txt.*not used"):
        load_documents(cfg)
    (corpus / "blob.txt").write_bytes("caf\xe9 latin-1".encode("latin-1"))  # 1 bad byte of ~2,200
    with caplog.at_level("WARNING"):
        docs = load_documents(cfg)
    assert "1 of 2,212 bytes are not UTF-8" in caplog.text
    assert any("caf\ufffd latin-1" in d.text for d in docs)


def test_a_diverging_training_stops_and_caches_nothing(outputs: Path, monkeypatch):
    import evictlab.train as train_mod

    real = train_mod.GPT

    def poisoned(cfg):  # a model whose loss is NaN from the first step
        model = real(cfg)
        with torch.no_grad():
            model.wte.weight[0, 0] = math.nan
        return model

    monkeypatch.setattr(train_mod, "GPT", poisoned)
    with pytest.raises(DivergedError, match=r"training diverged: loss nan at step 1"):
        get_checkpoint(make_cfg(outputs))
    assert not list((outputs / "checkpoints").glob("*/model.safetensors"))


def test_a_non_finite_evaluation_is_a_failed_run_never_ok(outputs: Path, tiny_checkpoint, monkeypatch):
    import evictlab.run as run_mod
    from evictlab.store import read_json

    real = run_mod.evaluate

    def nan_evaluate(*args, **kwargs):
        res = real(*args, **kwargs)
        res.per_token["nll"][0, 3] = math.nan
        res.summary["ppl"] = math.nan
        return res

    monkeypatch.setattr(run_mod, "evaluate", nan_evaluate)
    cfg = make_cfg(outputs, "logger=none", "eval.n_streams=2", "eval.stream_len=32")
    with pytest.raises(DivergedError, match=r"not finite at 1 positions"):
        run_mod.run(cfg)
    metrics = read_json(run_mod.run_dir(cfg) / "metrics.json")
    assert metrics["status"] == "failed" and "DivergedError" in metrics["error"]
    assert not pd.isna(metrics["run_key"])
