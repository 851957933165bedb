"""Keys, atomic writes and provenance: the small pieces every cache and result file relies on."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
UMASK = os.umask(0o022)  # read once (the only way to read it is to set it), then put back
os.umask(UMASK)


def outputs_dir(path: str | os.PathLike | None = None) -> Path:
    """Where evictlab writes: the argument, else $EVICTLAB_OUTPUTS, else ./outputs."""
    return Path(path or os.environ.get("EVICTLAB_OUTPUTS") or "outputs")


def to_jsonable(obj: Any) -> Any:
    """Dataclasses, enums and paths to plain JSON values (dict keys sorted later by json.dumps)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def stable_hash(obj: Any, n: int = 16) -> str:
    """Hex digest of a canonical JSON encoding: equal configs give equal keys on every machine."""
    blob = json.dumps(to_jsonable(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:n]


def tokens_sha256(tokens) -> str:
    """sha256 of a token tensor's shape and int64 values: which text a run measured (the same settings can
    select other text when the corpus changes under them, e.g. a package installs manual pages)."""
    import numpy as np

    arr = np.ascontiguousarray(tokens.detach().cpu().numpy().astype(np.int64))
    h = hashlib.sha256(json.dumps(list(arr.shape)).encode())
    h.update(arr.tobytes())
    return h.hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_lock(path: str | os.PathLike):
    """An exclusive lock (filelock.FileLock) guarding `path`, held in an empty file in a hidden `.locks/`
    folder beside it, so run and cache folders list only results. The lock file stays after release:
    removing a Unix lock file while a process waits on it lets two processes hold "the" lock at once
    (filelock keeps it for that reason), so never delete `.locks/` while evictlab is running."""
    from filelock import FileLock

    path = Path(path)
    locks = path.parent / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    return FileLock(str(locks / f"{path.name}.lock"))


@contextmanager
def atomic_path(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside `dest`; on success fsync it, give it the mode a plain `open` would (0666
    less the umask: mkstemp's 0600 would hide results from the rest of a lab) and rename it over `dest`."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~UMASK)
        os.replace(tmp, dest)
    except Exception as e:
        raise_if_disk_full(e, dest)
        raise
    finally:
        tmp.unlink(missing_ok=True)


def raise_if_disk_full(e: BaseException, dest: str | os.PathLike) -> None:
    """Turn a full disk while writing `dest` into one DiskFullError line that says what to do."""
    from evictlab.errors import DiskFullError, is_disk_full

    if is_disk_full(e):
        free = shutil.disk_usage(Path(dest).parent).free if Path(dest).parent.exists() else 0
        raise DiskFullError(
            f"no space left on the device while writing {dest} ({free / 2**20:.0f} MiB free there): nothing "
            "half-written was kept; free space and run again"
        ) from e


def write_atomic(dest: str | os.PathLike, write: Callable[[Path], None]) -> None:
    with atomic_path(dest) as tmp:
        write(tmp)


def write_json(dest: str | os.PathLike, obj: Any) -> None:
    text = json.dumps(to_jsonable(obj), indent=2, sort_keys=True) + "\n"
    write_atomic(dest, lambda p: p.write_text(text))


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text())


def git_info(repo: Path = REPO_ROOT) -> dict[str, Any]:
    """Commit and dirty flag of the checkout evictlab runs from (None where it is not a git checkout)."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


PACKAGES = ("evictlab", "torch", "numpy", "hydra-core", "tokenizers", "safetensors", "wandb", "pandas")


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out
