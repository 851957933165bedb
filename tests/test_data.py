"""Corpora, the document split, tokenizers and the token cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from evictlab.data import DatasetConfig, TokenizerConfig, load_corpus, load_documents, split_documents
from evictlab.data.corpora import content_hash
from evictlab.data.tokenizers import ByteTokenizer
from evictlab.errors import DataError


def test_pydoc_topics_is_real_english_prose():
    docs = load_documents(DatasetConfig())
    assert len(docs) >= 60
    total = sum(len(d.text) for d in docs)
    assert 300_000 < total < 1_000_000
    assert [d.id for d in docs] == sorted(d.id for d in docs)
    assert any("the" in d.text.split() for d in docs)


def test_python_stdlib_sorted_and_capped():
    cfg = DatasetConfig(name="python_stdlib", kind="python_stdlib", max_bytes=300_000)
    docs = load_documents(cfg)
    assert len(docs) > 3
    assert sum(len(d.text.encode()) for d in docs) <= 300_000
    assert [d.id for d in docs] == sorted(d.id for d in docs)
    assert all(d.id.endswith(".py") for d in docs)


def test_split_is_deterministic_disjoint_and_complete():
    cfg = DatasetConfig()
    docs = load_documents(cfg)
    a, b = split_documents(docs, cfg), split_documents(list(docs), cfg)
    assert {s: [d.id for d in v] for s, v in a.items()} == {s: [d.id for d in v] for s, v in b.items()}
    ids = [d.id for s in a.values() for d in s]
    assert sorted(ids) == sorted(d.id for d in docs) and len(set(ids)) == len(ids)
    assert len(a["val"]) == round(len(docs) * 0.1) and len(a["test"]) == round(len(docs) * 0.1)
    other = split_documents(docs, DatasetConfig(split_seed=1))
    assert [d.id for d in other["test"]] != [d.id for d in a["test"]]
    assert content_hash(a["train"]) == content_hash(b["train"]) != content_hash(a["val"])


def test_text_files_file_folder_glob(tmp_path: Path):
    (tmp_path / "a.txt").write_text("alpha doc\n\n===\n\nsecond doc")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("beta")
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01")
    folder = load_documents(DatasetConfig(kind="text_files", path=str(tmp_path)))
    assert [d.text for d in folder] == ["alpha doc\n\n===\n\nsecond doc", "beta"]
    sep = load_documents(DatasetConfig(kind="text_files", path=str(tmp_path / "a.txt"), doc_separator="==="))
    assert len(sep) == 2
    glob = load_documents(DatasetConfig(kind="text_files", path=str(tmp_path / "**" / "*.md")))
    assert [d.text for d in glob] == ["beta"]


def test_text_files_bad_paths(tmp_path: Path):
    with pytest.raises(DataError, match="no such file"):
        load_documents(DatasetConfig(kind="text_files", path=str(tmp_path / "missing.txt")))
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(DataError, match="empty"):
        load_documents(DatasetConfig(kind="text_files", path=str(tmp_path / "empty.txt")))


def test_hf_dataset_from_a_locally_saved_dataset(tmp_path: Path):
    import datasets

    rows = {"text": [f"document number {i} " * 20 for i in range(12)], "label": list(range(12))}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ds"))
    docs = load_documents(DatasetConfig(kind="hf_dataset", hf_name=str(tmp_path / "ds")))
    assert [d.text for d in docs] == rows["text"]
    # Also the data-files route (a builder name + local files), as with `load_dataset("json", ...)`.
    import json

    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps({"body": t}) for t in rows["text"]))
    cfg = DatasetConfig(
        kind="hf_dataset", hf_name="json", data_files=str(tmp_path / "rows.jsonl"), text_field="body"
    )
    assert [d.text for d in load_documents(cfg)] == rows["text"]
    with pytest.raises(DataError, match="text_field"):
        load_documents(DatasetConfig(kind="hf_dataset", hf_name=str(tmp_path / "ds"), text_field="nope"))


def test_hf_dataset_offline_hub_id_fails_in_one_line(monkeypatch):
    import datasets
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # read at import time, so patch the loaded modules too
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError) as err:
        load_documents(DatasetConfig(kind="hf_dataset", hf_name="evictlab-test/definitely-not-cached"))
    msg = str(err.value)
    assert "\n" not in msg and "local folder" in msg


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo, wörld — ∑"
    ids = tok.encode(text)
    assert ids.max() < 256 and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *ids]) == "<bos>" + text


def test_bpe_trains_on_train_split_and_is_cached(outputs: Path, capsys):
    tok_cfg = TokenizerConfig(kind="bpe", vocab_size=400)
    corpus = load_corpus(DatasetConfig(), tok_cfg, outputs)
    said = capsys.readouterr().err  # the training says what it does, then how long it took
    assert "training a BPE tokenizer (400 tokens) on " in said and "BPE tokenizer trained in " in said
    tok = corpus.tokenizer
    assert tok.vocab_size == 400 and {tok.bos_id, tok.sink_id} <= set(range(400))
    text = "The with statement is used to wrap the execution of a block."
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) < len(text.encode()) / 1.5  # merges learned
    files = list((outputs / "cache" / "tokenizers").glob("bpe-*.json"))
    assert len(files) == 1
    mtime = files[0].stat().st_mtime_ns
    again = load_corpus(DatasetConfig(), tok_cfg, outputs)
    assert files[0].stat().st_mtime_ns == mtime  # not retrained
    assert "training a BPE" not in capsys.readouterr().err
    assert again.data_hash == corpus.data_hash
    assert again.data_hash != load_corpus(DatasetConfig(), TokenizerConfig(), outputs).data_hash


def test_token_cache_hit_encodes_nothing_and_is_identical(outputs: Path, monkeypatch):
    import evictlab.data.dataset as dataset_mod

    first = load_corpus(DatasetConfig(), TokenizerConfig(), outputs)
    paths = {s: first.splits.path(s) for s in ("train", "val", "test")}
    assert not any(p.exists() for p in paths.values())  # nothing tokenized until a split is used
    first.splits["val"]
    assert paths["val"].exists() and not paths["train"].exists()
    for s in paths:
        first.splits[s]
    mtimes = {s: p.stat().st_mtime_ns for s, p in paths.items()}

    def no_save(*args, **kwargs):
        raise AssertionError("a cached token file was built again")

    monkeypatch.setattr(dataset_mod, "_save", no_save)  # what matters: nothing is tokenized or written
    second = load_corpus(DatasetConfig(), TokenizerConfig(), outputs)
    assert {s: p.stat().st_mtime_ns for s, p in paths.items()} == mtimes
    for s in ("train", "val", "test"):
        np.testing.assert_array_equal(first.splits[s].ids, second.splits[s].ids)
        assert first.splits[s].doc_ids == second.splits[s].doc_ids
    assert first.splits["train"].n_bytes == first.splits["train"].n_tokens  # byte-level: 1 token per byte


def test_corrupt_token_cache_is_rebuilt(outputs: Path):
    first = load_corpus(DatasetConfig(), TokenizerConfig(), outputs)
    first.splits["val"]
    first.splits.path("val").write_bytes(b"garbage")
    second = load_corpus(DatasetConfig(), TokenizerConfig(), outputs)
    np.testing.assert_array_equal(first.splits["val"].ids, second.splits["val"].ids)


def test_corpus_too_small_writes_nothing(tmp_path: Path, outputs: Path):
    for i in range(4):
        (tmp_path / f"{i}.txt").write_text(f"tiny {i}")
    with pytest.raises(DataError, match="fewer than one sequence"):
        load_corpus(
            DatasetConfig(kind="text_files", path=str(tmp_path)), TokenizerConfig(), outputs, min_tokens=65
        )
    assert not (outputs / "cache").exists() or not any((outputs / "cache").rglob("*.npz"))


def test_man_pages_are_read_where_they_stand_as_text(tmp_path, monkeypatch):
    import gzip

    from evictlab.data.corpora import _man_pages, troff_to_text
    from evictlab.errors import DataError

    page = (
        '.\\" a comment\n.TH LS 1\n.SH NAME\nls \\- list directory contents\n.TP\n'
        "\\fB\\-a\\fR, \\fB\\-\\-all\\fR\ndo not ignore\n"
    )
    assert troff_to_text(page) == "NAME\nls - list directory contents\n-a, --all\ndo not ignore\n"
    (tmp_path / "man1").mkdir()
    with gzip.open(tmp_path / "man1" / "ls.1.gz", "wt") as f:
        f.write(page)
    with gzip.open(tmp_path / "man1" / "dir.1.gz", "wt") as f:
        f.write(".so man1/ls.1\n")  # a link: not a document of its own
    # an alternative's link whose page an install left out (apt's --path-exclude): no page, no error
    (tmp_path / "man1" / "open.1.gz").symlink_to(tmp_path / "man1" / "xdg-open.1.gz")
    docs = _man_pages(str(tmp_path))
    assert [d.id for d in docs] == ["man1/ls.1.gz"] and "list directory contents" in docs[0].text
    with pytest.raises(DataError, match="no manual pages under"):
        _man_pages(str(tmp_path / "nowhere"))
    # cached: parsed once, read back equal; a changed page (size, mtime) is parsed again
    cache = tmp_path / "cache"  # (the dangling link is left out of the cache's key too)
    assert _man_pages(str(tmp_path), cache) == docs and len(list(cache.glob("man_pages-*.parquet"))) == 1
    import evictlab.data.corpora as corpora

    with monkeypatch.context() as m:
        m.setattr(corpora, "_parse_man_pages", lambda *_: pytest.fail("parsed again"))
        assert _man_pages(str(tmp_path), cache) == docs
    with gzip.open(tmp_path / "man1" / "ls.1.gz", "wt") as f:
        f.write(page + "extra line\n")
    again = _man_pages(str(tmp_path), cache)
    assert "extra line" in again[0].text and len(list(cache.glob("man_pages-*.parquet"))) == 2


def test_exclude_drops_documents_by_id_pattern_and_stays_out_of_keys(tmp_path: Path):
    from evictlab.config import key_dict

    for name in ("intro.txt", "gen-a.txt", "gen-b.txt"):
        (tmp_path / name).write_text(f"text of {name}\n")
    cfg = DatasetConfig(kind="text_files", path=str(tmp_path))
    assert len(load_documents(cfg)) == 3
    kept = load_documents(DatasetConfig(kind="text_files", path=str(tmp_path), exclude=["*/gen-*"]))
    assert [d.id.rsplit("/", 1)[1] for d in kept] == ["intro.txt#0"]
    with pytest.raises(DataError, match="leaves none of the 3 documents"):
        load_documents(DatasetConfig(kind="text_files", path=str(tmp_path), exclude=["*.txt#0"]))
    # no exclusion: the key of every corpus (and so of every checkpoint) is what it was before the field
    assert "exclude" not in key_dict(cfg) and key_dict(DatasetConfig(exclude=["x*"]))["exclude"] == ["x*"]


def test_pinned_corpus_is_the_committed_text_and_reads_no_installed_page(monkeypatch, outputs: Path):
    """dataset=man_pinned / man_pinned_long stream the bundle committed with evictlab: every text matches
    its manifest's sha256, all are held out, and nothing under /usr/share/man is read."""
    import glob
    import gzip
    import hashlib

    from evictlab.data import corpora

    def refuse(*args, **kwargs):
        if any("/usr/share/man" in str(a) for a in args):
            pytest.fail(f"a pinned corpus read the installed manual pages: {args}")
        return real_glob(*args, **kwargs)

    real_glob = glob.glob
    monkeypatch.setattr(glob, "glob", refuse)
    monkeypatch.setattr(gzip, "open", lambda *a, **k: pytest.fail("a pinned corpus opened a gzip file"))
    monkeypatch.setattr(corpora, "_man_pages", lambda *a, **k: pytest.fail("read the installed pages"))
    manifest = corpora.read_manifest("man_pages")
    for subset, n in (("pages", 48), ("long", 10)):
        cfg = DatasetConfig(name=f"pinned_{subset}", kind="pinned", bundle="man_pages", subset=subset)
        docs = load_documents(cfg)
        rows = [r for r in manifest if r["subset"] == subset]
        assert [d.id for d in docs] == [r["id"] for r in rows] and len(docs) == n
        for d, r in zip(docs, rows, strict=True):
            assert hashlib.sha256(d.text.encode()).hexdigest() == r["text_sha256"]
            assert len(d.text) == int(r["chars"])
            assert r["license"] and r["package"] and r["version"] and "gcloud" not in d.id
        assert {s: len(v) for s, v in split_documents(docs, cfg).items()} == {"train": 0, "val": 0, "test": n}
    with pytest.raises(DataError, match="holds no documents"):  # all held out: it trains no model
        load_corpus(
            DatasetConfig(name="p", kind="pinned", bundle="man_pages"), TokenizerConfig(), outputs, 65
        )
    from evictlab.errors import ConfigError

    with pytest.raises(ConfigError, match="not a pinned bundle; there are: man_pages"):
        DatasetConfig(kind="pinned", bundle="man_page")
    with pytest.raises(ConfigError, match="has long, pages"):
        load_documents(DatasetConfig(kind="pinned", bundle="man_pages", subset="short"))


