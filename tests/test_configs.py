"""Config tests (lightning-hydra-template style): every group option and every point of every experiment's
sweep grid composes and validates; the YAMLs name what differs from the schemas and restate nothing; the
strategy options are exactly the policy registry."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Glob
from omegaconf import OmegaConf

from evictlab.cache import POLICIES
from evictlab.config import CONF_DIR, KEYLESS, Config, EvalConfig, TrainConfig, key_dict, to_objects
from evictlab.errors import ConfigError
from evictlab.models.gpt import GPTConfig

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
GROUP_SCHEMAS = {"model": GPTConfig, "train": TrainConfig, "eval": EvalConfig}


def _yaml(path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


def sweep_params(experiment: str) -> dict:
    """The experiment's hydra.sweeper.params, those of the experiments it lists in its defaults first (an
    experiment may extend another: subject_ablations_threads2 is subject_ablations at 2 threads)."""
    conf = _yaml(CONF_DIR / "experiment" / f"{experiment}.yaml")
    params: dict = {}
    for entry in conf.get("defaults", []):
        if isinstance(entry, str) and entry != "_self_":  # a sibling experiment, not a group override
            params |= sweep_params(entry)
    return params | conf.get("hydra", {}).get("sweeper", {}).get("params", {})


def grid(experiment: str) -> list[list[str]]:
    """Every point of the experiment's sweep grid as a list of overrides (Hydra's own sweep syntax)."""
    params = sweep_params(experiment)
    parser = OverridesParser.create()
    axes = []
    for key, value in params.items():
        (override,) = parser.parse_overrides([f"{key}={value}"])
        if isinstance(override.value(), Glob):  # glob(*) over a config group's options
            values = override.value().filter(sorted(p.stem for p in (CONF_DIR / key).glob("*.yaml")))
        elif override.is_sweep_override():
            values = list(override.sweep_string_iterator())
        else:
            values = [str(value)]
        axes.append([f"{key}={v}" for v in values])
    return [list(point) for point in itertools.product(*axes)]


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_point_of_every_experiment_grid_composes(experiment: str):
    """Each grid point composes and validates (or, in a grid with skip_invalid, fails validation in one
    line). Hydra composes each distinct choice of config-group options once; the value overrides of
    the point (seed, eval.position_mode, ...) are then applied to a copy, as the command line would."""
    points = grid(experiment)
    assert points, f"experiment {experiment} has no sweep grid"
    groups = {d.name for d in CONF_DIR.iterdir() if d.is_dir()}
    composed, skipped = {}, 0
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for point in points:
            choice = tuple(o for o in point if o.split("=")[0] in groups)
            if choice not in composed:
                composed[choice] = compose("config", overrides=[f"+experiment={experiment}", *choice])
            dcfg = composed[choice].copy()
            for o in point:
                key, value = o.split("=", 1)
                if key not in groups:
                    OmegaConf.update(dcfg, key, yaml.safe_load(value), merge=False)
            try:
                to_objects(dcfg)
            except ConfigError:
                if not dcfg.get("skip_invalid"):  # only grids that declare it may hold invalid points
                    raise
                skipped += 1
    assert skipped < len(points)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_base_config_validates(experiment: str):
    """`make sweep EXP=...` first trains from the experiment's config without its sweep overrides: that
    config must be valid on its own (long_stream_1m once failed here: its default full cache could not
    run 2^20 tokens)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        to_objects(compose("config", overrides=[f"+experiment={experiment}"]))


def test_the_grid_reader_expands_a_sweep():
    points = grid("default")  # strategy: glob(*,exclude=bos_ablation) = every policy but the ablation
    policies = [n for n, cls in POLICIES.items() if not cls.ablation]
    assert len(points) == len(policies) * 3 * 2 and ["strategy=full", "budget=b32", "seed=0"] in points
    assert not any("strategy=bos_ablation" in p for p in points)
    assert {p[0] for p in grid("position_modes")} == {
        f"strategy={n}" for n in ("window", "streaming_llm", "h2o", "tova", "l2norm", "random")
    }


@pytest.mark.parametrize(
    "group, option",
    [
        (d.name, p.stem)
        for d in sorted(CONF_DIR.iterdir())
        if d.is_dir() and d.name not in ("experiment", "hydra", "local")
        for p in sorted(d.glob("*.yaml"))
    ],
)
def test_every_group_option_composes(group: str, option: str):
    required = {
        ("model", "hf"): "model.name_or_path=some/checkpoint",
        ("dataset", "text_files"): "dataset.path=docs",
    }
    overrides = [f"{group}={option}", *([required[group, option]] if (group, option) in required else [])]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = to_objects(compose("config", overrides=overrides))
    assert getattr(cfg, group) is not None


