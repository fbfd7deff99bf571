"""The implementation protocol: what the judge needs from an accumulator under test.

An implementation is named by a factory spec, ``module:attr`` (an import path; the working
directory is importable, as with ``python -m``) or ``path/to/file.py:attr``. The factory is
called as ``make(dtype, loss_scale)`` with a ``torch.dtype`` work dtype and a float loss scale
and returns a fresh accumulator with ``wacc_torch``'s public API (:class:`Accumulator`).
``state.fused`` declares the evaluation order the implementation claims: ``False`` is the
reproducible order (judged bit for bit), ``True`` the opt-in one-pass mode of the semantics' §6
(judged per element against the accepted set). A ``state`` without ``fused`` (the seed API's
state has none: the fused mode is an extension) is judged in the reproducible order.

Optional features (:mod:`wacc.judge.contract` declares them: the core ones, each reported as
``unsupported: <feature>`` when missing, a failure unless allowed with ``--allow-missing
FEATURE``; the extensions, each reported as ``not judged: <feature> (...)``, a failure never):

* ``records``: ``state_dict()`` and ``load_state_dict(record, module)`` (checkpoint and resume);
* ``async_records``: ``state_dict_async()`` returning an object with ``.result()``;
* ``checksum``: records that refuse a changed value, found by the probe of
  :mod:`wacc.judge.integrity` (for the documented layout, a verified ``checksum`` field); judged
  only for an implementation with records, and without it the corruptions only an integrity check
  can refuse are skipped;
* ``found_inf``: a bool ``found_inf`` on every finished result (semantics §7), found by
  finishing the probe's empty window; judged against the result's own gradients;
* ``set_loss_scale``: ``set_loss_scale(loss_scale)`` on the accumulator (semantics §13);
* ``loss_scaler``: the window loss scaler of dynamic-scaling scenarios, the factory's attribute
  ``loss_scaler``: called as ``loss_scaler(dtype, init_scale, **options)`` with the options of
  :class:`wacc_ref.scenario.ScalerOptions`, it returns an object with ``wacc_torch``'s
  ``WindowLossScaler`` API (``scale``, ``update(found_inf)``, ``state_dict()``,
  ``load_state_dict(state)``). The three ``wacc_torch`` factories have it.

Errors are judged by class: an exception counts as the §11 error ``RecordError`` (etc.) when it
is that ``wacc_torch`` class or a subclass, or when a class of that name is in its MRO, so an
implementation need not import ``wacc_torch`` to raise the right error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from wacc.choices import DEFAULT_IMPL, FEATURES
from wacc.errors import UsageError
from wacc.judge.contract import CONTRACT, Coverage, not_judged_line, unsupported_line
from wacc.judge.exceptions import exception_text
from wacc.judge.integrity import IntegrityProbe, probe_integrity
from wacc.spec import import_target
from wacc_ref.scenario import Scenario, without_interruptions

__all__ = [
    "CORE_METHODS",
    "DEFAULT_IMPL",
    "FEATURES",
    "FEATURE_METHODS",
    "SEMANTICS_ERRORS",
    "Accumulator",
    "Factory",
    "Implementation",
    "error_class",
    "load_implementation",
]


CORE_METHODS: tuple[str, ...] = ("accumulate_sum", "accumulate_mean", "finish_sums", "finish_mean")
# feature -> the methods it needs (checksum needs records, and the probe decides it)
FEATURE_METHODS: Mapping[str, tuple[str, ...]] = {
    "records": ("state_dict", "load_state_dict"),
    "async_records": ("state_dict_async",),
    "set_loss_scale": ("set_loss_scale",),
}
# The semantics' error classes, most specific first (the base class last).
SEMANTICS_ERRORS: tuple[str, ...] = (
    "InvalidLossScaleError",
    "InvalidWeightError",
    "ParameterMismatchError",
    "ZeroTotalWeightError",
    "RecordError",
    "WeightedAccumulationError",
)


@runtime_checkable
class Accumulator(Protocol):
    """``wacc_torch.WeightedGradientsAccumulator``'s public API, as the judge calls it."""

    def accumulate_sum(
        self, module: nn.Module, weight: float, *, grads: Mapping[str, Any] | None = None
    ) -> None: ...

    def accumulate_mean(
        self, module: nn.Module, weight: float, *, grads: Mapping[str, Any] | None = None
    ) -> None: ...

    def finish_sums(self) -> Any: ...

    def finish_mean(self) -> Any: ...

    @property
    def state(self) -> Any: ...


Factory = Callable[[torch.dtype, float], Any]


