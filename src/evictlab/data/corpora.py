"""Corpora as lists of documents, and the deterministic split by document.

Built-in corpora need no download: ``pinned`` (a bundle of documents committed with evictlab, each
checked against its manifest's sha256: the same text on every machine), ``pydoc_topics`` (the English
prose of CPython's ``pydoc_data.topics``, one document per topic) and ``python_stdlib`` (the running
interpreter's standard-library sources, sorted by path, capped in size). ``man_pages`` reads the manual
pages this machine has installed (so its text changes with the machine's packages). ``text_files`` reads a
user's file, folder or glob; ``hf_dataset`` reads a Hugging Face dataset (hub id or local folder).
"""

from __future__ import annotations

import csv
import fnmatch
import glob
import gzip
import hashlib
import json
import logging
import lzma
import os
import re
import sysconfig
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from evictlab.errors import ConfigError, DataError

log = logging.getLogger(__name__)


class CorpusKind(str, Enum):
    pydoc_topics = "pydoc_topics"
    python_stdlib = "python_stdlib"
    text_files = "text_files"
    hf_dataset = "hf_dataset"
    man_pages = "man_pages"
    pinned = "pinned"


@dataclass
class DatasetConfig:
    name: str = "pydoc_topics"
    kind: CorpusKind = CorpusKind.pydoc_topics
    max_bytes: int = 0  # cap on the corpus size in UTF-8 bytes, whole documents in order (0 = no cap)
    min_doc_chars: int = 1  # drop documents shorter than this
    # drop documents whose id (e.g. "man1/gcloud-compute.1.gz") matches one of these fnmatch patterns;
    # empty is left out of every key (config.neutral, spelled out: config.py imports this module)
    exclude: list[str] = field(default_factory=list, metadata={"neutral": []})
    val_fraction: float = 0.1  # share of documents in the validation split
    test_fraction: float = 0.1  # share of documents in the test split (the evaluation streams)
    split_seed: int = 0
    bos: bool = True  # start every training sample and evaluation stream with <bos>
    # text_files
    path: str | None = None  # a file, a folder (all *.txt / *.md / *.py ... files) or a glob
    doc_separator: str | None = None  # split each file into documents on this string
    # hf_dataset
    hf_name: str | None = None  # hub id (e.g. "wikitext") or a local folder (save_to_disk or data files)
    hf_config: str | None = None  # e.g. "wikitext-103-raw-v1"
    hf_split: str = "train"
    text_field: str = "text"
    data_files: str | None = None  # with a builder name such as "json"/"text"/"parquet" in hf_name
    # pinned: a bundle under evictlab/data/pinned/ and which of its subsets (none: all); every document of a
    # pinned corpus is held out (the test split): it evaluates imported models and trains none
    bundle: str | None = field(default=None, metadata={"neutral": None})
    subset: str | None = field(default=None, metadata={"neutral": None})

    def __post_init__(self) -> None:
        self.kind = CorpusKind(self.kind)
        if self.max_bytes < 0:
            raise ConfigError(f"dataset.max_bytes={self.max_bytes} must be >= 0 (0 = no cap)")
        for key in ("val_fraction", "test_fraction"):
            v = getattr(self, key)
            if not 0 < v < 1:
                raise ConfigError(f"dataset.{key}={v} must be in (0, 1)")
        if self.val_fraction + self.test_fraction >= 1:
            raise ConfigError("dataset.val_fraction + dataset.test_fraction must be < 1")
        if self.kind is CorpusKind.text_files and not self.path:
            raise ConfigError("dataset.path must name a file, folder or glob for dataset kind text_files")
        if self.kind is CorpusKind.hf_dataset and not self.hf_name:
            raise ConfigError("dataset.hf_name must name a hub dataset or local folder for kind hf_dataset")
        if self.kind is CorpusKind.pinned and self.bundle not in pinned_bundles():
            raise ConfigError(
                f"dataset.bundle={self.bundle!r} is not a pinned bundle; there are: "
                + ", ".join(pinned_bundles())
            )


