"""Training and the checkpoint cache: determinism, round trip, cache hits, locking, corruption."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from evictlab.checkpoints import get_checkpoint, load_checkpoint
from evictlab.data import load_corpus
from evictlab.data.sampler import WindowSampler
from evictlab.train import lr_at, make_optimizer, ngram_bits_per_byte, train_model
from tests.conftest import TINY, make_cfg, run_cli


def test_two_trainings_with_one_seed_are_bit_identical(outputs: Path):
    cfg = make_cfg(outputs, "train.steps=15")
    corpus = load_corpus(cfg.dataset, cfg.tokenizer, cfg.outputs)
    cfg.model.vocab_size = corpus.tokenizer.vocab_size
    a, rec_a = train_model(cfg, corpus)
    b, rec_b = train_model(cfg, corpus)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert rec_a["history"] == rec_b["history"]
    cfg.train.seed = 1
    c, _ = train_model(cfg, corpus)
    assert not torch.equal(a.wte.weight, c.wte.weight)


def test_training_beats_unigram_and_meta_is_complete(tiny_checkpoint):
    meta = tiny_checkpoint.meta
    assert meta["val_bpb"] < meta["baselines"]["unigram_val_bpb"]
    assert meta["baselines"]["bigram_val_bpb"] < meta["baselines"]["unigram_val_bpb"]
    for key in (
        "model", "tokenizer", "data_hash", "train", "seed", "train_loss", "val_loss", "train_bpb", "val_bpb",
        "git", "packages", "wall_s", "weights_sha256", "tokens_per_s", "floor_fraction", "history",
    ):  # fmt: skip
        assert key in meta, key
    assert meta["val_bpb"] == pytest.approx(meta["val_loss"] / math.log(2))  # byte-level: 1 byte per token
    assert [r["step"] for r in meta["history"]] == list(range(1, meta["train"]["steps"] + 1))


def test_checkpoint_round_trip(tiny_checkpoint):
    model, meta = load_checkpoint(tiny_checkpoint.path)
    assert meta["key"] == tiny_checkpoint.meta["key"]
    for (name, pa), pb in zip(
        tiny_checkpoint.model.state_dict().items(), model.state_dict().values(), strict=True
    ):
        assert torch.equal(pa, pb), name
    assert model.lm_head.weight is model.wte.weight


def test_second_request_is_a_cache_hit(tiny_checkpoint, session_outputs: Path, monkeypatch):
    import evictlab.train as train_mod

    def no_training(*args, **kwargs):
        raise AssertionError("a cached checkpoint was trained again")

    monkeypatch.setattr(train_mod, "train_model", no_training)  # what matters: nothing is trained
    again = get_checkpoint(make_cfg(session_outputs))
    assert again.cached and again.path == tiny_checkpoint.path
    assert again.meta["weights_sha256"] == tiny_checkpoint.meta["weights_sha256"]
    # Settings that cannot change the weights share the checkpoint; ones that can, do not.
    assert get_checkpoint(make_cfg(session_outputs, "train.eval_interval=7")).cached
    assert make_cfg(session_outputs, "train.lr=0.001").train.lr == 0.001
    from evictlab.checkpoints import checkpoint_key

    corpus = load_corpus(
        *[getattr(make_cfg(session_outputs), k) for k in ("dataset", "tokenizer", "outputs")]
    )
    assert checkpoint_key(make_cfg(session_outputs, "train.lr=0.001"), corpus) != tiny_checkpoint.meta["key"]


def test_one_key_one_set_of_bits_whichever_way_training_is_launched(outputs: Path):
    """python -m evictlab.train under any OMP/MKL setting (how joblib, submitit and SLURM workers start it)
    and an in-process call after something set another thread count (an earlier run's eval.threads) train
    the same bits under one key; the thread count is in the key, and the caller's count is restored."""
    import os

    from evictlab.store import file_sha256

    args = [*TINY, "train.steps=30", "train.warmup_steps=5"]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        in_process = get_checkpoint(make_cfg(outputs / "in_process", *args[len(TINY) :]))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    paths = [in_process.path]
    for n in (1, 3):
        env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
        env |= {
            "EVICTLAB_OUTPUTS": str(outputs / f"env{n}"),
            "OMP_NUM_THREADS": str(n),
            "MKL_NUM_THREADS": str(n),
        }
        res = subprocess.run(
            [sys.executable, "-m", "evictlab.train", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 0, res.stdout + res.stderr
        (found,) = (outputs / f"env{n}" / "checkpoints").glob("gpt_tiny-*/model.safetensors")
        paths.append(found.parent)
    assert len({p.name for p in paths}) == 1  # one key
    assert len({file_sha256(p / "model.safetensors") for p in paths}) == 1  # one set of bits
    assert in_process.meta["build"]["torch_threads"] == 2 == make_cfg(outputs).train.threads
    assert {"torch", "cpu_capability", "python"} <= set(in_process.meta["build"])
    # another count is another key (and, for this model, other bits: the count matters)
    one = get_checkpoint(make_cfg(outputs / "in_process", *args[len(TINY) :], "train.threads=1"))
    assert one.path.name != in_process.path.name
    assert one.meta["weights_sha256"] != in_process.meta["weights_sha256"]


def test_a_checkpoint_from_another_torch_build_warns_in_one_line(
    tiny_checkpoint, session_outputs: Path, caplog
):
    from evictlab.store import read_json, write_json

    meta_path = tiny_checkpoint.path / "meta.json"
    meta = read_json(meta_path)
    try:
        write_json(meta_path, meta | {"build": meta["build"] | {"cpu_capability": "NEON", "torch": "1.0"}})
        with caplog.at_level("WARNING"):
            again = get_checkpoint(make_cfg(session_outputs))
        assert again.cached
        (line,) = [r.getMessage() for r in caplog.records if "was made under" in r.getMessage()]
        assert "cpu_capability NEON" in line and "torch 1.0" in line and "\n" not in line
    finally:
        write_json(meta_path, meta)


def test_corrupt_checkpoint_is_retrained_with_a_warning(outputs: Path, caplog):
    cfg = make_cfg(outputs, "train.steps=5", "train.warmup_steps=2")
    first = get_checkpoint(cfg)
    weights = first.path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    weights.write_bytes(bytes(data[: len(data) // 2]))  # truncated
    with caplog.at_level("WARNING"):
        again = get_checkpoint(make_cfg(outputs, "train.steps=5", "train.warmup_steps=2"))
    assert not again.cached and "retraining" in caplog.text
    assert torch.equal(again.model.wte.weight, first.model.wte.weight)  # same seed, same weights
    (again.path / "meta.json").write_text("{not json")
    with caplog.at_level("WARNING"):
        assert not get_checkpoint(make_cfg(outputs, "train.steps=5", "train.warmup_steps=2")).cached


@pytest.mark.parametrize(
    "edit",
    [("model", "rope_base", 500.0), ("train", "lr", 0.5), ("key", None, "0" * 16)],
)
def test_a_checkpoint_whose_meta_was_edited_is_retrained_not_loaded(outputs: Path, caplog, edit):
    import json

    args = ("train.steps=5", "train.warmup_steps=2")
    first = get_checkpoint(make_cfg(outputs, *args))
    meta_path = first.path / "meta.json"
    meta = json.loads(meta_path.read_text())
    section, name, value = edit
    if name is None:
        meta[section] = value
    else:
        meta[section][name] = value
    meta_path.write_text(json.dumps(meta))
    with caplog.at_level("WARNING"):
        again = get_checkpoint(make_cfg(outputs, *args))
    assert not again.cached and "retraining" in caplog.text
    assert (f"{section}.{name}=" if name else "says key") in caplog.text
    assert json.loads(meta_path.read_text())["model"]["rope_base"] == first.meta["model"]["rope_base"]
    assert get_checkpoint(make_cfg(outputs, *args)).cached  # the retrained one is sound


def test_a_checkpoint_from_before_a_neutral_model_field_still_loads(outputs: Path):
    """A meta.json written before model.smear_keys existed (no such entry) is the same checkpoint as one
    asking for its neutral value: the key and the settings check agree, and it loads from the cache."""
    import json

    args = ("train.steps=5", "train.warmup_steps=2")
    first = get_checkpoint(make_cfg(outputs, *args))
    meta_path = first.path / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["model"]["smear_keys"]
    meta_path.write_text(json.dumps(meta))
    assert get_checkpoint(make_cfg(outputs, *args)).cached


def test_two_processes_train_once(outputs: Path):
    args = [*TINY, "train.steps=400"]
    env_outputs = {"EVICTLAB_OUTPUTS": str(outputs)}
    import os

    env = {**os.environ, **env_outputs}
    first = subprocess.Popen(
        [sys.executable, "-m", "evictlab.train", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    for line in first.stdout:  # wait until the first process holds the lock and trains
        lines.append(line)
        if "training gpt_tiny" in line:
            break
    second = run_cli("evictlab.train", *args, outputs=outputs)
    rest, _ = first.communicate(timeout=300)
    out_first = "".join(lines) + rest
    assert first.returncode == 0 and second.returncode == 0, out_first + second.stderr
    assert "trained in" in out_first
    assert "loaded from cache" in second.stdout and "training gpt_tiny" not in second.stdout
    assert len(list((outputs / "checkpoints").glob("gpt_tiny-*/meta.json"))) == 1


def test_lr_schedule_and_weight_decay_groups(tiny_checkpoint, session_outputs: Path):
    tc = make_cfg(session_outputs, "train.steps=100", "train.warmup_steps=10").train
    assert lr_at(0, tc) == pytest.approx(tc.lr / 10)
    assert lr_at(9, tc) == pytest.approx(tc.lr)
    assert lr_at(99, tc) == pytest.approx(tc.min_lr, rel=1e-2)
    assert all(lr_at(s, tc) >= lr_at(s + 1, tc) for s in range(10, 99))
    opt = make_optimizer(tiny_checkpoint.model, tc)
    decayed, plain = opt.param_groups
    assert all(p.dim() == 2 for p in decayed["params"]) and decayed["weight_decay"] == tc.weight_decay
    assert all(p.dim() == 1 for p in plain["params"]) and plain["weight_decay"] == 0


def test_samples_start_with_bos_and_mask_specials(session_outputs: Path):
    cfg = make_cfg(session_outputs, "model.sink_token=true")
    corpus = load_corpus(cfg.dataset, cfg.tokenizer, cfg.outputs)
    tok = corpus.tokenizer
    x, y = WindowSampler(corpus.splits["train"], corpus, 32, sink_token=True, seed=0).batch(4)
    assert x.shape == y.shape == (4, 32)
    assert (x[:, 0] == tok.sink_id).all() and (x[:, 1] == tok.bos_id).all()
    assert (y[:, 0] == -1).all() and not torch.isin(y, torch.tensor([tok.bos_id, tok.sink_id])).any()
    x2, _ = WindowSampler(corpus.splits["train"], corpus, 32, sink_token=False, seed=0).batch(4)
    assert (x2[:, 0] == tok.bos_id).all()


def test_ngram_baselines_on_a_known_stream(session_outputs: Path):
    cfg = make_cfg(session_outputs)
    corpus = load_corpus(cfg.dataset, cfg.tokenizer, cfg.outputs)
    uni = ngram_bits_per_byte(corpus.splits["train"], corpus.splits["val"], corpus.tokenizer.vocab_size, 1)
    bi = ngram_bits_per_byte(corpus.splits["train"], corpus.splits["val"], corpus.tokenizer.vocab_size, 2)
    assert 4.0 < uni < 5.5 and 2.5 < bi < uni  # English bytes: ~4.5 bits unigram, ~3.3 bigram


def test_recall_share_mixes_pass_key_documents_into_training(session_outputs: Path):
    from evictlab.data.recall import QUERY

    cfg = make_cfg(session_outputs)
    corpus = load_corpus(cfg.dataset, cfg.tokenizer, cfg.outputs)
    query = corpus.tokenizer.encode(QUERY).tolist()

    def has_query(row) -> bool:
        r = row.tolist()
        return any(r[i : i + len(query)] == query for i in range(len(r) - len(query) + 1))

    x, y = WindowSampler(corpus.splits["train"], corpus, 128, False, seed=0, recall_share=0.5).batch(64)
    assert x.shape == (64, 128) and (x[:, 0] == corpus.tokenizer.bos_id).all()
    mixed = sum(has_query(r) for r in x)
    assert 15 < mixed < 50  # about half
    x2, _ = WindowSampler(corpus.splits["train"], corpus, 128, False, seed=0, recall_share=0.5).batch(64)
    assert torch.equal(x, x2)  # deterministic
    plain, _ = WindowSampler(corpus.splits["train"], corpus, 128, False, seed=0).batch(64)
    assert sum(has_query(r) for r in plain) == 0
    with pytest.raises(Exception, match="recall_share"):
        make_cfg(session_outputs, "train.recall_share=1.0")


def _same_weights(a, b) -> None:
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name


def test_a_killed_training_continues_from_its_saved_progress_bit_identically(
    outputs: Path, monkeypatch, caplog
):
    import evictlab.train as train_mod

    cfg = make_cfg(outputs, "train.steps=15", "train.warmup_steps=3", "train.save_every_s=0")
    corpus = load_corpus(cfg.dataset, cfg.tokenizer, cfg.outputs)
    whole = get_checkpoint(make_cfg(outputs / "whole", "train.steps=15", "train.warmup_steps=3"), corpus)

    real_lr_at = train_mod.lr_at

    def killed_at_step_10(step, tc):  # a process killed (SIGKILL, a lost node) in the middle of step 10
        if step == 9:
            raise RuntimeError("killed")
        return real_lr_at(step, tc)

    monkeypatch.setattr(train_mod, "lr_at", killed_at_step_10)
    with pytest.raises(RuntimeError, match="killed"):
        get_checkpoint(cfg, corpus)
    monkeypatch.undo()
    (saved,) = (outputs / "checkpoints" / ".progress").iterdir()
    assert not [p for p in (outputs / "checkpoints").iterdir() if not p.name.startswith(".")]

    with caplog.at_level("INFO"):
        resumed = get_checkpoint(cfg, corpus)
    assert "resuming training from step 9" in caplog.text
    _same_weights(whole.model, resumed.model)
    assert resumed.meta["weights_sha256"] == whole.meta["weights_sha256"]
    assert resumed.path.name == whole.path.name  # one key
    assert resumed.meta["history"] == whole.meta["history"]  # steps 1..15 once each, with the same losses
    assert not saved.exists()  # the checkpoint is written: the progress file is gone


def test_ctrl_c_stops_a_training_at_the_end_of_a_step_and_the_same_command_continues_it(
    outputs: Path, monkeypatch, caplog
):
    import os
    import signal
    import threading

    import evictlab.train as train_mod
    from evictlab.errors import TrainingInterrupted

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed from the main thread only")
    args = ("train.steps=12", "train.warmup_steps=3")
    cfg = make_cfg(outputs, *args)  # saves every 60 s: only the stop request saves here
    corpus = load_corpus(cfg.dataset, cfg.tokenizer, cfg.outputs)
    whole = get_checkpoint(make_cfg(outputs / "whole", *args), corpus)
    real_lr_at = train_mod.lr_at

    def ctrl_c_during_step_5(step, tc):
        if step == 4:
            os.kill(os.getpid(), signal.SIGINT)
        return real_lr_at(step, tc)

    monkeypatch.setattr(train_mod, "lr_at", ctrl_c_during_step_5)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(TrainingInterrupted, match="interrupted after step 5 of 12; its progress is saved in"):
        get_checkpoint(cfg, corpus)
    assert signal.getsignal(signal.SIGINT) is before  # the caller's handler is back
    monkeypatch.undo()
    with caplog.at_level("INFO"):
        resumed = get_checkpoint(cfg, corpus)
    assert "resuming training from step 5" in caplog.text
    _same_weights(whole.model, resumed.model)
    assert [r["step"] for r in resumed.meta["history"]] == list(range(1, 13))


def test_unusable_saved_progress_is_ignored_with_a_warning(outputs: Path, caplog):
    cfg = make_cfg(outputs, "train.steps=6", "train.warmup_steps=2")
    whole = get_checkpoint(make_cfg(outputs / "whole", "train.steps=6", "train.warmup_steps=2"))
    dest = outputs / "checkpoints" / ".progress" / f"{whole.path.name}.pt"
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"not a torch file")
    with caplog.at_level("WARNING"):
        again = get_checkpoint(cfg)
    assert "is unusable" in caplog.text and "training from step 0" in caplog.text
    _same_weights(whole.model, again.model)
    assert not dest.exists()


def test_a_full_disk_gives_one_clear_error_and_leaves_nothing_half_written(outputs: Path, monkeypatch):
    import errno

    import evictlab.checkpoints as store_mod
    from evictlab.errors import ConfigError, DiskFullError
    from evictlab.store import write_json

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    # a run file (every result, cache and metrics file goes through atomic_path)
    dest = outputs / "runs" / "g" / "r" / "metrics.json"
    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(DiskFullError, match=r"no space left on the device while writing .*metrics.json"):
        write_json(dest, {"status": "ok"})
    monkeypatch.undo()
    assert not dest.exists() and not list(dest.parent.iterdir())  # no temp file left behind
    assert issubclass(DiskFullError, ConfigError)  # the CLIs print a ConfigError as one `error:` line

    # a checkpoint (safetensors reports the OS error inside its own exception's text)
    def full_safetensors(*args, **kwargs):
        raise RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr(store_mod, "save_model", full_safetensors)
    cfg = make_cfg(outputs, "train.steps=5", "train.warmup_steps=2")
    with pytest.raises(DiskFullError, match="nothing half-written was kept"):
        get_checkpoint(cfg)
    monkeypatch.undo()
    assert not [p for p in (outputs / "checkpoints").iterdir() if p.name != ".locks"]
    assert not get_checkpoint(cfg).cached  # space back: trained and written whole


def test_the_training_line_gives_small_floor_shares_two_digits():
    from evictlab.checkpoints import Checkpoint, summary

    meta = {
        "model": {"name": "gpt_tiny"}, "params": 49_000, "val_bpb": 3.1, "wall_s": 12.0,
        "baselines": {"unigram_val_bpb": 4.7, "bigram_val_bpb": 3.3}, "tokens_per_s": 9000.0,
    }  # fmt: skip
    line = summary(Checkpoint(Path("ck"), None, meta | {"floor_fraction": 0.0031}, cached=False), 12.0)
    assert "= 0.31% of the FLOP floor" in line  # was "= 0%"
    line = summary(Checkpoint(Path("ck"), None, meta | {"floor_fraction": 0.314}, cached=False), 12.0)
    assert "= 31% of the FLOP floor" in line