def error_class(exc: BaseException) -> str | None:
    """The §11 error class name ``exc`` counts as, or None when it is not an error of §11."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    for name in SEMANTICS_ERRORS:
        if name in names:
            return name
    return None


@dataclass(frozen=True)
class Implementation:
    """A loaded implementation: its spec, its factory, and what the probe instance showed."""

    spec: str
    factory: Factory
    fused: bool
    missing: tuple[str, ...]  # features the probe instance lacks
    integrity: IntegrityProbe | None = None  # what the integrity probe saw (None: not probed)

    def make(self, dtype: torch.dtype, loss_scale: float) -> Any:
        """A fresh accumulator (the factory's exceptions propagate)."""
        return self.factory(dtype, loss_scale)

    def make_scaler(self, dtype: torch.dtype, init_scale: float, **options: Any) -> Any:
        """A fresh window loss scaler (feature ``loss_scaler``; its exceptions propagate)."""
        return self.factory.loss_scaler(dtype, init_scale, **options)  # type: ignore[attr-defined]

    def supports(self, feature: str) -> bool:
        """Whether the implementation has ``feature`` (its methods; for checksum, the probe's)."""
        return feature not in self.missing

    def coverage(self, allowed: Iterable[str] = ()) -> Coverage:
        """What a command judges of this implementation with ``allowed`` features allowed to be
        missing (:class:`wacc.judge.contract.Coverage`: the one decision of every command)."""
        return Coverage(missing=self.missing, allowed=tuple(allowed))

    def _missing_text(self, name: str) -> str:
        """What missing ``name`` means for the judge (for checksum: what the probe saw)."""
        if name == "checksum" and self.integrity is not None:
            return (
                f"{self.integrity.describe()}, so the corruptions only such a check can refuse "
                f"({', '.join(self.integrity.kinds)}) are not judged"
            )
        return FEATURES[name]

    def unsupported(self, feature: str, *, flag: str = "--allow-missing") -> str:
        """One line: ``unsupported: <feature>``, what that means for the judge, and its flag."""
        return unsupported_line(feature, flag=flag, what=self._missing_text(feature))

    def not_judged(self, name: str, *, flag: str = "--allow-missing") -> str:
        """One line: ``not judged: <feature> (<why it fails nothing>): <what is not judged>``."""
        return not_judged_line(name, flag=flag, what=self._missing_text(name))

    def judgeable(self, scenario: Scenario) -> Scenario | None:
        """``scenario`` as this implementation is judged on it: as it is, or without its
        checkpoints and restores when the implementation has no records (so the missing feature
        is reported once, not as a failure of every scenario that checkpoints: what ``wacc
        check`` generates for it); None when a step needs a missing feature that cannot be
        taken out (:meth:`wacc.judge.contract.Coverage.lacking`): the scenario is not judged."""
        if self.coverage().lacking(ops=(step.op for step in scenario.steps)):
            return None
        return scenario if self.supports("records") else without_interruptions(scenario)

    def coverage_lines(
        self, allowed: Iterable[str] = (), *, flag: str = "--allow-missing"
    ) -> list[str]:
        """Every line a command prints about missing features: ``unsupported: ...`` for each that
        fails it, then ``not judged: ...`` for each that does not."""
        coverage = self.coverage(allowed)
        return [self.unsupported(n, flag=flag) for n in coverage.unsupported] + [
            self.not_judged(n, flag=flag) for n in coverage.not_judged
        ]


def _import_target(spec: str) -> Any:
    target = import_target(spec)  # the one import rule (wacc.spec)
    if not callable(target):
        raise UsageError(f"{spec!r} is not callable (a factory make(dtype, loss_scale))")
    return target


def _reports_found_inf(probe: Any) -> bool:
    """Whether finishing the probe's empty window (allowed: semantics §7) gives a result with a
    bool ``found_inf``; a finish that raises is judged by the run, not here."""
    try:
        result = probe.finish_sums()
        # (a found_inf property that raises: getattr's default covers AttributeError alone)
        return isinstance(getattr(result, "found_inf", None), bool)
    except Exception:  # the implementation under test may raise anything
        return False


def load_implementation(spec: str) -> Implementation:
    """Import the factory ``spec`` and probe one instance (float32, loss scale 1).

    Raises :class:`UsageError` (exit 2) for a bad path, a factory that raises, or an object that
    lacks a core method or a ``state``.
    """
    factory = _import_target(spec)
    try:
        probe = factory(torch.float32, 1.0)
    except Exception as exc:
        raise UsageError(
            f"factory {spec!r} raised for (torch.float32, 1.0): {exception_text(exc)}"
        ) from None
    if probe is None:  # the usual slip: a factory without its `return`
        raise UsageError(f"factory {spec!r} returned None for (torch.float32, 1.0), not an "
                         "accumulator (a missing `return`?)")  # fmt: skip
    lacking = [name for name in CORE_METHODS if not callable(getattr(probe, name, None))]
    if lacking:
        raise UsageError(f"{spec!r} made an object without {', '.join(lacking)}")
    try:
        # No `fused` field: the seed API's state has none, and the fused mode is an extension
        # (wacc.judge.contract): such an implementation is judged in the reproducible order.
        fused = getattr(probe.state, "fused", False)
    except Exception as exc:
        raise UsageError(
            f"{spec!r}: reading state.fused failed: {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(fused, bool):
        raise UsageError(f"{spec!r}: state.fused must be a bool, got {fused!r}")
    missing = tuple(
        feature
        for feature, methods in FEATURE_METHODS.items()
        if not all(callable(getattr(probe, name, None)) for name in methods)
    )
    if not _reports_found_inf(probe):
        missing += ("found_inf",)
    if not callable(getattr(factory, "loss_scaler", None)):
        missing += ("loss_scaler",)
    integrity = None
    if "records" not in missing:
        integrity = probe_integrity(factory, refusal=lambda exc: error_class(exc) is not None)
        if not integrity.has_integrity:
            missing += ("checksum",)
    missing = tuple(f.name for f in CONTRACT if f.name in missing)  # in contract order
    return Implementation(
        spec=spec, factory=factory, fused=fused, missing=missing, integrity=integrity
    )
