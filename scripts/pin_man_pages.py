"""Make the pinned manual-page corpus (dataset=man_pinned / man_pinned_long) from this machine's pages.

    .venv/bin/python scripts/pin_man_pages.py [--out src/evictlab/data/pinned/man_pages]

How the committed bundle was made, kept so that the choice can be read and re-made: every English page
under /usr/share/man/man[1-9] that a Debian package installs (dpkg's file lists name it) and whose package's
copyright file is machine-readable (DEP-5: the `Files: *` paragraph's licence is recorded), as text
(evictlab.data.corpora.troff_to_text), generated references (gcloud) left out, identical texts kept once
(the alphabetically first id). Two subsets:

- `long`: one page per family from LONG (the longest page of 10 unrelated families; each holds more
  than 32,768 SmolLM2 tokens), for StreamingLLM-style long streams of single documents;
- `pages`: N_PAGES pages drawn with seed SEED (ranked by sha256 of "SEED:id") from those of 6,000 - 60,000
  characters (about 1,600 - 16,000 tokens) outside `long`.

Writes <out>/texts.jsonl.xz (one {"id", "text"} per line, manifest order) and <out>/manifest.csv (id,
subset, package, version, license, source_sha256 of the page's troff, text_sha256, chars). On another
machine the same package versions give the same bytes; the loader only reads the bundle.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import json
import lzma
import os
import re
import subprocess
from pathlib import Path

import pandas as pd

from evictlab.data.corpora import MAN_ROOT, troff_to_text

SEED = 0
N_PAGES = 48
MIN_CHARS, MAX_CHARS = 6_000, 60_000
LONG = (  # the longest page of each family (cmake, systemd, git ... one each) with >= 32,768 tokens
    "man7/cmake-modules.7.gz",
    "man1/bash.1.gz",
    "man3/libpng.3.gz",
    "man1/git-config.1.gz",
    "man1/curl.1.gz",
    "man5/proc.5.gz",
    "man5/systemd.exec.5.gz",
    "man7/bpf-helpers.7.gz",
    "man1/gpg.1.gz",
    "man8/lsof.8.gz",
)
GENERATED = ("gcloud",)  # machine-generated command references: about half of a cloud SDK machine's bytes


def sha256(text: str | bytes) -> str:
    return hashlib.sha256(text.encode("utf-8") if isinstance(text, str) else text).hexdigest()


def owners() -> dict[str, str]:
    """Installed path -> Debian package, from dpkg's file lists."""
    out = {}
    for lst in glob.glob("/var/lib/dpkg/info/*.list"):
        pkg = Path(lst).stem.split(":")[0]
        for line in Path(lst).read_text(errors="replace").splitlines():
            out[line] = pkg
    return out


def versions() -> dict[str, str]:
    text = subprocess.run(
        ["dpkg-query", "-W", "-f", "${Package} ${Version}\n"], capture_output=True, text=True, check=True
    ).stdout
    return dict(line.split(" ", 1) for line in text.splitlines() if " " in line)


def dep5_license(package: str) -> str | None:
    """The licence of a package's `Files: *` paragraph, where its copyright file is DEP-5."""
    path = Path("/usr/share/doc") / package / "copyright"
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    if not text.startswith("Format:"):
        return None
    for para in re.split(r"\n\s*\n", text):
        if re.search(r"^Files:\s*\*\s*$", para, re.M):
            m = re.search(r"^License:\s*(.+)$", para, re.M)
            return m.group(1).strip() if m else None
    return None


def pages() -> pd.DataFrame:
    who, ver = owners(), versions()
    rows, seen = [], set()
    for f in sorted(glob.glob(os.path.join(MAN_ROOT, "man[1-9]*", "*.gz"))):
        rel = os.path.relpath(f, MAN_ROOT)
        if any(g in rel for g in GENERATED) or not os.path.exists(f):
            continue
        real = os.path.realpath(f)
        pkg = who.get(f) or who.get(real)
        if pkg is None:
            continue
        with gzip.open(real, "rb") as fh:
            source = fh.read()
        if source.startswith(b".so "):
            continue
        text = troff_to_text(source.decode("utf-8", errors="replace"))
        digest = sha256(text)
        if digest in seen or len(text) < 200:
            continue
        seen.add(digest)
        license = dep5_license(pkg)
        if license is None:
            continue
        rows.append(
            {"id": rel, "package": pkg, "version": ver.get(pkg, ""), "license": license}
            | {"source_sha256": sha256(source), "text_sha256": digest, "chars": len(text), "text": text}
        )
    return pd.DataFrame(rows)


def choose(frame: pd.DataFrame) -> pd.DataFrame:
    missing = sorted(set(LONG) - set(frame["id"]))
    if missing:
        raise SystemExit(f"long pages not installed (or not DEP-5): {missing}")
    long = frame.set_index("id").loc[list(LONG)].reset_index().assign(subset="long")
    rest = frame[~frame["id"].isin(LONG) & frame["chars"].between(MIN_CHARS, MAX_CHARS)]
    rank = rest["id"].map(lambda i: sha256(f"{SEED}:{i}"))
    chosen = rest.assign(rank=rank).sort_values("rank").head(N_PAGES).sort_values("id").drop(columns="rank")
    return pd.concat([long, chosen.assign(subset="pages")], ignore_index=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("src/evictlab/data/pinned/man_pages"))
    args = ap.parse_args()
    frame = choose(pages())
    args.out.mkdir(parents=True, exist_ok=True)
    with lzma.open(args.out / "texts.jsonl.xz", "wt", encoding="utf-8", preset=9 | lzma.PRESET_EXTREME) as f:
        for i, t in zip(frame["id"], frame["text"], strict=True):
            f.write(json.dumps({"id": i, "text": t}, ensure_ascii=False) + "\n")
    cols = ["id", "subset", "package", "version", "license", "source_sha256", "text_sha256", "chars"]
    frame[cols].to_csv(args.out / "manifest.csv", index=False)
    print(frame.groupby("subset")["chars"].agg(["count", "sum"]).to_string())
    print(f"{args.out}: {sum(p.stat().st_size for p in args.out.iterdir()):,} bytes")


if __name__ == "__main__":
    main()