@dataclass(frozen=True)
class Document:
    id: str
    text: str


TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".tex", ".html", ".json", ".csv")


def _pydoc_topics() -> list[Document]:
    from pydoc_data.topics import topics

    return [Document(k, topics[k]) for k in sorted(topics)]


def _python_stdlib() -> list[Document]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("site-packages/", "dist-packages/")):
            continue
        try:
            docs.append(Document(rel, path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    return docs


MAN_ROOT = "/usr/share/man"
_TROFF_ESCAPES = re.compile(
    r"\\(f[BIRP]|f\[[^]]*\]|s[-+]?\d|[&|^/,:%]|\*\(..|\*\[[^]]*\]|\*.|\(..|\[[^]]*\]|e|-|\s)"
)
_ESCAPE_TEXT = {
    "-": "-",
    "e": "\\",
    "(em": "--",
    "(en": "-",
    "(bu": "*",
    "(aq": "'",
    "(dq": '"',
    "(lq": '"',
    "(rq": '"',
}
_KEEP_MACROS = {
    ".SH",
    ".SS",
    ".B",
    ".I",
    ".BR",
    ".BI",
    ".IB",
    ".IR",
    ".RB",
    ".RI",
    ".TP",
    ".IP",
    ".Nm",
    ".Nd",
}


def troff_to_text(source: str) -> str:
    """The running text of a man page: macro lines dropped (their arguments kept for headings and font
    macros), escapes replaced or removed, comments removed."""
    lines = []
    for line in source.splitlines():
        if line.startswith(('.\\"', "'\\\"", '\\"')):
            continue
        if line.startswith((".", "'")):
            macro, _, args = line.partition(" ")
            if macro not in _KEEP_MACROS or not args.strip():
                continue
            line = args.replace('"', "")
        lines.append(_TROFF_ESCAPES.sub(lambda m: _ESCAPE_TEXT.get(m.group(1), ""), line))
    return "\n".join(lines).strip() + "\n"


MAN_FORMAT = 1  # bump when troff_to_text's output changes (part of the text cache's key)


def _man_pages(root: str = MAN_ROOT, cache: Path | None = None) -> list[Document]:
    """The English manual pages installed on this machine (man1 .. man9, gzipped troff), as text. With
    `cache`, the texts are kept in cache/man_pages-<key>.parquet, keyed by every page's path, size and
    modification time (parsing 22k pages takes ~20 s; a run reads them back in about 1 s)."""
    # (a link whose target is gone - an alternative whose page an install left out - is no page)
    files = sorted(f for f in glob.glob(os.path.join(root, "man[1-9]*", "*.gz")) if os.path.exists(f))
    if not files:
        raise DataError(
            f"dataset kind man_pages: no manual pages under {root}/man*/ (install man-db/manpages)"
        )
    if cache is None:
        return _parse_man_pages(root, files)
    import pandas as pd

    from evictlab.store import stable_hash, write_atomic

    stats = [(os.path.relpath(f, root), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
    path = (
        Path(cache) / f"man_pages-{stable_hash({'root': root, 'files': stats, 'format': MAN_FORMAT})}.parquet"
    )
    try:
        frame = pd.read_parquet(path)
        return [Document(i, t) for i, t in zip(frame["id"], frame["text"], strict=True)]
    except (OSError, ValueError, KeyError):  # absent or unreadable: parsed (again)
        pass
    docs = _parse_man_pages(root, files)
    frame = pd.DataFrame({"id": [d.id for d in docs], "text": [d.text for d in docs]})
    write_atomic(path, lambda p: frame.to_parquet(p, index=False))
    return docs


def _parse_man_pages(root: str, files: list[str]) -> list[Document]:
    docs = []
    for f in files:
        try:
            with gzip.open(f, "rt", encoding="utf-8", errors="replace") as fh:
                source = fh.read()
        except (OSError, EOFError):
            continue
        if source.startswith(".so "):  # a link to another page
            continue
        docs.append(Document(os.path.relpath(f, root), troff_to_text(source)))
    return docs


PINNED_ROOT = Path(__file__).parent / "pinned"
MANIFEST, TEXTS = "manifest.csv", "texts.jsonl.xz"


def pinned_bundles() -> list[str]:
    return sorted(p.parent.name for p in PINNED_ROOT.glob(f"*/{MANIFEST}"))


def read_manifest(bundle: str) -> list[dict[str, str]]:
    """A pinned bundle's manifest: one row per document (id, subset, package, version, license,
    source_sha256, text_sha256, chars), in the corpus order."""
    with open(PINNED_ROOT / bundle / MANIFEST, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _pinned(cfg: DatasetConfig) -> list[Document]:
    """The documents of a committed bundle (of `cfg.subset` when set), each checked against the sha256 its
    manifest records: a changed or damaged bundle fails here, never streams other text."""
    rows = read_manifest(cfg.bundle or "")
    subsets = sorted({r["subset"] for r in rows})
    if cfg.subset is not None and cfg.subset not in subsets:
        raise ConfigError(f"dataset.subset={cfg.subset!r}: bundle {cfg.bundle!r} has {', '.join(subsets)}")
    with lzma.open(PINNED_ROOT / (cfg.bundle or "") / TEXTS, "rt", encoding="utf-8") as f:
        texts = {d["id"]: d["text"] for d in map(json.loads, f)}
    docs = []
    for r in rows:
        if cfg.subset is not None and r["subset"] != cfg.subset:
            continue
        text = texts.get(r["id"])
        if text is None or hashlib.sha256(text.encode("utf-8")).hexdigest() != r["text_sha256"]:
            raise DataError(
                f"pinned bundle {cfg.bundle!r}: document {r['id']!r} is "
                f"{'missing from' if text is None else 'not the text its manifest names in'} {TEXTS}"
            )
        docs.append(Document(r["id"], text))
    return docs


def _text_files(cfg: DatasetConfig) -> list[Document]:
    spec = os.path.expanduser(cfg.path or "")
    p = Path(spec)
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
    else:
        files = sorted(Path(f) for f in glob.glob(spec, recursive=True) if Path(f).is_file())
        if not files:
            raise DataError(f"dataset.path={cfg.path!r}: no such file, folder or glob match")
    docs, bad, total, worst = [], 0, 0, []
    for f in files:
        raw = f.read_bytes()
        text, n_bad = _decode(raw)
        bad, total = bad + n_bad, total + len(raw)
        if n_bad:
            worst.append((n_bad, f.as_posix()))
        parts = text.split(cfg.doc_separator) if cfg.doc_separator else [text]
        docs += [Document(f"{f.as_posix()}#{i}", t) for i, t in enumerate(parts) if t.strip()]
    if bad:
        names = ", ".join(name for _, name in sorted(worst, reverse=True)[:3])
        what = f"{bad:,} of {total:,} bytes are not UTF-8 text (binary?) in {len(worst)} files ({names})"
        if bad > MAX_BAD_BYTES * total:
            raise DataError(f"dataset.path={cfg.path!r}: {what}; over {MAX_BAD_BYTES:.0%}, so not used")
        log.warning("dataset.path=%r: %s; each was replaced by U+FFFD", cfg.path, what)
    if not docs:
        raise DataError(f"dataset.path={cfg.path!r}: the text is empty")
    return docs


MAX_BAD_BYTES = 0.01  # share of a text_files corpus that may be undecodable (replaced) before it is refused
_UNDECODABLE = re.compile("[\udc80-\udcff\x00]")  # surrogate-escaped bad bytes, and NUL (binary files)


def _decode(raw: bytes) -> tuple[str, int]:
    """UTF-8 text of a file with each undecodable byte (and NUL) replaced by U+FFFD, and how many were."""
    text, n = _UNDECODABLE.subn("\ufffd", raw.decode("utf-8", errors="surrogateescape"))
    return text, n


def _hf_dataset(cfg: DatasetConfig) -> list[Document]:
    import datasets

    name = cfg.hf_name or ""
    try:
        if Path(name).is_dir() and (Path(name) / "dataset_info.json").exists():
            ds = datasets.load_from_disk(name)
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[cfg.hf_split]
        else:
            ds = datasets.load_dataset(name, cfg.hf_config, split=cfg.hf_split, data_files=cfg.data_files)
    except Exception as e:  # noqa: BLE001 - every failure mode (offline, 404, bad split) gets one line
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(
            f"dataset.hf_name={name!r}: could not load the Hugging Face dataset ({msg}). Offline? "
            "Point dataset.hf_name at a local folder (datasets' save_to_disk) or use dataset=text_files."
        ) from None
    if cfg.text_field not in ds.column_names:
        raise DataError(
            f"dataset.text_field={cfg.text_field!r} is not a column of {name!r}: {ds.column_names}"
        )
    return [Document(f"{cfg.hf_split}/{i}", t) for i, t in enumerate(ds[cfg.text_field]) if t]


def load_documents(cfg: DatasetConfig, cache: Path | None = None) -> list[Document]:
    """All documents of the corpus, in a fixed order, after the size cap and the length filter. `cache`:
    a folder where corpora that are slow to read (man_pages) keep what they read."""
    loaders = {
        CorpusKind.pydoc_topics: lambda: _pydoc_topics(),
        CorpusKind.python_stdlib: lambda: _python_stdlib(),
        CorpusKind.text_files: lambda: _text_files(cfg),
        CorpusKind.hf_dataset: lambda: _hf_dataset(cfg),
        CorpusKind.man_pages: lambda: _man_pages(cache=cache),
        CorpusKind.pinned: lambda: _pinned(cfg),
    }
    docs = [d for d in loaders[cfg.kind]() if len(d.text) >= cfg.min_doc_chars]
    if cfg.exclude:
        kept = [d for d in docs if not any(fnmatch.fnmatchcase(d.id, p) for p in cfg.exclude)]
        if not kept:
            raise DataError(f"dataset.exclude={list(cfg.exclude)} leaves none of the {len(docs)} documents")
        log.info("dataset.exclude: %d of %d documents dropped", len(docs) - len(kept), len(docs))
        docs = kept
    if cfg.max_bytes:
        kept, total = [], 0
        for d in docs:
            n = len(d.text.encode("utf-8"))
            if total + n > cfg.max_bytes and kept:
                break
            kept.append(d)
            total += n
        docs = kept
    return docs


def content_hash(docs: list[Document]) -> str:
    h = hashlib.sha256()
    for d in docs:
        for part in (d.id, d.text):
            b = part.encode("utf-8")
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
    return h.hexdigest()[:16]


SPLITS = ("train", "val", "test")


def split_documents(docs: list[Document], cfg: DatasetConfig) -> dict[str, list[Document]]:
    """Deterministic split by document: order by a seeded hash of the id, cut by the fractions.

    Each split keeps the corpus order; the same ids and seed give the same split on every machine. A pinned
    corpus is held out whole: all its documents are the test split.
    """
    if cfg.kind is CorpusKind.pinned:
        return {"train": [], "val": [], "test": list(docs)}
    n = len(docs)
    n_val = max(1, round(n * cfg.val_fraction))
    n_test = max(1, round(n * cfg.test_fraction))
    if n - n_val - n_test < 1:
        raise DataError(
            f"dataset {cfg.name!r} has {n} document(s); a train/val/test split needs at least 3 "
            "(for one long text file set dataset.doc_separator)"
        )
    rank = sorted(range(n), key=lambda i: hashlib.sha256(f"{cfg.split_seed}:{docs[i].id}".encode()).digest())
    val, test = set(rank[:n_val]), set(rank[n_val : n_val + n_test])
    out: dict[str, list[Document]] = {s: [] for s in SPLITS}
    for i, d in enumerate(docs):
        out["val" if i in val else "test" if i in test else "train"].append(d)
    return out
