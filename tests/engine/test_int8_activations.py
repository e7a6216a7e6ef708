"""`experts.activations=int8`: quantised experts whose products take their inputs rounded to int8 per
block of 32 (as llama.cpp's Q8_0 / Q4_0 dot products do), a lossy treatment of its own, labelled.

The kernel's rounding is engine.blocks.intquant.quantize_activations bit for bit (NaN and
infinity included; its products against float64 and across batches and threads are
tests/engine/test_quant_kernels.py's, parametrised over the activations); QuantExperts runs it
for a decode step's rows and the dequantising path on rounded inputs beyond (and with the kernels
off), the two within the invariant's tolerance; every placement gives resident's output within
the treatment; the treatment moves the logits (it is not int4 under another name); the results
label it `int4+a8`; and a treatment it cannot apply to is refused by name."""
from __future__ import annotations

import pytest
import torch

from engine import Engine
from engine.blocks.experts import SwiGLUExperts
from engine.blocks.intquant import ACT_BLOCK, quantize_activations, round_activations
from engine.blocks.quant_experts import QuantExperts, label_of, resolve_expert_quant
from engine.config import preset
from engine.kernels import cpu
from tests.engine.test_cpu_kernels import needs_kernel
from tests.engine.test_quant_experts import PLACEMENTS, TOL, scenario
from tests.engine.test_quant_kernels import matrix, run

MODEL = "tiny-mixtral"
Q8 = {"activations": "int8"}


def test_rounding_by_hand():
    x = torch.zeros(1, ACT_BLOCK)
    x[0, :5] = torch.tensor([127.0, -63.5, 0.5, 1.5, 2.5])           # d = 1: ties to even
    q, d = quantize_activations(x)
    assert d.flatten().tolist() == [1.0]
    assert q[0, :5].tolist() == [127, -64, 0, 2, 2] and not q[0, 5:].any()
    q, d = quantize_activations(x / 4)                               # d = 1/4, the same values
    assert d.flatten().tolist() == [0.25] and q[0, :5].tolist() == [127, -64, 0, 2, 2]
    zero, dz = quantize_activations(torch.zeros(2, 2 * ACT_BLOCK))   # an all-zero block: d = 0, q = 0
    assert not zero.any() and not dz.any()
    assert torch.equal(round_activations(torch.zeros(1, ACT_BLOCK)), torch.zeros(1, ACT_BLOCK))


@needs_kernel
def test_the_kernels_rounding_is_the_definition_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    for n, K in ((1, 32), (3, 256), (8, 2048)):
        x = torch.randn(n, K, generator=g) * torch.rand(n, K, generator=g) * 4
        x[0, :ACT_BLOCK] = 0.0                                        # a block of zeros
        x[-1, K - 1] = float("nan") if K > 32 else x[-1, K - 1]
        x[0, K // 2] = float("inf")
        q, d = quantize_activations(x)
        assert cpu.available()
        kq, kd = torch.ops.moebench_cpu.quantize_activations(x)
        assert torch.equal(q, kq)
        assert torch.equal(d.isnan(), kd.isnan()) and torch.equal(d.nan_to_num(), kd.nan_to_num())
        assert d.isnan().sum() == (2 if K > 32 else 1)                 # the NaN's block and the inf's


@needs_kernel
def test_a_nan_input_gives_nan_outputs_never_a_finite_number():
    _, packed, args = matrix("int4", 64, 64, 32)
    x = torch.randn(2, 64)
    x[1, 40] = float("nan")
    y = run("int4", x, packed, args, "int8")
    assert y[0].isfinite().all() and y[1].isnan().all()


@needs_kernel
def test_bad_arguments_are_refused_by_name():
    _, packed, args = matrix("int4", 64, 64, 16)
    with pytest.raises(RuntimeError, match="int4_q8_linear: the group size must be a power of two >= 32"):
        cpu.int4_q8_linear(torch.zeros(1, 64), packed, *args)
    _, packed, args = matrix("int8", 64, 48)
    with pytest.raises(RuntimeError, match="int8_q8_linear: K = 48 must be a multiple of 32"):
        cpu.int8_q8_linear(torch.zeros(1, 48), packed, *args)


@needs_kernel
@pytest.mark.parametrize("fmt,group", [("int8", 32), ("int4", 32), ("int4", 16)])
def test_quant_experts_round_the_inputs_on_both_paths(fmt, group):
    """Up to QUANT_MAX_ROWS the kernel (int4 groups of 16: the dequantising path, which rounds too), beyond
    it the dequantised expert on rounded inputs, and with the kernels off the same: all one treatment."""
    D, I = 64, 128
    layout = QuantExperts(SwiGLUExperts(D, I, "silu", "m.{layer}"), fmt, group, activations="int8")
    plain = QuantExperts(SwiGLUExperts(D, I, "silu", "m.{layer}"), fmt, group)
    dense = torch.randn(layout.base.numel, generator=torch.Generator().manual_seed(5)) * 0.02
    packed = torch.empty(layout.numel, dtype=torch.uint8)
    layout.pack(dense, packed)
    for n in (1, 3, cpu.MAX_ROWS + 1, cpu.QUANT_MAX_ROWS, cpu.QUANT_MAX_ROWS + 1):
        x = torch.randn(n, D, generator=torch.Generator().manual_seed(n))
        y = layout.run(x, packed)
        with cpu.enabled(False):
            off = layout.run(x, packed)
        assert (y - off).abs().max() <= 1e-5 * off.abs().max(), n
        assert (y - plain.run(x, packed)).abs().max() > 1e-5 * off.abs().max(), n     # rounding the inputs shows


@pytest.mark.parametrize("placement,options", PLACEMENTS, ids=lambda v: v if isinstance(v, str) else repr(v))
def test_every_placement_gives_resident_within_the_treatment(placement, options):
    toks, logits = scenario(Engine.from_pretrained(MODEL, device="cpu", expert_quant="int4", quant_options=Q8), 1)
    eng = Engine.from_pretrained(MODEL, device="cpu", placement=placement, expert_quant="int4", quant_options=Q8,
                                 **options)
    t, l = scenario(eng, 1)
    assert t == toks
    assert max(float((a - b).abs().max()) for a, b in zip(l, logits)) <= TOL


def test_it_is_a_treatment_of_its_own_and_says_so():
    int4 = scenario(Engine.from_pretrained(MODEL, device="cpu", expert_quant="int4"), 1)[1]
    eng = Engine.from_pretrained(MODEL, device="cpu", expert_quant="int4", quant_options=Q8)
    a8 = scenario(eng, 1)[1]
    assert max(float((a - b).abs().max()) for a, b in zip(a8, int4)) > TOL
    assert eng.lossy and eng.cfg.expert_quant.label == "int4+a8"
    assert label_of("int8", "int8") == "int8+a8" and label_of("int4") == "int4" and label_of("none", "int8") == "none"


def test_what_it_cannot_apply_to_is_refused_by_name():
    cfg = preset(MODEL)
    with pytest.raises(ValueError, match=r"experts.activations must be one of \['fp32', 'int8'\], got 'int4'"):
        resolve_expert_quant(cfg, "int4", activations="int4")
    with pytest.raises(ValueError, match="needs experts.quant=int8|int4|mixed, got experts.quant=none"):
        resolve_expert_quant(cfg, "none", activations="int8")
    with pytest.raises(ValueError, match=r"multiple of 32 inputs; SwiGLUExperts with inputs \[48, 96\]"):
        QuantExperts(SwiGLUExperts(48, 96, "silu", "m.{layer}"), "int8", activations="int8")
