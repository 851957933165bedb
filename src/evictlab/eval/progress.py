"""How far a run's streams have got: one tqdm bar over its token-steps (`eval.progress`), and every few
minutes a log line with the rate and the streaming time left, which is what a Hydra job's log file and a
SLURM job's output show while a long run streams (a run of 4 x 32,768 tokens on the blocked path takes
most of an hour on 2 cores).

    progress = StreamProgress(total=N * n, desc="h2o b=1024", bar=spec.progress)
    stream(..., tick=progress)        # each path calls tick(token-steps) after every block (or token)
    progress.close()
"""

from __future__ import annotations

import logging
import sys
import time

from tqdm.auto import tqdm

log = logging.getLogger(__name__)

LOG_EVERY_S = 300.0  # seconds between log lines


def duration(seconds: float) -> str:
    """'42 s', '12.5 min', '3.2 h'."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def log_to_stderr(tag: str | None = None) -> logging.Handler:
    """evictlab's INFO lines (a run's progress every LOG_EVERY_S) on stderr with the time and `tag` (a noise
    pass's name: `--jobs 2` interleaves two passes' lines), where no Hydra job configured logging: `paper
    verify` and `paper noise`, whose passes run for hours, in the calling process and in each noise pass's
    worker. One handler per process; a later call changes its tag."""
    out = logging.getLogger("evictlab")
    handler = next((h for h in out.handlers if getattr(h, "evictlab_progress", False)), None)
    if handler is None:
        handler = logging.StreamHandler()
        handler.evictlab_progress = True  # type: ignore[attr-defined]
        out.addHandler(handler)
        out.setLevel(logging.INFO)
    where = f"[{tag}] " if tag else ""
    handler.setStream(sys.stderr)  # (the current one: pytest's capture replaces it)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {where}%(message)s", "%H:%M:%S"))
    return handler


class StreamProgress:
    """Counts token-steps (one token of one stream through every layer) as the paths report them.
    The rate counts streaming time only: the clock stops between `pause()` and the next tick (a batch's
    full-cache reference is computed in between)."""

    def __init__(self, total: int, desc: str, bar: bool = False, log_every_s: float | None = None):
        self.total, self.desc = total, desc
        self.log_every_s = LOG_EVERY_S if log_every_s is None else log_every_s
        self.bar = tqdm(total=total, desc=desc, unit="tok", disable=not bar, mininterval=2, smoothing=0.05)
        self.done = 0
        self.streaming_s = 0.0  # streaming time before the current stretch
        self.since: float | None = None  # start of the current stretch of streaming (None: paused)
        self.last_log = time.perf_counter()

    def resume(self) -> None:
        """Streaming (re)starts now."""
        self.since = time.perf_counter()

    def pause(self) -> None:
        if self.since is not None:
            self.streaming_s += time.perf_counter() - self.since
            self.since = None

    def __call__(self, steps: int) -> None:
        """`steps` more token-steps are done."""
        now = time.perf_counter()
        if self.since is None:
            self.since = now
        self.done += steps
        self.bar.update(steps)
        if now - self.last_log >= self.log_every_s:
            self.last_log = now
            log.info(self.line(now))

    def line(self, now: float | None = None) -> str:
        now = time.perf_counter() if now is None else now
        seconds = self.streaming_s + (now - self.since if self.since is not None else 0.0)
        rate = self.done / seconds if seconds > 0 else float("nan")
        left = (self.total - self.done) / rate if rate > 0 else float("nan")
        eta = duration(left) if left == left else "?"
        return (
            f"{self.desc}: {self.done:,}/{self.total:,} token-steps ({self.done / max(1, self.total):.0%}), "
            f"{rate:,.1f}/s, streaming ~{eta} left"
        )

    def close(self) -> None:
        self.pause()
        self.bar.close()
