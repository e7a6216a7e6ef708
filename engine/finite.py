"""Non-finite numbers (NaN, +inf, -inf) in weights and activations: refused, and named.

Owns: `NonFiniteError`; the cheap test of one tensor (`check_sum`, on the device, and
`nonfinite_count`: one reduction, a precise count only when it fires); the loader's verdict on
a checkpoint's weights (`BadTensor`, `refuse_bad_tensors`: one line naming the first bad tensor,
its file and its count, and how many tensors are bad in all -- engine.checkpoint gathers them as
it reads, and `scan_checkpoint` does the same for a checkpoint another engine will run); and the
run-time watch (`FiniteWatch`): every forward pass of a session leaves one device scalar, which
the engine reads in the same host read as the greedy token (`Engine.greedy`), so the check adds
no synchronisation; when it fires, the session's passes are replayed with every layer's output
checked (`LayerProbe`) to name the first layer that went non-finite.
Does not own: reading tensors (engine.checkpoint), the forward pass (engine.model), when a pass
runs (engine.engine).

Why a sum: the sum of a tensor is non-finite exactly when one of its values is (NaN and inf
propagate, inf - inf is NaN), and a sum is one pass with no temporary -- ten times cheaper than
`isfinite(x).all()` on the CPU. It can also overflow on finite values (float16 at 65504, so
float16 tensors are summed in float32; float32 and bfloat16 only past 3.4e38); a sum that is not
finite is therefore confirmed precisely before anything is refused. The scalar's finiteness is
tested on the host, after the read (`torch.isfinite` of a 0-d tensor costs more ops than the sum).
"""
from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
    from engine.kv import Session
    from engine.model import MoEModel
else:
    torch = lazy_module("torch", globals())

log = logging.getLogger(__name__)


class NonFiniteError(ValueError):
    """A weight or an activation holds NaN or inf: the message names the tensor, or the step and
    the first layer whose output went non-finite."""