def test_a_changed_pinned_text_fails_instead_of_streaming(tmp_path: Path, monkeypatch):
    import json
    import lzma
    import shutil

    from evictlab.data import corpora

    shutil.copytree(corpora.PINNED_ROOT / "man_pages", tmp_path / "man_pages")
    with lzma.open(tmp_path / "man_pages" / corpora.TEXTS, "rt", encoding="utf-8") as f:
        lines = [json.loads(x) for x in f]
    lines[3]["text"] = lines[3]["text"].replace("e", "E", 1)
    with lzma.open(tmp_path / "man_pages" / corpora.TEXTS, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(x) + "\n" for x in lines)
    monkeypatch.setattr(corpora, "PINNED_ROOT", tmp_path)
    with pytest.raises(DataError, match=f"document '{lines[3]['id']}' is not the text its manifest names"):
        load_documents(DatasetConfig(kind="pinned", bundle="man_pages"))


@pytest.mark.parametrize("source", ["documents", "concat"])
def test_each_stream_names_the_documents_its_text_comes_from(outputs: Path, source: str):
    from evictlab.data.streams import eval_streams

    corpus = load_corpus(DatasetConfig(), TokenizerConfig(), outputs)
    tokens, docs = eval_streams(corpus, 5, 900, False, source, "test", seed=3, return_documents=True)
    texts = {d.id: d.text for d in load_documents(DatasetConfig())}
    assert len(docs) == 5 and tokens.shape == (5, 900)
    for row, named in zip(tokens, docs, strict=True):
        parts = named.split(" | ")
        first, _, k = parts[0].partition("@")
        body = corpus.tokenizer.decode(row[1:].tolist()).encode()  # the byte tokenizer: token k is byte k
        if source == "documents":
            assert len(parts) == 1 and not k and texts[first].encode().startswith(body)
        else:  # each named document in turn, joined by <bos>, the first from its k-th token on
            joined = b"<bos>".join(
                [texts[first].encode()[int(k or 0) :], *(texts[p].encode() for p in parts[1:])]
            )
            assert joined.startswith(body) and len(joined) > len(body)
            assert body.count(b"<bos>") == len(parts) - 1 + body.startswith(b"<bos>")


