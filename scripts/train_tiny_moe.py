"""Train `tiny-moe-trained`: a small Mixtral-shaped MoE on this machine's Python standard library.

Every other model moebench runs here has seeded random weights, whose routers route with no
learned structure (no hot experts, no token-to-token locality). This script trains a small one
whose routing has that structure, on text every machine with Python has: the stdlib's source
files (workloads.corpus), byte-tokenized as the workloads are (workloads.tokenize.ByteTokenizer).

Owns: the model's shape (`SHAPE`), the data split (a file is held out when a hash of its path
says so, so the split does not depend on the file list's order), the training loop (transformers'
MixtralForCausalLM plus a per-layer load-balancing loss, `balance_loss`, so that every layer's
experts specialise rather than collapse),
the held-out evaluation, and writing the checkpoint (config.json + model.safetensors, float32).
Does not own: loading or running the model (engine; the checkpoint is a plain Hugging Face
Mixtral checkpoint), the routing statistics' definitions (harness.sim.stats).

    python scripts/train_tiny_moe.py --out engine/checkpoints/tiny-moe-trained     # ~11 min, 2 cores
    python scripts/train_tiny_moe.py --steps 20 --out /tmp/t   # the first steps, to compare with the log

Seeded: the same seed, Python build (its stdlib is the data), torch version and thread count
give the same losses; `train_log.json` beside the checkpoint records every step's loss so a
short rerun can be compared with it (tests/engine/test_trained_model.py).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from workloads.corpus import corpus_id, read_source, source_files  # noqa: E402
from workloads.tokenize import ByteTokenizer  # noqa: E402

#: The model's shape: tiny-mixtral's, the preset every shape test uses (transformers' MixtralConfig keys), so
#: that every plan, byte count and budget is the same on both and only the weights -- and so the routing -- differ.
SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
             max_position_embeddings=8192, rope_theta=1e6, rms_norm_eps=1e-5, sliding_window=None,
             tie_word_embeddings=False, bos_token_id=256, eos_token_id=257, pad_token_id=None,
             router_aux_loss_coef=0.0)   # transformers' balance loss pools every layer's experts together,
                                         # so a layer may collapse; `balance_loss` balances each layer


@dataclass(frozen=True)
class TrainConf:
    seed: int = 0
    steps: int = 900
    batch: int = 2              # sequences per step
    seq_len: int = 4096         # tokens per sequence: the default workload's context (positions and
                                # relative distances beyond it are untrained; the model card measures them)
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.1
    balance_coef: float = 0.02  # weight of the per-layer load-balancing loss
    held_out_per_mille: int = 100   # files whose path hash mod 1000 is below this are held out
    eval_sequences: int = 16
    threads: int = 2


def held_out(path: str, per_mille: int) -> bool:
    """Whether a stdlib file is held out: by a hash of its path, independent of the list's order."""
    return int(hashlib.sha256(path.encode()).hexdigest()[:8], 16) % 1000 < per_mille


def token_stream(files: list[str], tok: ByteTokenizer) -> np.ndarray:
    """Every file's bytes, each opened by BOS and closed by EOS, one after another: [N] int16."""
    parts = [np.array([tok.bos_id, *tok.encode(read_source(f)), tok.eos_id], dtype=np.int16) for f in files]
    return np.concatenate(parts)


def windows(stream: np.ndarray, rng: np.random.Generator, n: int, seq_len: int) -> torch.Tensor:
    """n random windows of seq_len + 1 tokens (inputs and their next tokens): [n, seq_len + 1]."""
    starts = rng.integers(0, len(stream) - seq_len - 1, size=n)
    return torch.from_numpy(np.stack([stream[s:s + seq_len + 1] for s in starts]).astype(np.int64))


def split(conf: TrainConf) -> tuple[list[str], list[str]]:
    """The stdlib files trained on, and those held out."""
    parts: tuple[list[str], list[str]] = ([], [])
    for f in source_files():
        parts[held_out(f, conf.held_out_per_mille)].append(f)
    return parts


def held_out_windows(conf: TrainConf) -> torch.Tensor:
    """The held-out evaluation windows, the same for every run of a seed: [eval_sequences, seq_len + 1]."""
    stream = token_stream(split(conf)[1], ByteTokenizer(SHAPE["vocab_size"]))
    return windows(stream, np.random.default_rng(conf.seed + 1), conf.eval_sequences, conf.seq_len)


