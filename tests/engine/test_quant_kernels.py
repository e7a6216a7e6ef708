"""engine.kernels.cpu's int8 / int4 paths: a quantised expert matrix read from its packed bytes.

The kernel against float64 of dequantise-then-matmul (it applies a scale to a sum, the row's or
a group's, not to each weight: the dequantised matrix's product up to fp32 rounding, not its
bits), also on inputs rounded to int8 (experts.activations=int8), the same bits at any batch up
to MAX_ROWS and beyond, at 1 or 2 threads; QuantExperts running it
for up to QUANT_MAX_ROWS rows on the CPU and the dequantising path beyond, for int4 groups the
kernel cannot read, and with the kernels off; an engine with quantised experts calling it. The
invariant within a treatment (every placement gives resident's output) is
tests/engine/test_quant_experts.py's. Speed is not tested here (benchmarks/bench_vs_llamacpp.py
--quant, docs/cpu_experts.md)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import Engine
from engine.blocks.experts import SwiGLUExperts
from engine.blocks.intquant import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8, round_activations
from engine.blocks.quant_experts import QuantExperts
from engine.kernels import cpu
from tests.engine.test_cpu_kernels import X86_AVX2, needs_kernel

SHAPES = [(96, 32), (77, 48), (130, 200), (2048, 64)]          # [O, K]: odd rows, K off the 16-wide step
GROUPS = [8, 16, 32]


def _avx512() -> bool:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return "avx512f" in flags


LANES = (8, 16) if _avx512() else (8,)        # int4's block widths this CPU runs: each is tested


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def matrix(fmt: str, O: int, K: int, group: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """A random w [O, K] quantised by engine.blocks.intquant into one uint8 buffer [scales (fp32) |
    zero points (int4) | values] (QuantExperts' order for one matrix): (its dequantised matrix,
    the buffer, the kernel's arguments after (x, packed))."""
    w = torch.randn(O, K, generator=torch.Generator().manual_seed(seed)) * 0.02
    if fmt == "int8":
        q, scale = quantize_int8(w)
        parts, deq = [scale.view(torch.uint8), q.view(torch.uint8)], dequantize_int8(q, scale)
    else:
        q, scale, zero = quantize_int4(w, group)
        parts, deq = [scale.reshape(-1).view(torch.uint8), zero, q], dequantize_int4(q, scale, zero, group)
    flat = [p.reshape(-1) for p in parts]
    at = [0]
    for p in flat:
        at.append(at[-1] + p.numel())
    packed = torch.cat(flat)
    if fmt == "int8":
        return deq, packed, (at[1], at[0], O, K)
    return deq, packed, (at[2], at[0], at[1], O, K, group)


def run(fmt: str, x: torch.Tensor, packed: torch.Tensor, args: tuple, activations: str = "fp32") -> torch.Tensor:
    """The kernel for `fmt` on inputs as given (activations fp32; "fp32/16" runs int4's 16-lane
    blocks) or rounded to int8 by it (int8)."""
    if activations == "int8":
        return (cpu.int8_q8_linear if fmt == "int8" else cpu.int4_q8_linear)(x, packed, *args)
    if fmt == "int8":
        return cpu.int8_linear(x, packed, *args)
    return cpu.int4_linear(x, packed, *args, lanes=int(activations.partition("/")[2] or 8))


CASES = [("int8", O, K, 32, "fp32") for O, K in SHAPES] + \
        [("int4", O, K, g, f"fp32/{lanes}") for O, K in SHAPES for g in GROUPS if K % g == 0 for lanes in LANES] + \
        [("int4", 77, 2048, g, f"fp32/{lanes}") for g in (128, 256) for lanes in LANES] + \
        [("int8", 96, 64, 32, "int8"), ("int8", 77, 2048, 32, "int8"), ("int4", 96, 64, 32, "int8"),   # int8 inputs:
         ("int4", 130, 128, 64, "int8"), ("int4", 77, 2048, 128, "int8")]                             # K % 32, groups >= 32


@needs_kernel
@pytest.mark.parametrize("fmt,O,K,group,activations", CASES)
def test_matches_float64_of_dequantise_then_matmul(fmt, O, K, group, activations):
    """On the inputs as given, or on them rounded (engine.blocks.intquant.round_activations), which
    is then not the product on the inputs as given."""
    w, packed, args = matrix(fmt, O, K, group, seed=O + K)
    g = torch.Generator().manual_seed(K)
    for n in (*range(1, cpu.MAX_ROWS + 1), 37):
        x = torch.randn(n, K, generator=g)
        y = run(fmt, x, packed, args, activations)
        exact = F.linear((round_activations(x) if activations == "int8" else x).double(), w.double())
        assert y.dtype == torch.float32 and y.shape == (n, O)
        assert (y.double() - exact).abs().max() <= 1e-5 * exact.abs().max(), n
        if activations == "int8":
            unrounded = F.linear(x.double(), w.double())
            assert (y.double() - unrounded).abs().max() > 1e-5 * unrounded.abs().max(), n


@needs_kernel
@pytest.mark.parametrize("fmt,O,K,group,activations", CASES)
def test_a_rows_output_is_the_same_bits_at_any_batch_and_thread_count(fmt, O, K, group, activations, threads):
    _, packed, args = matrix(fmt, O, K, group, seed=1)
    x = torch.randn(cpu.MAX_ROWS + 3, K, generator=torch.Generator().manual_seed(2))
    torch.set_num_threads(1)
    alone = torch.cat([run(fmt, x[i:i + 1], packed, args, activations) for i in range(len(x))])
    together = run(fmt, x, packed, args, activations)
    assert torch.equal(alone, together)
    torch.set_num_threads(2)
    assert torch.equal(together, run(fmt, x, packed, args, activations))
    for n in range(2, len(x)):
        assert torch.equal(run(fmt, x[:n], packed, args, activations), together[:n]), n


@needs_kernel
def test_bad_arguments_are_refused_by_name():
    _, packed, args = matrix("int4", 64, 64)
    with pytest.raises(RuntimeError, match="int4_linear: the group size must be a power of two >= 8"):
        cpu.int4_linear(torch.zeros(1, 64), packed, *args[:-1], 24)
    with pytest.raises(RuntimeError, match=r"int8_linear values: bytes \[.*\) lie outside the packed buffer"):
        cpu.int8_linear(torch.zeros(1, 64), packed, packed.numel() - 10, 0, 64, 64)
    with pytest.raises(RuntimeError, match="int8_linear: x must be float32"):
        cpu.int8_linear(torch.zeros(1, 64, dtype=torch.bfloat16), packed, 0, 0, 1, 64)


def spy(monkeypatch) -> list[int]:
    """Rows per call of either quantised path, as QuantExperts calls them."""
    calls: list[int] = []
    for name in ("int8_linear", "int4_linear"):
        real = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda x, *a, real=real: calls.append(x.shape[0]) or real(x, *a))
    return calls


