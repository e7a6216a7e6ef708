"""Quality of a treatment against the exact reference on the same prompt (DESIGN §3, §5): the
`quality` phase's metrics (harness.contract.QUALITY_METRICS).

Owns: the quality run one engine makes over a workload sample (`quality_run`) -- the prompt
prefilled in the engine's micro-batches keeping every position's logits, then the greedy
continuation, teacher-forced on given tokens or free-running -- and comparing a treatment's
run with the reference's (`quality_metrics`). The reference (harness.reference, the exact model on
the CPU) makes its run once, free-running; the measured engine makes two: teacher-forced on
the reference's continuation, so that every compared position conditions on the same prefix,
and free-running, for `token_agreement`. Does not own: the reference's computation or cache
(harness.reference), the `quality` pass that makes a job's runs and rows (harness.passes.quality).

Positions compared: the last `PROMPT_POSITIONS` prompt positions (each predicting the next
token; the last predicts the first generated one) and the gen_tokens - 1 decode steps, for
every sequence of the batch. Over them:
- `kl_div_mean`, `kl_div_max`: KL(reference || treatment) = sum_v p_ref (log p_ref - log p_treat)
  over the full vocabulary, in float64, per position; the mean and the largest;
- `top1_agreement`: positions whose argmax equals the reference's;
- `max_abs_logit_diff`: the largest |logit difference|;
- `ppl_ratio`: exp(mean NLL of the prompt text under the treatment - under the reference), over
  every prompt position that predicts a prompt token (all of them, not only the kept ones);
- `token_agreement`: free-running greedy tokens equal to the reference's, over gen_tokens.
Identical logits give exactly 0, 1, 0, 1 and 1 (an exact run on the CPU, where placement
changes nothing bit for bit). A metric that cannot be computed is null with its reason
(`compare_explained`), never 0. NaN or inf is never compared: a run whose logits go non-finite
raises the engine's NonFiniteError (checked after every forward pass), and `quality_metrics`
refuses non-finite inputs or results (a NaN compared with NaN would read as a metric).

    ref = quality_run(reference_engine, sample.contexts, gen_tokens)
    got = quality_run(engine, sample.contexts, gen_tokens, forced=ref.continuation)
    free = quality_run(engine, sample.contexts, gen_tokens)
    metrics = quality_metrics(got, ref, free.continuation)
    metrics, reasons = compare_explained(got, ref, free.continuation)   # reasons: null metric -> why
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.finite import NonFiniteError, nonfinite_count
from harness.contract import QUALITY_METRICS

PROMPT_POSITIONS = 512       # prompt positions whose full distributions are kept (the last ones)


@dataclass
class QualityRun:
    logits: torch.Tensor                 # [B, N, V] host fp32: the kept prompt positions, then the decode steps
    nll: float                           # sum of -log p(next prompt token) over every prompt position and row
    nll_count: int                       # how many terms that sum has
    continuation: list[list[int]]        # [B][G] the tokens fed (forced) or chosen (greedy)


@torch.inference_mode()
def quality_run(engine, contexts: list[list[int]], gen_tokens: int,
                forced: list[list[int]] | None = None) -> QualityRun:
    """One run of `engine` (an engine.Engine) over the prompts `contexts` [B][T] and gen_tokens
    generated tokens -- `forced` [B][G]: fed in place of the engine's own choices."""
    B, T = len(contexts), len(contexts[0])
    keep_from = max(0, T - PROMPT_POSITIONS)
    ids = torch.tensor(contexts, dtype=torch.long)                                      # [B, T]
    sess = engine.new_session(B)
    kept: list[torch.Tensor] = []
    nll, count = 0.0, 0
    try:
        step = engine.ubatch
        for s in range(0, T, step):
            logits = engine.prefill(sess, ids[:, s:s + step].tolist(), all_logits=True)    # [B, t, V]
            engine.check_finite(sess, logits)
            logits = logits.to("cpu", torch.float32)
            t = logits.shape[1]
            targets = ids[:, s + 1:s + t + 1]                                           # [B, <=t]
            if targets.shape[1]:
                lp = torch.log_softmax(logits[:, :targets.shape[1]].double(), dim=-1)   # [B, t', V]
                nll -= float(lp.gather(-1, targets.unsqueeze(-1)).sum())
                count += targets.numel()
            if s + t > keep_from:
                kept.append(logits[:, max(0, keep_from - s):])
            last = logits[:, -1]                                                        # [B, V]
        fed = [[r[0] for r in forced]] if forced is not None else [last.argmax(-1).tolist()]
        for i in range(1, gen_tokens):
            logits = engine.decode_step(sess, fed[-1])                                  # [B, V]
            engine.check_finite(sess, logits)
            logits = logits.to("cpu", torch.float32)
            kept.append(logits.unsqueeze(1))
            fed.append([r[i] for r in forced] if forced is not None else logits.argmax(-1).tolist())
    finally:
        sess.close()
    return QualityRun(torch.cat(kept, dim=1), nll, count, [list(r) for r in zip(*fed)])