def build(conf: TrainConf) -> "torch.nn.Module":
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(conf.seed)
    return MixtralForCausalLM(MixtralConfig(**SHAPE))


def balance_loss(router_logits: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    """Switch-style load balancing, per layer: E * sum_e f_e * P_e, f_e the share of the layer's top-k
    assignments that go to expert e, P_e its mean router probability; 1 when balanced, averaged over
    layers (transformers' pools the layers' logits, which lets one layer send everything to two
    experts while another uses the rest)."""
    losses = []
    for logits in router_logits:                                     # [T, E] per layer
        probs = logits.float().softmax(-1)
        top = probs.topk(top_k, dim=-1).indices                      # [T, k]
        f = torch.zeros_like(probs).scatter_(1, top, 1.0).mean(0) / top_k   # [E], sums to 1
        losses.append(probs.shape[-1] * (f * probs.mean(0)).sum())
    return torch.stack(losses).mean()


def lr_at(step: int, conf: TrainConf) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < conf.warmup:
        return conf.lr * (step + 1) / conf.warmup
    t = (step - conf.warmup) / max(1, conf.steps - conf.warmup)
    return conf.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def evaluate(model: "torch.nn.Module", batches: torch.Tensor) -> float:
    """Mean next-token cross-entropy (nats per token) over held-out windows [n, seq_len + 1]."""
    model.eval()
    total, count = 0.0, 0
    for chunk in batches.split(8):
        logits = model(input_ids=chunk[:, :-1], output_router_logits=False).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
        total, count = total + float(loss), count + chunk[:, 1:].numel()
    model.train()
    return total / count


def train(conf: TrainConf, progress: bool = True) -> tuple["torch.nn.Module", dict]:
    """Train from the seed; returns the model and the log (per-step losses)."""
    torch.set_num_threads(conf.threads)
    train_files, eval_files = split(conf)
    train_stream = token_stream(train_files, ByteTokenizer(SHAPE["vocab_size"]))
    rng = np.random.default_rng(conf.seed)
    model = build(conf)
    model.train()
    other, decay = [], []                             # weight decay on matrices, not on embeddings or norms
    for n, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed" not in n else other).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": conf.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=conf.lr, betas=(0.9, 0.95))
    losses, balances = [], []
    t0 = time.perf_counter()
    for step in range(conf.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, conf)
        batch = windows(train_stream, rng, conf.batch, conf.seq_len)[:, 1:]     # [B, S]
        # transformers shifts the labels itself (labels are the inputs)
        out = model(input_ids=batch, labels=batch, output_router_logits=True)
        balance = balance_loss(out.router_logits, SHAPE["num_experts_per_tok"])
        opt.zero_grad(set_to_none=True)
        (out.loss + conf.balance_coef * balance).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(round(float(out.loss.detach()), 5))
        balances.append(round(float(balance.detach()), 5))
        if progress and (step % 20 == 0 or step == conf.steps - 1):
            print(f"step {step + 1}/{conf.steps}  loss {losses[-1]:.4f}  balance {balances[-1]:.4f}  "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    log = {"conf": asdict(conf), "shape": SHAPE, "corpus": corpus_id(), "torch": torch.__version__,
           "train_files": len(train_files), "held_out_files": len(eval_files),
           "train_tokens_seen": conf.steps * conf.batch * conf.seq_len,
           "train_seconds": round(time.perf_counter() - t0, 1), "loss": losses, "balance_loss": balances}
    return model, log


def finish(model: "torch.nn.Module", log: dict, conf: TrainConf) -> None:
    """Log the held-out loss of the weights as the checkpoint holds them (float32, as trained)."""
    log["held_out_loss"] = round(evaluate(model, held_out_windows(conf)), 5)


def save(model: "torch.nn.Module", log: dict, out: Path) -> None:
    """config.json + model.safetensors (float32, like tiny-mixtral's weights) + train_log.json."""
    out.mkdir(parents=True, exist_ok=True)
    model.config.dtype = "float32"
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)     # transformers' sampling defaults: not ours
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=TrainConf.steps)
    ap.add_argument("--seed", type=int, default=TrainConf.seed)
    a = ap.parse_args(argv)
    conf = TrainConf(seed=a.seed, steps=a.steps)
    model, log = train(conf)
    finish(model, log, conf)
    save(model, log, a.out)
    print(f"held-out loss {log['held_out_loss']:.4f} nats/token (perplexity {math.exp(log['held_out_loss']):.2f}); "
          f"{log['train_seconds']:.0f} s; wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
