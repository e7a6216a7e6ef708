"""The shipped trained model: reproducible from its seed, loaded by name, routing with structure.

`tiny-moe-trained` (engine/checkpoints/tiny-moe-trained, trained by scripts/train_tiny_moe.py)
is moebench's default model. These tests hold the checkpoint to its training log and model card:
a short rerun from the seed gives the logged losses; the checkpoint gives the logged held-out
loss; the engine loads it by name and matches transformers; its routing is not a random router's.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import Engine
from engine.shipped import shipped_checkpoint

ROOT = Path(__file__).resolve().parents[2]
CKPT = shipped_checkpoint("tiny-moe-trained")
LOG = json.loads((CKPT / "train_log.json").read_text())


def _train_module():
    spec = importlib.util.spec_from_file_location("train_tiny_moe", ROOT / "scripts" / "train_tiny_moe.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("train_tiny_moe", mod)
    spec.loader.exec_module(mod)
    return mod


def test_the_checkpoint_is_small_and_shaped_like_the_random_preset():
    files = {f.name: f.stat().st_size for f in CKPT.iterdir()}
    assert sum(files.values()) <= 5 * 2**20, files
    cfg = json.loads((CKPT / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"] and "auto_map" not in cfg      # no code ships with it
    from engine.config import preset
    trained, random_ = preset("tiny-moe-trained"), preset("tiny-mixtral")   # the shape tests' preset, trained
    assert trained.replace(name="", torch_dtype="float32") == random_.replace(name="")


@pytest.mark.slow
def test_a_rerun_from_the_seed_gives_the_logged_losses():
    """The first steps of training, rerun: the same losses as the committed log, to 1e-3 relative (the
    log was written at 2 threads; a different thread count sums in another order)."""
    mod = _train_module()
    steps = 4
    conf = mod.TrainConf(**{**LOG["conf"], "steps": steps})
    threads = torch.get_num_threads()
    try:
        _, log = mod.train(conf, progress=False)
    finally:
        torch.set_num_threads(threads)
    # the schedule differs past warm-up when steps differ; the warm-up steps do not depend on it
    assert steps <= LOG["conf"]["warmup"]
    np.testing.assert_allclose(log["loss"], LOG["loss"][:steps], rtol=1e-3)
    assert log["loss"][0] == pytest.approx(math.log(LOG["shape"]["vocab_size"]), rel=0.1)   # an untrained start


@pytest.mark.skipif(not os.environ.get("MOEBENCH_FULL_TRAINING"),
                    reason="trains the whole model (~11 min on 2 cores); set MOEBENCH_FULL_TRAINING=1 to run it")
def test_the_whole_training_reproduces_the_checkpoint(tmp_path):
    """The whole run from the seed: its last losses and held-out loss within 0.02 nats of the log's
    (the same seed, stdlib and torch; another thread count or CPU sums in another order), and the
    checkpoint it writes loads."""
    mod = _train_module()
    conf = mod.TrainConf(**LOG["conf"])
    model, log = mod.train(conf, progress=False)
    mod.finish(model, log, conf)
    mod.save(model, log, tmp_path)
    assert log["held_out_loss"] == pytest.approx(LOG["held_out_loss"], abs=0.02)
    assert np.mean(log["loss"][-50:]) == pytest.approx(np.mean(LOG["loss"][-50:]), abs=0.02)
    Engine.from_pretrained(str(tmp_path), placement="resident").close()


@pytest.mark.slow
def test_the_checkpoint_gives_its_logged_held_out_loss():
    """Our engine, loading the checkpoint by name, scores the held-out windows at the logged loss
    (transformers computed it at the end of training)."""
    mod = _train_module()
    conf = mod.TrainConf(**LOG["conf"])
    windows = mod.held_out_windows(conf)                     # [n, S + 1]
    eng = Engine.from_pretrained("tiny-moe-trained", placement="resident", max_context=conf.seq_len)
    total = 0.0
    for row in windows:
        logits = eng.prefill(eng.new_session(), [row[:-1].tolist()], all_logits=True)[0]    # [S, V]
        total += float(torch.nn.functional.cross_entropy(logits.float(), row[1:], reduction="sum"))
    eng.close()
    loss = total / windows[:, 1:].numel()
    assert loss == pytest.approx(LOG["held_out_loss"], abs=1e-3)
    assert loss < 0.4 * math.log(LOG["shape"]["vocab_size"])     # far below a uniform guess


def test_the_balance_loss_is_per_layer():
    """1 for layers that route evenly; near 2 when each layer sends everything to half its experts --
    one layer to experts 0-3, the other to 4-7 -- where the loss transformers computes, pooling the
    layers, reads what it reads for even routing."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    mod = _train_module()
    E, T = 8, 64

    def layer(experts: list[int]) -> torch.Tensor:            # [T, E]: token t prefers two of `experts`, in turn
        logits = torch.zeros(T, E)
        for t in range(T):
            logits[t, experts[(2 * t) % len(experts)]] = 5.0
            logits[t, experts[(2 * t + 1) % len(experts)]] = 4.0
        return logits
    even = layer(list(range(E)))
    assert float(mod.balance_loss((even, even), 2)) == pytest.approx(1.0, abs=0.05)
    halves = (layer([0, 1, 2, 3]), layer([4, 5, 6, 7]))
    assert float(mod.balance_loss(halves, 2)) > 1.8
    pooled = float(load_balancing_loss_func(halves, E, 2))
    assert pooled == pytest.approx(float(load_balancing_loss_func((even, even), E, 2)), rel=0.05)   # reads balanced


def test_the_trained_router_uses_every_expert_and_routes_with_locality(tmp_path):
    """On held-out stdlib text the checkpoint routes each layer near evenly (per-layer expert-frequency
    entropy at least 0.9 of log2 E: no collapsed layer) and with token-to-token locality a random
    router lacks (adjacent tokens share experts more often than independent routing would)."""
    from engine.trace import RoutingTrace
    from harness.sim.stats import trace_stats
    from transformers import MixtralForCausalLM
    mod = _train_module()
    ids = mod.held_out_windows(mod.TrainConf(**LOG["conf"]))[:1, :1025]       # [1, 1025]
    model = MixtralForCausalLM.from_pretrained(CKPT, dtype=torch.float32)
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True)
    k, E = LOG["shape"]["num_experts_per_tok"], LOG["shape"]["num_local_experts"]
    experts = torch.stack([lg.topk(k, -1).indices for lg in out.router_logits], 1)   # [T, L, k]
    stats = trace_stats(RoutingTrace(experts.numpy().astype(np.int32), {"n_experts": E, "expert_bytes": 1}).validate())
    layers = stats                                                            # one row per layer
    assert (layers["entropy_ratio"] >= 0.9).all(), layers[["layer", "entropy_ratio"]]
    assert (layers["jaccard"] > 1.2 * layers["jaccard_random"]).all(), layers[["layer", "jaccard", "jaccard_random"]]
