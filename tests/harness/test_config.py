"""Every config group option composes and validates; bad input fails before any model loads
with a message naming the key, the allowed values and the value given."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import harness.cli  # noqa: F401 -- registers the ConfigStore
from harness.cli import CONF_DIR
from harness.config import ConfigError, validate
from harness.report import Reporter
from harness.runner import JobContext, run_job
from tests.engine_loads import engine_loads

GROUPS = ("model", "placement", "cache", "experts", "prefetch", "workload", "hardware", "run", "engine")


def options(group: str) -> list[str]:
    try:
        stored = [n.removesuffix(".yaml") for n in ConfigStore.instance().list(group)]
    except OSError:  # a group that lives only in conf/
        stored = []
    on_disk = [p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml")]
    return sorted(set(stored) | set(on_disk))


def cfg_with(*overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.slow
def test_every_option_composes_and_validates(group):
    opts = options(group)
    assert opts, group
    for opt in opts:
        overrides = [f"{group}={opt}"]
        if group == "model":
            if opt == "hf":
                continue  # needs model.path; covered below
            # fits every preset's max_position_embeddings and top_k
            overrides += ["workload.context_tokens=3000", "cache.capacity=auto"]
        spec = validate(cfg_with(*overrides))
        assert spec is not None


@pytest.mark.slow
def test_every_experiment_composes():
    exps = options("experiment")
    assert {"context_pressure", "placement_sweep", "engines"} <= set(exps)
    for exp in exps:
        cfg = cfg_with(f"experiment={exp}")
        validate(cfg)


def test_model_path(tiny_mixtral_dir):
    spec = validate(cfg_with("model=hf", f"model.path={tiny_mixtral_dir}", "workload.context_tokens=256"))
    assert spec.model_config.family == "mixtral" and spec.model_config.vocab_size == 128


def test_the_default_model_is_the_shipped_trained_checkpoint():
    """No override: the trained checkpoint shipped with moebench, by its directory, labelled by its name."""
    from engine.shipped import shipped_checkpoint
    spec = validate(cfg_with())
    assert spec.model.name == "tiny-moe-trained" and spec.model.path == str(shipped_checkpoint("tiny-moe-trained"))
    assert spec.model_label == "tiny-moe-trained" and spec.model_config.n_experts == 8
    assert validate(cfg_with("model=tiny-mixtral")).model.path is None      # presets keep their random weights


@pytest.mark.slow
def test_canonical_overrides():
    spec = validate(cfg_with("model=tiny-mixtral", "placement=fetch", "cache.capacity=4", "cache.policy=lfu",
                             "prefetch=none", "workload=coding_agent", "workload.context_tokens=4096",
                             "workload.gen_tokens=64", "workload.batch=2", "workload.ubatch=256", "run.repeats=3",
                             "run.warmup=1"))
    assert (spec.capacity, spec.policy, spec.workload.batch, spec.workload.ubatch) == (4, "lfu", 2, 256)
    assert validate(cfg_with("cache.capacity=auto")).capacity == "auto"


@pytest.mark.slow
def test_mistyped_key_hydra():
    with pytest.raises(ConfigCompositionException, match="capacty"):
        cfg_with("cache.capacty=3")


@pytest.mark.slow
def test_mistyped_key_sneaked_in_with_plus():
    try:
        cfg = cfg_with("+cache.capacty=3")
    except ConfigCompositionException as exc:   # a Hydra that refuses it is fine too
        assert "capacty" in str(exc)
        return
    with pytest.raises(ConfigError, match=r"unknown config key 'cache.capacty'; allowed keys in 'cache'.*capacity.*policy"):
        validate(cfg)


def test_unknown_top_level_key_sneaked_in():
    cfg = cfg_with("+bogus=1")
    with pytest.raises(ConfigError, match="unknown config key 'bogus'"):
        validate(cfg)


def test_wrong_type():
    with pytest.raises(ConfigCompositionException, match="workload.batch"):
        cfg_with("workload.batch=abc")


def test_unknown_option_lists_available():
    with pytest.raises(ConfigCompositionException, match=r"(?s)placement/fetcher.*Available options in 'placement'.*fetch"):
        cfg_with("placement=fetcher")


@pytest.mark.parametrize("value,msg", [("lfuu", r"cache.policy: allowed \['belady', 'fifo', 'lfru', 'lfu', 'lru', 'static'\], got 'lfuu'")])
def test_unknown_policy(value, msg):
    with pytest.raises(ConfigError, match=msg):
        validate(cfg_with(f"cache.policy={value}"))


@pytest.mark.parametrize("capacity", ["1", "9", "many"])
def test_capacity_out_of_range(capacity):
    with pytest.raises(ConfigError, match=r"cache.capacity: allowed an int in \[top_k=2, n_experts=8\] or 'auto'"):
        validate(cfg_with(f"cache.capacity={capacity}"))


def test_no_capacity_is_4_slots_or_auto_where_a_token_routes_to_more():
    """A model routing each token to 8 experts cannot take the tiny models' 4 slots: a job that
    names no capacity gets auto there (and its rows say so), while a capacity given is checked."""
    from harness.factors import factors_of
    assert validate(cfg_with("placement=fetch")).capacity == 4
    cfg = cfg_with("model=deepseek-v3", "placement=fetch", "hardware.device_memory=80GiB")
    assert validate(cfg).capacity == "auto" and factors_of(cfg)["cache_capacity"] == "auto"
    assert factors_of(cfg_with("placement=fetch"))["cache_capacity"] == "4"
    with pytest.raises(ConfigError, match=r"cache.capacity: allowed an int in \[top_k=8, n_experts=256\]"):
        validate(cfg_with("model=deepseek-v3", "placement=fetch", "cache.capacity=4"))


@pytest.mark.slow
def test_context_longer_than_model_allows():
    with pytest.raises(ConfigError, match=r"workload.context_tokens: 9000 .* longer than the model allows "
                                          r"\(max_position_embeddings 8192"):
        validate(cfg_with("workload.context_tokens=9000"))


@pytest.mark.slow
def test_bad_input_fails_before_any_model_loads(tmp_path):
    with engine_loads() as loads:
        out = run_job(cfg_with("cache.capacity=1"), JobContext(tmp_path, "s", "j"), Reporter(quiet=True))
    rows, error = out.rows, out.error
    assert error and "cache.capacity" in error
    assert loads == []
    assert rows[0]["status"] == "failed" and "cache.capacity" in rows[0]["error"]
    assert OmegaConf.select(cfg_with(), "placement.name") == "fetch"