def check_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum of x, a 0-d tensor on x's device (no host read): finite when every value of x is, and
    not when one is NaN or inf -- or when the sum overflowed (confirm with `nonfinite_count`)."""
    return x.sum(dtype=torch.float32) if x.dtype == torch.float16 else x.sum()


def combined(sums: list[torch.Tensor]) -> torch.Tensor:
    """One check sum for several (a prefill's micro-batches): non-finite when any of them is."""
    return sums[0] if len(sums) == 1 else torch.stack([s.float() for s in sums]).sum()


def nonfinite_count(x: torch.Tensor) -> int:
    """How many values of x are NaN or inf (0 for a tensor that is not floating point): one
    reduction, and a precise count only when that reduction is non-finite."""
    if not x.is_floating_point() or x.numel() == 0:
        return 0
    if x.dtype.itemsize == 1:                 # float8: no reductions in torch; its codes as float32
        x = x.float()
    if math.isfinite(check_sum(x).item()):
        return 0
    return int(x.numel() - torch.isfinite(x).sum())


def read_with_check(ids: torch.Tensor, total: torch.Tensor, one_read: bool | None = None) -> tuple[list[int], bool]:
    """ids [B] on the host, and whether the check sum `total` is finite. `one_read` (default: on
    CUDA) packs both into one device->host copy (float64 holds every token id exactly), so the
    check costs no synchronisation beyond the token's; on the CPU there is nothing to synchronise,
    and two reads are cheaper than packing."""
    if ids.is_cuda if one_read is None else one_read:
        *tokens, value = torch.cat((ids.double(), total.double().view(1))).tolist()
        return [int(t) for t in tokens], math.isfinite(value)
    return ids.tolist(), math.isfinite(total.item())


# --- weights --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BadTensor:
    """A checkpoint tensor with non-finite values: `count` of `numel` in `file` -- or, with
    `cast_to`, finite in the checkpoint but `count` values overflow that dtype."""

    file: str
    name: str
    count: int
    numel: int
    cast_to: str | None = None

    def describe(self) -> str:
        what = f"overflow {self.cast_to} (finite in the checkpoint)" if self.cast_to else "are NaN or inf"
        return f"tensor {self.name!r} in {self.file}: {self.count} of {self.numel} values {what}"


def refuse_bad_tensors(where: str, bad: list[BadTensor]) -> None:
    """Raise NonFiniteError naming the first bad tensor (by file, then name: the same one whoever
    reads the checkpoint, in whatever order) and how many are bad; nothing when `bad` is empty."""
    if not bad:
        return
    first = min(bad, key=lambda b: (b.file, b.name))
    more = f"; {len(bad)} tensors in all hold NaN or inf" if len(bad) > 1 else "; 1 tensor in all holds NaN or inf"
    raise NonFiniteError(f"checkpoint {where} is refused: {first.describe()}{more} (a model with NaN or inf "
                         "weights computes NaN; repair or re-export the checkpoint)")


# --- activations ----------------------------------------------------------------------------------
class _Found(Exception):
    """The probe's stop: the first non-finite output of a replay, in words."""


class LayerProbe:
    """Checks each layer's output during a diagnostic replay (`MoEModel.probe`), and the routed
    experts' input and output, so the first non-finite output is named with the block it came from."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.experts: dict[int, str] = {}        # layer -> what its routed experts did, when non-finite

    def check(self, what: str, x: torch.Tensor, layer: int | None = None) -> None:
        n = nonfinite_count(x)
        if not n:
            return
        where = what if layer is None else f"layer {layer} of {self.layers} (model.layers.{layer})"
        block = self.experts.get(layer, "") if layer is not None else ""
        raise _Found(f"{where}{block}: {n} of {x.numel()} values NaN or inf")

    def route(self, layer: int, h: torch.Tensor, out: torch.Tensor) -> None:
        """A MoE block's routed experts ran on h and gave out."""
        if layer in self.experts:
            return
        if nonfinite_count(h):
            self.experts[layer] = ", before its routed experts (their input was already non-finite)"
        elif nonfinite_count(out):
            self.experts[layer] = ", from its routed experts (finite input, non-finite output)"


@dataclass
class _Record:
    passes: list[tuple[tuple[tuple[int, ...], ...], bool]] = field(default_factory=list)   # ids [B][T], all_logits
    check: torch.Tensor | None = None      # the last pass's check sum, not read yet
    what: str = ""                         # that pass, in words


class FiniteWatch:
    """Per session: the token ids of each forward pass since the session was empty, and the last
    pass's check sum until it is read. `Engine` calls `begin` before a prefill or decode step,
    `record` for each forward pass, `pending` with the check sum once they ran, and `read` with the
    greedy token (or `settle` where the caller reads the logits itself)."""

    def __init__(self, model: MoEModel) -> None:
        self.model = model
        self._records: weakref.WeakKeyDictionary[Session, _Record] = weakref.WeakKeyDictionary()

    def begin(self, sess: Session) -> None:
        """Before a pass: an unread check of the previous one is read now (the caller read its
        logits itself, which synchronised already), and a session emptied since starts a new record."""
        rec = self._records.get(sess)
        if rec is not None and rec.check is not None:
            self.settle(sess, None)
        if sess.length == 0:
            self._records[sess] = _Record()

    def record(self, sess: Session, rows: list[list[int]], all_logits: bool) -> None:
        """One forward pass over ids `rows` [B][T] ran (what a replay runs again)."""
        self._records.setdefault(sess, _Record()).passes.append((tuple(map(tuple, rows)), all_logits))

    def pending(self, sess: Session, check: torch.Tensor, what: str) -> None:
        """The check sum of the pass(es) that just ran, unread until `read` or `settle`."""
        rec = self._records.setdefault(sess, _Record())
        rec.check, rec.what = check, what

    def read(self, sess: Session, logits: torch.Tensor) -> list[int]:
        """The greedy id per row of logits [B, V], read to the host together with the last pass's
        check sum (one host read); raises NonFiniteError when that pass went non-finite."""
        rec = self._records.get(sess)
        check = rec.check if rec is not None and rec.check is not None else check_sum(logits)
        tokens, ok = read_with_check(logits.argmax(-1), check)
        if rec is not None:
            rec.check = None
        if not ok:
            self._fired(sess, rec, logits)
        return tokens

    def settle(self, sess: Session, logits: torch.Tensor | None) -> None:
        """Read the last pass's check now (a host read); raises as `read` does."""
        rec = self._records.get(sess)
        if rec is None or rec.check is None:
            return
        check, rec.check = rec.check, None
        if not math.isfinite(check.item()):
            self._fired(sess, rec, logits)

    def _fired(self, sess: Session, rec: _Record | None, logits: torch.Tensor | None) -> None:
        """A check fired: replay the session's passes with every layer checked. The first non-finite
        output found is the error (the session is left empty: its state holds NaN); none found and
        the logits finite is a sum that overflowed on finite values -- the replay restored the
        session, and the pass stands."""
        what = rec.what if rec is not None else "a forward pass"
        bad_logits = logits is not None and nonfinite_count(logits) > 0
        found = self._replay(sess, rec) if rec is not None else None
        if found is None and not bad_logits:
            log.warning("%s: a finiteness check fired but every value is finite (a sum overflowed); the session was "
                        "replayed to check it, and its traffic is in the counters", what)
            return
        sess.close()
        if found is None:
            raise NonFiniteError(f"{what} gave {nonfinite_count(logits)} of {logits.numel()} logits NaN or inf; "
                                 "replaying the session's passes with every layer's output checked did not reproduce "
                                 "it; the session was emptied")
        raise NonFiniteError(f"{what} went non-finite; the first non-finite output is {found} (the session's passes "
                             "replayed with every layer's output checked); the session was emptied")

    def _replay(self, sess: Session, rec: _Record) -> str | None:
        """Run the recorded passes again from an empty session, eagerly, with a LayerProbe; the
        first non-finite output in words (None: every output finite, the session as it was).
        Routing listeners and the prefetcher do not hear the replay; instruments are off."""
        from engine.static_decode import instruments_off

        m = self.model
        probe = LayerProbe(len(m.layers))
        saved = m.routing_hooks, m.step_log, m.prefetcher
        passes = list(rec.passes)
        sess.close()
        m.routing_hooks, m.step_log, m.prefetcher, m.probe = [], None, None, probe
        try:
            with instruments_off(m), torch.inference_mode():
                for n, (rows, all_logits) in enumerate(passes):
                    ids = torch.tensor(rows, dtype=torch.long, device=m.device.torch_device)
                    try:
                        m.forward(ids, sess, all_logits)
                    except _Found as found:
                        return f"{found}, in pass {n + 1} of the {len(passes)} since the session began"
        finally:
            m.routing_hooks, m.step_log, m.prefetcher, m.probe = *saved, None
        return None


def describe_prefill(start: int, tokens: int, chunks: int) -> str:
    """A prefill pass in words, for the error."""
    return (f"prefill of session positions {start}-{start + tokens - 1}"
            + (f" ({chunks} micro-batches)" if chunks > 1 else ""))


def describe_decode(position: int, batch: int) -> str:
    return f"decode at session position {position}" + (f" ({batch} sequences)" if batch > 1 else "")

__all__ = ["BadTensor", "FiniteWatch", "LayerProbe", "NonFiniteError", "describe_decode", "describe_prefill",
           "check_sum", "combined", "nonfinite_count", "read_with_check", "refuse_bad_tensors"]
