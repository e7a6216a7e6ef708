"""engine.kernels.cpu: the engine's small-batch linear kernel on the CPU against torch's path --
the fast path beside its slow reference (F.linear in float64), bitwise the same whatever the
batch or the thread count, BLAS exactly above MAX_ROWS, per expert group exactly the ungrouped
call, and used by the placements whose experts run on the CPU. Speed is not tested here
(benchmarks/bench_vs_llamacpp.py, docs/cpu_experts.md)."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import Engine
from engine.kernels import cpu

X86_AVX2 = platform.machine().lower() in ("x86_64", "amd64") and \
    torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
needs_kernel = pytest.mark.skipif(not X86_AVX2, reason="the kernel is x86-64 AVX2 code")
REPO = Path(__file__).resolve().parents[2]
SHAPES = [(96, 32), (77, 33), (130, 200), (2048, 64)]          # [O, K]: odd rows, K off the 16-wide step


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_kernel_builds_where_it_can_run():
    if not X86_AVX2:
        assert not cpu.available() and ("AVX2" in cpu.reason() or "x86-64" in cpu.reason())
        return
    assert cpu.available(), cpu.reason()


@needs_kernel
@pytest.mark.parametrize("O,K", SHAPES)
def test_small_linear_matches_float64_and_is_blas_above_max_rows(O, K):
    g = torch.Generator().manual_seed(O + K)
    w = torch.randn(O, K, generator=g)
    for n in range(1, cpu.MAX_ROWS + 3):
        x = torch.randn(n, K, generator=g)
        y = cpu.small_linear(x, w)
        exact = F.linear(x.double(), w.double())
        assert y.dtype == torch.float32 and y.shape == (n, O)
        assert (y.double() - exact).abs().max() <= 1e-5 * exact.abs().max(), n
        if n > cpu.MAX_ROWS:
            assert torch.equal(y, F.linear(x, w))                     # above MAX_ROWS: BLAS, bitwise


@needs_kernel
@pytest.mark.parametrize("O,K", SHAPES)
def test_a_rows_output_is_the_same_bits_at_any_batch_and_thread_count(O, K, threads):
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(O, K, generator=g), torch.randn(cpu.MAX_ROWS, K, generator=g)
    torch.set_num_threads(1)
    alone = torch.cat([cpu.small_linear(x[i:i + 1], w) for i in range(len(x))])
    together = cpu.small_linear(x, w)
    torch.set_num_threads(2)
    assert torch.equal(alone, together) and torch.equal(together, cpu.small_linear(x, w))


FORKED = """
import os, signal
import engine, torch
from engine.kernels import cpu
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
w, x = torch.randn(4096, 512, generator=g), torch.randn(1, 512, generator=g)
before = cpu.small_linear(x, w)                  # the parent's helper threads start here
pid = os.fork()
if pid == 0:                                     # the child's own helpers: the parent's did not come along
    signal.alarm(60)
    same = all(torch.equal(cpu.small_linear(x, w), before) for _ in range(50))
    os._exit(3 if not same else 4 if len(os.listdir("/proc/self/task")) < 2 else 0)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), torch.equal(cpu.small_linear(x, w), before))
"""


@needs_kernel
def test_a_forked_child_runs_the_kernel_on_two_threads_with_helpers_of_its_own():
    """The kernel's helper threads are started on first use and kept; a fork copies none of them,
    so a child of a process that used them (a Hydra or multiprocessing worker) starts its own:
    it neither hangs waiting for the parent's nor computes other bits."""
    proc = subprocess.run([sys.executable, "-c", FORKED], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "True"], proc.stdout + proc.stderr


