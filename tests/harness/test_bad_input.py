"""Bad input gets a clear error before any weight is read: the message names the key or file,
the value given and what is allowed; real broken files, no mocks."""
from __future__ import annotations

import io
import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from rich.console import Console

import harness.cli  # noqa: F401 -- registers the ConfigStore
from engine.registry import PLACEMENTS
from engine.trace import RoutingTrace, save_trace
from harness.cli import CONF_DIR
from harness.cli_args import hydra_args, split_args
from harness.config import ConfigError, validate
from harness.report import Reporter
from harness.runner import JobContext, run_job
from tests.engine_loads import engine_loads


def cfg_with(*overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def refused(*overrides: str, match: str) -> str:
    with engine_loads() as loads, pytest.raises(ConfigError, match=match) as err:
        validate(cfg_with(*overrides))
    assert loads == []
    return str(err.value)


def test_unreadable_config_json_names_the_file_and_the_json_error(tmp_path, tiny_mixtral_dir):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_mixtral_dir, ckpt)
    (ckpt / "config.json").write_text('{"architectures": ["MixtralForCausalLM"], "hidden_size": 64,,}')
    msg = refused("model=hf", f"model.path={ckpt}", match="model.path")
    assert str(ckpt / "config.json") in msg and "not valid JSON" in msg and "line 1 column" in msg


def _trace_file(path: Path, **kw) -> Path:
    experts = np.random.default_rng(0).integers(0, 8, (64, 4, 2)).astype(np.int32)
    experts[:, :, 1] = (experts[:, :, 0] + 1) % 8
    meta = {"n_experts": 8, "expert_bytes": 98304, "moe_layers": [0, 1, 2, 3]}
    return save_trace(path, RoutingTrace(experts=experts, meta=meta), **kw)


@pytest.mark.parametrize("damage", ["empty", "truncated", "bad_crc", "not_a_zip"])
@pytest.mark.slow
def test_damaged_trace_files_are_refused_at_validation(tmp_path, damage):
    path = _trace_file(tmp_path / "t.npz", compress=False)
    data = path.read_bytes()
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "bad_crc":
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            info = z.getinfo("experts.npy")
        body = info.header_offset + 30 + len(info.filename) + len(info.extra) + 200   # inside the array's bytes
        path.write_bytes(data[:body] + bytes([data[body] ^ 0xFF]) + data[body + 1:])
    else:
        path.write_bytes(b"PK\x03\x04 nothing like a zip")
    msg = refused("cache.policy=belady", f"cache.policy_options.trace={path}", match="cache.policy_options")
    assert str(path) in msg and ("npz" in msg or "empty" in msg)


@pytest.mark.slow
def test_a_good_trace_feeds_belady_and_static(tmp_path):
    path = _trace_file(tmp_path / "t.npz")
    spec = validate(cfg_with("cache.policy=belady", f"cache.policy_options.trace={path}"))
    assert set(spec.policy_options["future"]) == {0, 1, 2, 3}
    spec = validate(cfg_with("cache.policy=static", f"cache.policy_options.trace={path}"))
    assert len(spec.policy_options["popularity"][0]) == 8
    table = tmp_path / "pop.json"
    table.write_text(json.dumps([[1] * 8] * 4))
    spec = validate(cfg_with("cache.policy=static", f"cache.policy_options.popularity={table}"))
    assert spec.policy_options["popularity"][3] == [1] * 8
    table.write_text(json.dumps([[1] * 8] * 3))
    refused("cache.policy=static", f"cache.policy_options.popularity={table}", match=r"shape \(3, 8\).*needs \(4, 8\)")
    refused("cache.policy=lru", f"cache.policy_options.trace={path}", match=r"\['trace'\] do not apply to cache.policy=lru")


@pytest.mark.parametrize("policy,needs", [("belady", "trace=FILE"), ("static", "popularity=FILE")])
def test_static_and_belady_without_their_data_are_refused(policy, needs):
    refused(f"cache.policy={policy}", match=needs.replace(".", r"\."))


@pytest.mark.parametrize("value", ["-5MiB", "lots", "0"])
def test_bad_device_memory(value):
    msg = refused(f"hardware.device_memory={value}", match="hardware.device_memory")
    assert value in msg


def test_n_cpu_layers_beyond_the_moe_layers():
    refused("placement=hybrid", "placement.n_cpu_layers=9", match=r"placement.n_cpu_layers: allowed 0..4 .*got 9")


def test_cuda_graph_refused_where_a_layer_keeps_another_state():
    refused("placement=resident_grouped", "placement.cuda_graph=true", "model=tiny-deepseek",
            match=r"placement.cuda_graph: decode steps of fixed shape need a full KV cache in every layer; .*"
                  r"an MLA latent .*allowed for this model: cuda_graph=false")


def test_cuda_graph_refuses_a_routing_trace():
    refused("placement=resident_grouped", "placement.cuda_graph=true", "run.record_trace=true",
            match=r"run.record_trace=true: placement.cuda_graph=true keeps routing on the device")


@pytest.mark.parametrize("placement", PLACEMENTS.names())
def test_a_wrong_capacity_is_refused_under_every_placement(placement):
    refused(f"placement={placement}", "cache.capacity=many", match=r"cache.capacity: allowed an int .* got 'many'")


def test_bad_input_writes_nothing_and_loads_nothing(tmp_path):
    with engine_loads() as loads:
        out = run_job(cfg_with("cache.policy=belady"), JobContext(tmp_path / "j", "s", "j"), Reporter(quiet=True))
    assert out.error and "cache.policy_options" in out.error and len(out.rows) == 1
    assert loads == [] and not (tmp_path / "j").exists()


def test_flags_anywhere_on_the_command_line():
    for argv in (["-m", "a=1", "b=2"], ["a=1", "-m", "b=2"], ["a=1", "b=2", "-m"]):
        flags, overrides = split_args(argv)
        assert flags == ["-m"] and overrides == ["a=1", "b=2"]
        args = hydra_args(argv)
        assert args[0] == "-m" and all(not a.startswith("-") for a in args[1:])
    assert split_args(["x=1", "--config-name", "other", "-m"]) == (["--config-name", "other", "-m"], ["x=1"])


def test_square_brackets_survive_the_terminal(capsys):
    rep = Reporter()
    rep.console = Console(file=io.StringIO(), width=200)
    rep.info("allowed [top_k=2, n_experts=8] got [red]9[/red]")
    rep.warn("layers [0, 1]")
    out = rep.console.file.getvalue()
    assert "[top_k=2, n_experts=8]" in out and "[red]9[/red]" in out and "[0, 1]" in out
