"""`python -m evictlab.train` as a user runs it: bad input fails in one clear line, writing nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_cli

TINY = ["model=gpt_tiny", "train=tiny", "train.progress=false"]


def _small_corpus(tmp: Path) -> str:
    d = tmp / "small"
    d.mkdir()
    for i in range(4):
        (d / f"{i}.txt").write_text(f"a very short document {i}")
    return str(d)


def _empty_file(tmp: Path) -> str:
    (tmp / "empty.txt").write_text("")
    return str(tmp / "empty.txt")


BAD = [
    # (id, overrides (callables get tmp_path), text the first line must contain)
    ("unknown-model", ["model=gpt_huge"], "model/gpt_huge"),
    ("unknown-dataset", ["dataset=wikipedia_dump"], "dataset/wikipedia_dump"),
    ("embd-not-divisible", ["model.n_embd=100", "model.n_head=3"], "model.n_embd=100"),
    ("missing-path", ["dataset=text_files", "dataset.path=/nonexistent/corpus.txt"], "dataset.path"),
    ("path-not-given", ["dataset=text_files"], "dataset.path"),
    ("empty-path", ["dataset=text_files", lambda t: f"dataset.path={_empty_file(t)}"], "empty"),
    (
        "corpus-too-small",
        ["dataset=text_files", lambda t: f"dataset.path={_small_corpus(t)}"],
        "fewer than one sequence",
    ),
    (
        "seq-beyond-learned-table",
        ["model.pos_emb=learned", "model.block_size=32", "train.seq_len=64"],
        "train.seq_len=64",
    ),
    ("zero-steps", ["train.steps=0"], "train.steps=0"),
    ("negative-steps", ["train.steps=-5"], "train.steps=-5"),
    ("zero-lr", ["train.lr=0"], "train.lr=0"),
    ("negative-lr", ["train.lr=-0.1"], "train.lr=-0.1"),
    ("zero-batch", ["train.batch_size=0"], "train.batch_size=0"),
    ("negative-batch", ["train.batch_size=-4"], "train.batch_size=-4"),
    ("non-integer-seed", ["train.seed=1.5"], "train.seed"),
    ("unknown-key", ["train.stpes=10"], "stpes"),
    ("bad-enum", ["model.pos_emb=alibi"], "pos_emb"),
    # a number where Hydra expects a budget file: rewritten (budget=100 is budget.tokens=100), or one line
    ("budget-list-mixes-files-and-numbers", ["budget=64,b32"], "budget.tokens=64,100"),
    ("budget-number-out-of-range", ["budget=1.5"], "budget=1.5"),
    ("budget-number-negative", ["budget=-4"], "budget.tokens=-4"),
]


@pytest.mark.parametrize("overrides, expect", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_fails_in_one_line_and_writes_nothing(overrides, expect, tmp_path: Path):
    outputs = tmp_path / "outputs"
    args = [o(tmp_path) if callable(o) else o for o in overrides]
    res = run_cli("evictlab.train", *TINY, *args, outputs=outputs)
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines, res.stdout
    assert expect in lines[0], res.stderr
    if lines[0].startswith("error: "):  # evictlab's own checks: exactly one line, no traceback
        assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    assert not (outputs / "checkpoints").exists() or not any((outputs / "checkpoints").iterdir())
    assert not any((outputs / "cache").rglob("*.npz")) if (outputs / "cache").exists() else True


def test_help_describes_evictlabs_own_groups_and_keys(tmp_path: Path):
    res = run_cli("evictlab.run", "--help", outputs=tmp_path / "outputs")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert out.startswith("evictlab: ") and "budget=100" in out
    groups = out.split("== Config groups (GROUP=OPTION) ==")[1].split("==")[0]
    names = {line.split(":")[0] for line in groups.strip().splitlines()}
    assert {"model", "dataset", "strategy", "budget", "experiment", "variant"} <= names
    assert not [n for n in names if n.startswith("hydra")]  # Hydra's own groups stay in --hydra-help
    assert "policy" not in names and "local" not in names  # the strategy files' schemas, cluster templates
    assert "arm: bos_key, bos_value, none" in groups and "strategy: bos_ablation, full, h2o" in groups
    assert "strategy:" in out.split("== Keys and their defaults")[1]
    assert not (tmp_path / "outputs").exists()