@needs_kernel
def test_bf16_weights_are_read_as_they_are():
    """bf16 x and w: products in fp32 (exact for bf16 inputs), the output rounded to bf16 once."""
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(300, 256, generator=g).bfloat16(), torch.randn(3, 256, generator=g).bfloat16()
    y = cpu.small_linear(x, w)
    exact = F.linear(x.double(), w.double())
    assert y.dtype == torch.bfloat16
    assert ((y.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-4).all()


@needs_kernel
def test_bf16_above_max_rows_is_never_torchs_emulated_gemm():
    """Where the CPU has no bf16 arithmetic, bf16 beyond MAX_ROWS is the fp32 GEMM on widened
    copies, rounded once (torch's bf16 GEMM there is emulated, at a fraction of the fp32 rate)."""
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(64, 96, generator=g).bfloat16(), torch.randn(cpu.MAX_ROWS + 4, 96, generator=g).bfloat16()
    want = F.linear(x, w) if cpu.native_bf16() else F.linear(x.float(), w.float()).bfloat16()
    assert torch.equal(cpu.small_linear(x, w), want)


@needs_kernel
def test_grouped_is_the_ungrouped_call_on_each_group():
    """Empty, small and above-MAX_ROWS groups, each bitwise `small_linear` on its rows."""
    g = torch.Generator().manual_seed(3)
    E, O, K = 5, 70, 48
    w = torch.randn(E, O, K, generator=g)
    counts = [0, 1, cpu.MAX_ROWS, cpu.MAX_ROWS + 5, 3]
    x = torch.randn(sum(counts), K, generator=g)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    for dtype in (torch.float32, torch.bfloat16):
        y = cpu.grouped_small_linear(x.to(dtype), w.to(dtype), offs)
        start = 0
        for e, n in enumerate(counts):
            assert torch.equal(y[start:start + n], cpu.small_linear(x[start:start + n].to(dtype), w[e].to(dtype)))
            start += n


@needs_kernel
def test_bad_arguments_are_refused_by_name():
    with pytest.raises(RuntimeError, match="small_linear: the weight has 8 inputs, x has 4"):
        cpu.small_linear(torch.zeros(1, 4), torch.zeros(3, 8))
    with pytest.raises(RuntimeError, match="small_linear: the weight must be float32 or bfloat16"):
        cpu.small_linear(torch.zeros(1, 4, dtype=torch.float16), torch.zeros(3, 4, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="grouped_small_linear: offs must ascend"):
        cpu.grouped_small_linear(torch.zeros(2, 4), torch.zeros(2, 3, 4), torch.tensor([2, 1], dtype=torch.int32))


@needs_kernel
@pytest.mark.parametrize("placement,options", [("cpu", {}), ("hybrid", {"n_cpu_layers": 2})])
def test_cpu_experts_run_the_kernel_and_agree_with_torchs_path(placement, options, monkeypatch):
    """The placements whose experts run on the CPU call the kernel for a decode step's rows, and
    their tokens and logits equal those of torch's path (the kernel off) within the invariant's
    tolerance."""
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    with cpu.enabled(False):
        ref = Engine.from_pretrained("tiny-mixtral", device="cpu", placement=placement, **options).generate(prompts, 6)
    calls = []
    linear, swiglu = cpu.small_linear, cpu.swiglu
    monkeypatch.setattr(cpu, "small_linear", lambda x, w: calls.append(x.shape[0]) or linear(x, w))
    monkeypatch.setattr(cpu, "swiglu", lambda x, gu, d: calls.append(x.shape[0]) or swiglu(x, gu, d))
    got = Engine.from_pretrained("tiny-mixtral", device="cpu", placement=placement, **options).generate(prompts, 6)
    assert calls and min(calls) <= cpu.MAX_ROWS                   # decode steps' rows went through it
    assert got.tokens == ref.tokens
    assert max((a - b).abs().max().item() for a, b in zip(got.logits, ref.logits)) <= 1e-5


def test_switched_off_it_is_never_called(monkeypatch):
    monkeypatch.setattr(cpu, "small_linear", lambda x, w: pytest.fail("the kernel ran while switched off"))
    with cpu.enabled(False):
        Engine.from_pretrained("tiny-mixtral", device="cpu", placement="cpu").generate([[1, 2, 3]], 3)


@needs_kernel
def test_linear_is_f_linear_beyond_max_rows_and_the_kernel_within():
    """The drop-in for F.linear (attention's projections, the LM head): any leading shape, a bias;
    bitwise F.linear beyond MAX_ROWS rows (a prefill's numerics are torch's), within 1e-5 of float64
    up to it."""
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    for shape in ((1, 1, 24), (2, 3, 24), (1, cpu.MAX_ROWS + 1, 24), (cpu.MAX_ROWS + 3, 24)):
        x = torch.randn(*shape, generator=g)
        for bias in (None, b):
            y = cpu.linear(x, w, bias)
            assert y.shape == (*shape[:-1], 40)
            if x.numel() // 24 > cpu.MAX_ROWS:
                assert torch.equal(y, F.linear(x, w, bias))
            else:
                exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
                assert (y.double() - exact).abs().max() <= 1e-5 * exact.abs().max()


@needs_kernel
def test_a_decode_step_runs_attention_and_the_head_through_the_kernel(monkeypatch):
    """Every dense projection of a decode step on the CPU (q, k, v, o per layer, the LM head) is the
    kernel's: the step's weights read on every thread, not only the experts'."""
    eng = Engine.from_pretrained("tiny-mixtral", device="cpu", placement="cpu")
    sess = eng.new_session(1)
    tok = eng.prefill(sess, [[1, 2, 3, 4]]).argmax(-1).tolist()
    cpu.available()
    real, seen = cpu._fast["ops"], []

    class Counting:
        def __getattr__(self, name):
            op = getattr(real, name)
            return lambda *a: seen.extend((name, tuple(w.shape)) for w in (a[1] if name == "linears" else [a[1]])) \
                or op(*a)
    monkeypatch.setitem(cpu._fast, "ops", Counting())
    eng.decode_step(sess, tok)
    cfg = eng.cfg
    dense = [s for name, s in seen if name in ("linear", "linears")]
    assert len(dense) == 4 * cfg.num_layers + 1 and (cfg.vocab_size, cfg.hidden_size) in dense


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linears_are_linear_on_each_weight_bit_for_bit(dtype, threads):
    """A layer's projections in one parallel job: each output as `linear` computes it, at any batch
    (BLAS above MAX_ROWS, as `linear`) and thread count."""
    g = torch.Generator().manual_seed(2)
    ws = tuple(torch.randn(o, 96, generator=g).to(dtype) for o in (130, 32, 32))
    for n in (1, 3, cpu.MAX_ROWS + 1):
        x = torch.randn(2, n, 96, generator=g).to(dtype)[:1]
        for th in (1, 2):
            torch.set_num_threads(th)
            got = cpu.linears(x, ws)
            assert all(torch.equal(y, cpu.linear(x, w)) for y, w in zip(got, ws)), (n, th)