def quality_metrics(got: QualityRun, ref: QualityRun,
                    greedy: list[list[int]] | None) -> dict[str, float | None]:
    """The quality metrics of a treatment's teacher-forced run `got` against the reference's;
    `greedy`: the treatment's free-running continuation (None: token_agreement not measured)."""
    return compare_explained(got, ref, greedy)[0]


def compare_explained(got: QualityRun, ref: QualityRun,
                      greedy: list[list[int]] | None) -> tuple[dict[str, float | None], dict[str, str]]:
    """`quality_metrics`'s metrics, and for each one left null the reason (a row's `quality_reason`).
    Raises NonFiniteError when either run holds NaN or inf, or a metric comes out non-finite."""
    if got.logits.shape != ref.logits.shape:
        raise ValueError(f"quality passes over different positions: {tuple(got.logits.shape)} vs "
                         f"{tuple(ref.logits.shape)} [B, positions, vocab]")
    for side, qp in (("the treatment's", got), ("the reference's", ref)):
        if n := nonfinite_count(qp.logits):
            raise NonFiniteError(f"{side} quality pass holds {n} of {qp.logits.numel()} logits NaN or inf: "
                                 "nothing compared with them is a measurement")
        if not math.isfinite(qp.nll):
            raise NonFiniteError(f"{side} quality pass gives the prompt a non-finite NLL ({qp.nll})")
    lp_ref = torch.log_softmax(ref.logits.double(), dim=-1)                              # [B, N, V]
    lp_got = torch.log_softmax(got.logits.double(), dim=-1)
    kl = (lp_ref.exp() * (lp_ref - lp_got)).sum(-1).clamp_min(0.0)                       # [B, N]
    top1 = (got.logits.argmax(-1) == ref.logits.argmax(-1)).double()
    out: dict[str, float | None] = dict.fromkeys(QUALITY_METRICS)
    reasons: dict[str, str] = {}
    out.update(kl_div_mean=float(kl.mean()), kl_div_max=float(kl.max()), top1_agreement=float(top1.mean()),
               max_abs_logit_diff=float((got.logits - ref.logits).abs().max()),
               quality_positions=float(kl.numel()))
    if not ref.nll_count:
        reasons["ppl_ratio"] = "the prompt has no position that predicts a prompt token (one-token prompt)"
    elif got.nll_count != ref.nll_count:
        reasons["ppl_ratio"] = (f"the passes scored different prompt positions ({got.nll_count} vs the reference's "
                                f"{ref.nll_count})")
    else:
        out["ppl_ratio"] = math.exp((got.nll - ref.nll) / ref.nll_count)
    pairs = [(a, b) for ga, gb in zip(greedy or [], ref.continuation) for a, b in zip(ga, gb)]
    if greedy is None:
        reasons["token_agreement"] = "no free-running pass of the treatment was given"
    elif not pairs:
        reasons["token_agreement"] = "no generated token to compare (gen_tokens=0)"
    else:
        out["token_agreement"] = sum(a == b for a, b in pairs) / len(pairs)
    bad = sorted(k for k, v in out.items() if v is not None and not math.isfinite(v))
    if bad:
        raise NonFiniteError(f"quality metrics {', '.join(f'{k}={out[k]}' for k in bad)} are not finite (a "
                             "probability the treatment rounds to 0 where the reference's is not)")
    return out, reasons
