"""The benchmark script runs end to end on a toy workload and writes every field (no timing asserts)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from evictlab.store import REPO_ROOT


def test_bench_writes_rows_with_ratios(tmp_path: Path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT / "benchmarks"))
    import bench_engine

    out = tmp_path / "bench.json"
    args = ["--docs", "2", "--length", "24", "--budget", "8", "--batch", "2", "--out", str(out)]
    report = bench_engine.main([*args, "--policies", "window,h2o,oracle,recompute_window"])
    rows = json.loads(out.read_text())["rows"]
    assert rows == json.loads(json.dumps(report["rows"]))
    assert [(r["policy"], r["position_mode"]) for r in rows] == [
        ("window", "original"), ("h2o", "original"), ("oracle", "original"), ("recompute_window", "original"),
        ("h2o", "cache"),
    ]  # fmt: skip
    paths = {r["policy"]: r["path"] for r in rows}
    assert paths == {"window": "parallel", "h2o": "loop", "oracle": "loop", "recompute_window": "recompute"}
    for r in rows:
        assert r["speedup"] == r["engine_tokens_per_s"] / r["reference_tokens_per_s"]
        assert 0 < r["floor_fraction"] and r["kv_bytes_T1024"] == r["kv_bytes_T8192"]
    assert "| window | original | parallel |" in bench_engine.markdown_table(report)
    sys.modules.pop("bench_engine", None)


def test_bench_long_writes_rows_with_ratios(tmp_path: Path, monkeypatch):
    """make bench-long's script on toy lengths: one row per (policy, length) from its own process, the
    ratios against the shortest length, the compile time apart (eager loop here: compiling takes ~30 s)."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "benchmarks"))
    import bench_long

    out = tmp_path / "long.json"
    args = ["--lengths", "48,96", "--policies", "window,h2o", "--budget", "8", "--full-length", "64"]
    report = bench_long.main([*args, "--no-compile", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["policy"], r["length"], r["path"]) for r in rows] == [
        ("window", 48, "parallel"), ("window", 96, "parallel"), ("h2o", 48, "loop"), ("h2o", 96, "loop"),
        ("full", 64, "parallel"),
    ]  # fmt: skip
    assert report["compile"] is False and all(r["compile_seconds"] == 0 for r in rows)
    for r in rows[:4]:
        assert r["peak_rss_bytes"] > 0 and r["token_steps_per_s"] > 0 and r["rss_ratio"] > 0
    assert rows[0]["rss_ratio"] == rows[0]["speed_ratio"] == 1.0
    assert "| h2o | 96 | loop |" in bench_long.markdown_table(report)
    sys.modules.pop("bench_long", None)