def test_strategy_options_are_the_policy_registry():
    files = {p.stem: _yaml(p) for p in (CONF_DIR / "strategy").glob("*.yaml")}
    assert set(files) == set(POLICIES)
    for name, node in files.items():
        # each names its policy (whose dataclass holds every default) and overrides only what it wants
        assert node["defaults"] == [{"/policy@_here_": name}] and set(node) <= {"defaults", "params"}, name
        fields = {f.name: f.default for f in dataclasses.fields(POLICIES[name])}
        for key, value in (node.get("params") or {}).items():
            assert key in fields, f"conf/strategy/{name}.yaml: {key} is not a parameter of {name}"
            assert value != fields[key], f"conf/strategy/{name}.yaml restates the default {key}={value}"
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            strategy = to_objects(compose("config", overrides=[f"strategy={name}"])).strategy
        assert strategy.name == name and set(strategy.params) == set(fields)


def test_every_policy_parameter_can_be_set_from_the_command_line():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = to_objects(compose("config", overrides=["strategy=streaming_llm", "strategy.params.n_sink=2"]))
        assert cfg.strategy.build().n_sink == 2
        with pytest.raises(ConfigError, match="heavy"):
            to_objects(compose("config", overrides=["strategy=h2o", "+strategy.params.heavy=3"]))


def test_a_default_written_out_or_left_to_the_class_gives_one_run_key():
    from evictlab.run import run_key

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        a = to_objects(compose("config", overrides=["strategy=streaming_llm"]))
        b = to_objects(compose("config", overrides=["strategy=streaming_llm", "strategy.params.n_sink=4"]))
        c = to_objects(compose("config", overrides=["strategy=streaming_llm", "strategy.params.n_sink=2"]))
    assert run_key(a) == run_key(b) != run_key(c)
    a.strategy.params = {}  # programmatic: the class default fills in
    assert run_key(a) == run_key(b)


def test_a_parameter_added_later_keeps_the_run_keys_made_before_it():
    """streaming_llm.first_sink and recompute_window.n_sink came with issue 27: at their defaults they are in
    no run key (finished runs stay done, snapshots keep their keys); set, they are."""
    from evictlab.config import StrategyConfig

    assert StrategyConfig("streaming_llm").keyed() == {"name": "streaming_llm", "params": {"n_sink": 4}}
    assert StrategyConfig("recompute_window").keyed() == {"name": "recompute_window", "params": {}}
    text = StrategyConfig("streaming_llm", {"n_sink": 1, "first_sink": 1}).keyed()["params"]
    assert text == {"n_sink": 1, "first_sink": 1}
    assert StrategyConfig("recompute_window", {"n_sink": 1}).keyed()["params"] == {"n_sink": 1}
    assert StrategyConfig("h2o").keyed()["params"] == {"recent_fraction": 0.5}  # defaults keyed as before


@pytest.mark.parametrize("group", sorted(GROUP_SCHEMAS))
def test_group_yamls_restate_no_schema_default(group: str):
    defaults = {f.name: f.default for f in dataclasses.fields(GROUP_SCHEMAS[group])}
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        node = {k: v for k, v in _yaml(path).items() if k not in ("defaults", "name")}
        same = [k for k, v in node.items() if k in defaults and v == defaults[k]]
        assert not same, f"{path.name} restates schema defaults: {same}"


def test_settings_that_cannot_change_results_are_out_of_every_key():
    cfg = to_objects_default()
    keyless = {
        f"{node}.{f.name}" if node else f.name
        for node, obj in (("", cfg), ("train", cfg.train), ("eval", cfg.eval))
        for f in dataclasses.fields(obj)
        if f.metadata == KEYLESS
    }
    assert {"logger", "paths", "group", "eval.threads", "eval.batch_size"} <= keyless
    d = key_dict(cfg)
    for name in keyless:
        node, _, leaf = name.rpartition(".")
        assert leaf not in (d[node] if node else d), name
    weights = key_dict(cfg.train, weights=True)
    assert "eval_interval" not in weights and "eval_interval" in d["train"] and "steps" in weights
    assert "threads" in weights  # training's thread count changes the weights' bits (tests/test_train.py)


def to_objects_default() -> Config:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_objects(compose("config"))


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["eval.full_max_len=0"], "eval.full_max_len=0 must be >= 1"),
        (["eval.block=-5"], "eval.block=-5 must be >= 1"),
        (
            ["strategy=full", "eval.stream_len=5000"],
            "strategy=full keeps every entry.*eval.full_max_len=4096",
        ),
        (["strategy=oracle", "eval.stream_len=300", "eval.full_max_len=200"], "future.*full_max_len=200"),
    ],
)
def test_long_stream_settings_fail_before_work(overrides, match):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        with pytest.raises(ConfigError, match=match):
            to_objects(compose("config", overrides=overrides))
        # a bounded policy past the cap is fine: the reference covers the first full_max_len predictions
        to_objects(compose("config", overrides=["strategy=window", "eval.stream_len=5000"]))