@needs_kernel
@pytest.mark.parametrize("fmt,group", [("int8", 32), ("int4", 32), ("int4", 16)])
def test_quant_experts_run_the_kernel_up_to_quant_max_rows_and_dequantise_beyond(fmt, group, monkeypatch):
    D, I = 64, 128
    layout = QuantExperts(SwiGLUExperts(D, I, "silu", "m.{layer}"), fmt, group)
    dense = torch.randn(layout.base.numel, generator=torch.Generator().manual_seed(5)) * 0.02
    packed = torch.empty(layout.numel, dtype=torch.uint8)
    layout.pack(dense, packed)
    calls = spy(monkeypatch)
    for n in (1, 3, cpu.MAX_ROWS + 1, cpu.QUANT_MAX_ROWS, cpu.QUANT_MAX_ROWS + 1):
        x = torch.randn(n, D, generator=torch.Generator().manual_seed(n))
        before = len(calls)
        y = layout.run(x, packed)
        ran = len(calls) > before
        dense_path = layout.base.run(x, layout.unpack(packed, x.dtype))     # what run did before the kernel
        assert ran == (n <= cpu.QUANT_MAX_ROWS), n
        if ran:                                                               # scales applied to sums
            assert (y - dense_path).abs().max() <= 1e-5 * dense_path.abs().max(), n
        else:
            assert torch.equal(y, dense_path), n                              # that very path
        with cpu.enabled(False):
            off = layout.run(x, packed)                                       # torch's path
        assert len(calls) == before + (2 if ran else 0)
        assert (y - off).abs().max() <= 1e-5 * off.abs().max(), n


@needs_kernel
def test_int4_groups_the_kernel_cannot_read_take_the_dequantising_path(monkeypatch):
    layout = QuantExperts(SwiGLUExperts(48, 96, "silu", "m.{layer}"), "int4", 24)
    packed = torch.empty(layout.numel, dtype=torch.uint8)
    layout.pack(torch.randn(layout.base.numel) * 0.02, packed)
    calls = spy(monkeypatch)
    x = torch.randn(2, 48)
    assert torch.equal(layout.run(x, packed), layout.base.run(x, layout.unpack(packed, x.dtype)))
    assert calls == []


@pytest.mark.skipif(not X86_AVX2, reason="the kernel is x86-64 AVX2 code")
@pytest.mark.parametrize("quant", ["int8", "int4", "mixed"])
def test_an_engine_with_quantised_experts_runs_the_kernel_and_agrees_with_torchs_path(quant, tmp_path, monkeypatch):
    """An engine's decode steps (experts on the CPU) call the kernel; tokens and logits equal the
    kernels-off run's within the invariant's tolerance."""
    options = {}
    if quant == "mixed":
        pop = tmp_path / "pop.json"
        pop.write_text("[" + ",".join(["[8,7,6,5,4,3,2,1]"] * 4) + "]")
        options = {"popularity": str(pop), "mixed_count": 3}
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    make = lambda: Engine.from_pretrained("tiny-mixtral", device="cpu", placement="cpu", expert_quant=quant,  # noqa: E731
                                          quant_options=options)
    with cpu.enabled(False):
        ref = make().generate(prompts, 6)
    calls = spy(monkeypatch)
    got = make().generate(prompts, 6)
    assert calls and max(calls) <= cpu.QUANT_MAX_ROWS
    assert got.tokens == ref.tokens
    assert max((a - b).abs().max().item() for a, b in zip(got.logits, ref.logits)) <= 1e-5