def test_offset_streams_start_inside_their_documents_and_pair_the_bos_arms(outputs: Path):
    """eval.stream_source=offsets: each stream one document from a seeded offset, the same offset with or
    without <bos> (the two arms stream the same text), the documents those of `documents`."""
    from evictlab.data.streams import eval_streams

    with_bos = load_corpus(DatasetConfig(), TokenizerConfig(), outputs)
    without = load_corpus(DatasetConfig(bos=False), TokenizerConfig(), outputs)
    a, named = eval_streams(with_bos, 4, 300, False, "offsets", "test", seed=0, return_documents=True)
    b, named_b = eval_streams(without, 4, 300, False, "offsets", "test", seed=0, return_documents=True)
    assert named == named_b and (a[:, 0] == with_bos.tokenizer.bos_id).all() and (a[:, 1:] == b[:, :-1]).all()
    offsets = [int(n.partition("@")[2] or 0) for n in named]
    assert len(set(offsets)) == 4 and min(offsets) >= 0
    texts = {d.id: d.text.encode() for d in load_documents(DatasetConfig())}
    for row, n, k in zip(b, named, offsets, strict=True):  # the byte tokenizer: token k is byte k
        assert bytes(row.tolist()) == texts[n.partition("@")[0]][k : k + 300]
    _, plain = eval_streams(with_bos, 4, 300, False, "documents", "test", seed=0, return_documents=True)
    assert [n.partition("@")[0] for n in named] == plain
    assert eval_streams(with_bos, 4, 300, False, "offsets", "test", seed=1, return_documents=True)[1] != named
