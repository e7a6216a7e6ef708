"""What instrumentation costs per decode step: off (the no-op hook), NVTX ranges on, and the
in-process timeline on.

Off: the engine still calls `instrument.span(...)` at every step/layer/attention/router/
expert, so its cost is (spans per step) x (cost of one no-op span), measured here against
the decode step time -- target <= 1%. On: decode step time with NVTX / timeline attached,
as a ratio to off, all measured in this one run. Not a test:
`python benchmarks/bench_instrumentation.py [--model tiny-mixtral] [--steps 200]`.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import Engine  # noqa: E402
from engine.hooks import NULL, Instrument  # noqa: E402
from engine.nvtx_ranges import NvtxRanges  # noqa: E402
from engine.timeline import Timeline  # noqa: E402


class Counting(Instrument):
    enabled = False   # like NULL: copies are not reported

    def __init__(self) -> None:
        self.n = 0

    def span(self, kind, **attrs):
        self.n += 1
        return nullcontext()


def decode_steps(eng: Engine, steps: int) -> list[float]:
    import time
    sess = eng.new_session(1)
    tok = eng.prefill(sess, [[1, 2, 3, 4, 5, 6, 7, 8]]).argmax(-1).tolist()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tok = eng.decode_step(sess, tok).argmax(-1).tolist()
        times.append(time.perf_counter() - t0)
    sess.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-mixtral")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--placement", default="fetch")
    args = ap.parse_args()
    eng = Engine.from_pretrained(args.model, device="cpu", placement=args.placement, cache_capacity=4,
                                 max_context=args.steps + 64)
    counting = Counting()
    eng.set_instrument(counting)
    decode_steps(eng, 10)
    spans_per_step = counting.n / 10
    results = {}
    for name, inst in (("off", None), ("nvtx", NvtxRanges()), ("timeline", Timeline("cpu")), ("off again", None)):
        eng.set_instrument(inst)
        decode_steps(eng, 20)                                   # warm-up
        results[name] = statistics.median(decode_steps(eng, args.steps))
    eng.set_instrument(None)
    n = 200_000
    null_span = min(timeit.repeat(lambda: NULL.span("expert", layer=3, expert=5).__enter__(), number=n, repeat=5)) / n
    step = statistics.median([results["off"], results["off again"]])
    print(f"{args.model}, placement={args.placement}, median of {args.steps} decode steps, CPU")
    print(f"decode step (instrumentation off): {step * 1e3:.3f} ms; spans per step: {spans_per_step:.0f}; "
          f"one no-op span: {null_span * 1e9:.0f} ns")
    print(f"overhead when off: {spans_per_step * null_span / step * 100:.2f}% of a decode step (target <= 1%)")
    for name in ("nvtx", "timeline"):
        print(f"{name} on: {results[name] * 1e3:.3f} ms per step, {results[name] / step:.3f}x off")


if __name__ == "__main__":
    main()
