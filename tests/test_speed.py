"""`make speed`: a snapshot's decode rates re-measured in one sitting (src/evictlab/speed.py)."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from evictlab import paper
from evictlab import speed as SP
from evictlab.errors import ConfigError


def test_with_speed_replaces_the_measured_runs_rates_and_says_where_they_come_from():
    runs = pd.DataFrame(
        {"run_key": ["a", "b", "c"], "decode_token_steps_per_s": [10.0, 20.0, math.nan]}
        | {"decode_token_steps_per_s_fused": [11.0, math.nan, math.nan]}
    )
    speed = pd.DataFrame(
        {"run_key": ["a", "b"], "decode_token_steps_per_s": [30.0, 40.0]}
        | {"decode_token_steps_per_s_fused": [33.0, math.nan], "fused_same_tokens": [1.0, math.nan]}
    )
    out = SP.with_speed(runs, speed)
    assert out["decode_token_steps_per_s"].tolist()[:2] == [30.0, 40.0]
    assert math.isnan(out["decode_token_steps_per_s"].iloc[2])  # not re-measured: as recorded
    assert out["decode_token_steps_per_s_fused"].iloc[0] == 33.0
    assert math.isnan(out["decode_token_steps_per_s_fused"].iloc[1])  # H2O-like: no fused rate
    assert out["decode_source"].tolist() == ["speed.csv", "speed.csv", "run"]
    assert runs["decode_token_steps_per_s"].iloc[0] == 10.0  # the input is not changed
    assert SP.with_speed(runs, None) is runs


def test_speed_re_times_every_writing_run_of_a_snapshot(session_outputs, tmp_path, monkeypatch, capsys):
    """Two generation runs (the full cache, H2O) aggregated into a snapshot: `paper speed` times both again
    in interleaved rounds into speed.csv (the fused kernel only for the policy that reads no weights, and it
    writes the same tokens), the tables then print those rates and say where they come from."""
    from evictlab import run as run_mod
    from evictlab import verify as V
    from evictlab.analysis.aggregate import aggregate
    from tests.test_pipeline import FAST, cfg_for

    sampled = []
    for strategy in ("full", "h2o"):
        over = [
            "group=speed_test",
            f"strategy={strategy}",
            "budget=b32",
            "eval.generate_tokens=8",
            "logger=none",
        ]
        cfg = cfg_for(session_outputs, *over)
        run_mod.run(cfg)
        label = f"{strategy} b32"
        sampled.append(
            V.Sampled(
                run_mod.run_key(cfg), label, [*FAST, f"paths.outputs={session_outputs}", *over], {}, None
            )
        )
    folder = tmp_path / "speed_test"
    aggregate([run_mod.run_dir(cfg).parent], folder / "snapshot")
    (folder / "figures.yaml").write_text("experiment: unused\nfigures: []\n")
    monkeypatch.setattr(V, "sample_runs", lambda results, experiment, every=False: sampled)
    monkeypatch.setattr(paper, "EXPERIMENTS", tmp_path)

    assert paper.main(["speed", "--only", "speed_test", "--rounds", "2", "--steps", "4"]) == 0
    speed = pd.read_csv(folder / SP.SPEED_FILE)
    assert speed["run"].tolist() == ["full b32", "h2o b32"]
    assert (speed[["batch", "prompt", "steps", "rounds"]].values == [2, 96 - 1 - 4, 4, 2]).all()
    assert (speed["decode_token_steps_per_s"] >= speed["decode_token_steps_per_s_median"]).all()
    assert (speed["decode_token_steps_per_s_median"] > 0).all()
    full, h2o = speed.iloc[0], speed.iloc[1]
    assert full["decode_token_steps_per_s_fused"] > 0 and full["fused_same_tokens"] == 1.0
    assert math.isnan(h2o["decode_token_steps_per_s_fused"])  # H2O needs the weights: no fused kernel
    assert len(speed["commit"].iloc[0]) == 40 and speed["measured_utc"].notna().all()

    tables = paper.load_snapshot(folder)
    runs = tables["runs"].set_index("run_key")
    for _, row in speed.iterrows():
        assert runs.loc[row["run_key"], "decode_token_steps_per_s"] == pytest.approx(
            row["decode_token_steps_per_s"]
        )
    lines = "\n".join(paper._decode_lines(tables, "original", "them"))
    assert "re-measured in one sitting (speed.csv" in lines and "best of 2 interleaved rounds" in lines
    assert f"{speed['decode_token_steps_per_s'].iloc[1]:.1f}" in lines

    capsys.readouterr()
    assert paper.main(["tables", "--only", "speed_test"]) == 0  # make tables reads speed.csv too
    assert "re-measured in one sitting (speed.csv" in capsys.readouterr().out
    fig = paper.F.draw("tradeoff", tables, mode="original")
    assert "re-measured in one sitting" in fig.axes[1].get_xlabel()

    with pytest.raises(ConfigError, match="leave no prompt"):
        SP.remeasure(folder, "unused", rounds=1, steps=95)
    assert paper.main(["speed"]) == 2 and "needs --only" in capsys.readouterr().err
    assert paper.main(["speed", "--only", "speed_test", "--rounds", "0"]) == 2
    assert "--rounds 0 must be >= 1" in capsys.readouterr().err


def test_speed_refuses_a_snapshot_that_wrote_nothing(tmp_path):
    from evictlab import results as R

    folder = tmp_path / "x"
    (folder / "snapshot").mkdir(parents=True)
    results = pd.DataFrame({"run_key": ["a"], "metric": ["ppl"], "value": [3.0]})
    results.to_parquet(R.table_path(folder / "snapshot", "results"), index=False)
    with pytest.raises(ConfigError, match="no run of its snapshot wrote tokens"):
        SP.settings(folder, "unused", 4)
