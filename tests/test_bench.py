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
