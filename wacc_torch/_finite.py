"""``found_inf``: whether a finished window holds a NaN or an infinity (semantics §7, §8).

A :class:`FiniteCheck` is fed the finished tensors piece by piece where the finishing pass already
reads them (the division of ``finish_mean`` adds each piece right after dividing it, while it is
in cache), and answers once, at the end, with one device synchronisation per device and dtype.

Per piece it keeps the piece's minimum and maximum (``torch.aminmax``: one read, no temporary the
size of the piece). A piece holds a non-finite element exactly when one of the two is not finite:
an infinity is the maximum (+inf) or the minimum (-inf), and a NaN propagates into both. The
answer is ``sum(x - x)`` over the kept extrema: 0 when all are finite, NaN otherwise.

Everything it writes is allocated when it is made, in the prepare phase: the extrema slots, the
differences and the 0-d sum. Feeding it and asking it only write into those (``aminmax``, ``sub``
and ``sum`` with ``out=``, over at most a few values per piece for the last two), so it can run in
a commit phase, after the division has written the buffers, without allocating.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch

from wacc_torch._work import piece_count, pieces

__all__ = ["FiniteCheck", "flag_of", "found_in", "found_inf"]

# (device, dtype of the tensor, dtype its values are judged in): the last is the tensor's own
# dtype, or a narrower one its values will be converted to (the parameter's, semantics §8).
_Key = tuple[torch.device, torch.dtype, torch.dtype]


@functools.cache  # called per piece: two finfo look-ups would cost more than the rest of add
def narrower(dtype: torch.dtype, target: torch.dtype | None) -> torch.dtype:
    """The dtype a value of ``dtype`` is judged in when it will be converted to ``target``:
    ``target`` when its range is narrower (a finite value may become ±inf there), else ``dtype``
    (the conversion keeps every finite value finite)."""
    if target is None or not target.is_floating_point:
        return dtype
    return target if torch.finfo(target).max < torch.finfo(dtype).max else dtype


class FiniteCheck:
    """Collects, piece by piece, whether tensors hold a NaN or an infinity.

    ``tensors`` are the tensors that will be added, whole or in the pieces of
    :func:`wacc_torch._work.pieces`: their slots are reserved now. ``targets``, aligned with
    them, gives for each the dtype its values will be written in (a parameter's, by ``apply_to``
    or the DDP hook), or None: a finite value that the conversion to it makes ±inf counts as an
    infinity. The conversion is monotone, so converting a piece's extrema (the slots) decides it.
    """

    def __init__(
        self,
        tensors: Iterable[torch.Tensor],
        targets: Iterable[torch.dtype | None] | None = None,
    ) -> None:
        counts: dict[_Key, int] = {}
        every = list(tensors)
        aims = [None] * len(every) if targets is None else list(targets)
        for tensor, target in zip(every, aims, strict=True):
            if tensor.numel() and not tensor.is_meta:
                key = (tensor.device, tensor.dtype, narrower(tensor.dtype, target))
                counts[key] = counts.get(key, 0) + piece_count(tensor.shape)
        self._extrema = {
            key: torch.empty((count, 2), dtype=key[1], device=key[0])
            for key, count in counts.items()
        }
        self._slots = {
            key: [(row[0], row[1]) for row in extrema.unbind(0)]
            for key, extrema in self._extrema.items()
        }
        # The extrema as written in the target dtype (itself when it is the tensor's own).
        self._judged = {
            key: e if key[2] == key[1] else torch.empty_like(e, dtype=key[2])
            for key, e in self._extrema.items()
        }
        self._differences = {key: torch.empty_like(e) for key, e in self._judged.items()}
        self._totals = {key: e.new_empty(()) for key, e in self._judged.items()}
        self._used = dict.fromkeys(self._extrema, 0)

    def add(self, tensor: torch.Tensor, target: torch.dtype | None = None) -> None:
        """Take ``tensor`` (a whole tensor or one piece of one) into the answer; ``target`` as
        given for it when the check was made."""
        device = tensor.device
        if math.prod(tensor.shape) == 0 or device.type == "meta":
            # aminmax refuses an empty tensor; a meta tensor (shape tracing) holds no values.
            # Neither has an element that is NaN or an infinity.
            return
        key = (device, tensor.dtype, narrower(tensor.dtype, target))
        index = self._used[key]
        torch.aminmax(tensor, out=self._slots[key][index])
        self._used[key] = index + 1

    def _judge(self) -> Iterable[tuple[_Key, torch.Tensor]]:
        for key, extrema in self._extrema.items():
            judged = self._judged[key]
            if judged is not extrema:
                judged.copy_(extrema)  # rounds as the conversion to the target does
            yield key, judged

    def found(self) -> bool:
        """Whether any element added was NaN or ±inf (in its target dtype)."""
        found = False
        for key, judged in self._judge():
            # Every slot is filled: each reserved piece was added (finite - finite = 0; inf - inf
            # and NaN - NaN are NaN, and a NaN makes the sum NaN).
            differences, total = self._differences[key], self._totals[key]
            torch.sub(judged, judged, out=differences)
            torch.sum(differences, dim=(0, 1), out=total)
            value = total.item()
            found = found or value != value
        return found

    def _flags(self) -> Iterable[tuple[torch.device, torch.Tensor]]:
        for (device, _, _), judged in self._judge():
            yield device, ~torch.isfinite(judged).all()


def flag_of(checks: Iterable[FiniteCheck], device: torch.device) -> torch.Tensor:
    """A 0-d int32 tensor on ``device``: 1 if any of ``checks`` found a NaN or ±inf, else 0.
    Nothing waits for the device: the flag can go straight into a collective (FSDP's MAX)."""
    flags = [flag.to(device) for check in checks for _, flag in check._flags()]
    if not flags:
        return torch.zeros((), dtype=torch.int32, device=device)
    return torch.stack(flags).any().to(torch.int32)


def found_in(checks: Iterable[FiniteCheck]) -> bool:
    """Whether any of ``checks`` found a NaN or ±inf: one synchronisation per device for all of
    them (the DDP hook checks each bucket as it is divided and asks once, at the last)."""
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for check in checks:
        for device, flag in check._flags():
            flags.setdefault(device, []).append(flag)
    return any(bool(torch.stack(found).any()) for found in flags.values())


def found_inf(
    tensors: Iterable[torch.Tensor | None], targets: Iterable[torch.dtype | None] | None = None
) -> bool:
    """Whether any element of the given tensors (None entries skipped) is NaN or ±inf (in its
    target dtype, aligned with ``tensors``, when given: :class:`FiniteCheck`): one read of each,
    piece by piece, and one synchronisation per device and dtype."""
    every = list(tensors)
    aims = [None] * len(every) if targets is None else list(targets)
    present = [(t, aim) for t, aim in zip(every, aims, strict=True) if t is not None]
    check = FiniteCheck([t for t, _ in present], [aim for _, aim in present])
    for tensor, aim in present:
        for (piece,) in pieces(tensor):
            check.add(piece, aim)
    return check.found()
