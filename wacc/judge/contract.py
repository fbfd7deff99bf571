"""The contract in one place: the features an implementation must have and those it may have.

The **core** is the seed API (``shared/seeds/weighted_gradients_accumulator_api.txt``, semantics
§3-§9): sums, means, finish, a loss scale fixed at setup, records with asynchronous readback, and
a validated restore with an integrity check. The core methods (``accumulate_sum``,
``accumulate_mean``, ``finish_sums``, ``finish_mean``, ``state``) are required outright; the core
*features* below (``records``, ``async_records``, ``checksum``) may be missing, and each missing
one fails a command unless ``--allow-missing FEATURE`` names it.

The **extensions** are this project's additions, which the seed API leaves out (semantics §12
Reading "features: core and extensions"): dynamic loss scaling (semantics §13: ``found_inf``,
``set_loss_scale``, ``loss_scaler``), and the fused one-pass mode of §6, which an implementation
declares with ``state.fused`` (it is judged when declared, and an implementation that does not
declare it is judged in the reproducible order: nothing goes unjudged). A missing extension
feature fails nothing, without any flag: every command reports it as ``not judged: <feature>
(...)`` and runs none of the steps, families and corpus keys that need it.

Every command (``check``, ``replay``, ``gate``, ``report``, the pytest plugin) reads an
implementation's features with :func:`wacc.judge.implementation.load_implementation` and decides
with :class:`Coverage`. Light at import (no torch, no reference): :mod:`wacc.choices` builds the
command line from it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "CONTRACT",
    "CORE",
    "EXTENSIONS",
    "Coverage",
    "Feature",
    "feature",
    "features_missing",
    "needed_by",
    "not_judged_line",
    "unsupported_line",
]

CORE = "core"

# extension -> what it is, and why it is not required (the words of "not judged: ...")
EXTENSIONS: Mapping[str, str] = {
    "dynamic loss scaling": "semantics §13; the seed API fixes the loss scale at setup and "
    "advances no dynamic scaler",
    "fused mode": "semantics §6; declared by state.fused, judged when declared",
}


@dataclass(frozen=True)
class Feature:
    """One feature of the contract: its name, where it belongs (:data:`CORE` or an extension of
    :data:`EXTENSIONS`), what missing it means, and what cannot run without it: strategy
    families (``wacc check`` skips them; the gate and the report skip their corpus scenarios and
    keys) and scenario steps (by ``op``; a scenario that has one is not judged)."""

    name: str
    part: str
    missing: str  # what missing it means for the judge (one line)
    families: tuple[str, ...] = ()
    steps: tuple[str, ...] = ()

    @property
    def core(self) -> bool:
        """Whether the feature belongs to the core (a missing one fails unless allowed)."""
        return self.part == CORE

    @property
    def why(self) -> str:
        """Why it may be missing: the core's ``--allow-missing``, or the extension's reason."""
        if self.core:
            return f"core, allowed with --allow-missing {self.name}"
        return f"the {self.part} extension, {EXTENSIONS[self.part]}"


# The order is the order of every listing (unsupported lines, not-judged lines, baselines).
CONTRACT: tuple[Feature, ...] = (
    Feature(
        "records",
        CORE,
        "no state_dict / load_state_dict, so checkpoint steps are not run",
        # Scenarios are judged without their checkpoints and restores (as they are generated
        # for such an implementation), not skipped: the rest of them is judged.
    ),
    Feature(
        "async_records",
        CORE,
        "no state_dict_async, so asynchronous checkpoints are taken synchronously",
    ),
    Feature("checksum", CORE, "records without an integrity check"),
    Feature(
        "found_inf",
        "dynamic loss scaling",
        "finished results without found_inf, so an overflowing window cannot be skipped "
        "(dynamic loss scaling) and found_inf is not judged",
    ),
    Feature(
        "set_loss_scale",
        "dynamic loss scaling",
        "no set_loss_scale, so the loss scale cannot change between windows and the "
        "dynamic_scaling scenarios are not run",
        families=("dynamic_scaling",),
        steps=("set_loss_scale",),
    ),
    Feature(
        "loss_scaler",
        "dynamic loss scaling",
        "no window loss scaler (the factory's loss_scaler attribute), so the dynamic_scaling "
        "scenarios (their update_scaler steps) are not run",
        families=("dynamic_scaling",),
        steps=("update_scaler",),
    ),
)
_BY_NAME: Mapping[str, Feature] = {f.name: f for f in CONTRACT}


def feature(name: str) -> Feature:
    """The feature ``name`` (``KeyError`` for a name not in the contract)."""
    return _BY_NAME[name]


def features_missing(present: Iterable[str]) -> tuple[str, ...]:
    """The features of the contract not in ``present``, in contract order."""
    have = set(present)
    return tuple(f.name for f in CONTRACT if f.name not in have)


def unsupported_line(name: str, *, flag: str = "--allow-missing", what: str | None = None) -> str:
    """``unsupported: <feature>: <what missing it means> (allow with <flag> <feature>)``: a
    missing core feature, a failure (``what``: the words for this implementation, if known)."""
    return f"unsupported: {name}: {what or feature(name).missing} (allow with {flag} {name})"


def not_judged_line(name: str, *, flag: str = "--allow-missing", what: str | None = None) -> str:
    """``not judged: <feature> (<why that fails nothing>): <what is not judged>``."""
    part = feature(name)
    why = f"allowed with {flag} {name}" if part.core else part.why
    return f"not judged: {name} ({why}): {what or part.missing}"


def needed_by(*, family: str | None = None, ops: Iterable[str] = ()) -> tuple[str, ...]:
    """The features a family or a scenario's steps (their ``op``) cannot run without, in
    contract order (records excepted: its steps are taken out, not refused)."""
    wanted = set(ops)
    return tuple(f.name for f in CONTRACT if (family in f.families) or (wanted & set(f.steps)))


@dataclass(frozen=True)
class Coverage:
    """What a command judges of an implementation that lacks ``missing``, with ``allowed`` the
    features ``--allow-missing`` names: the one decision every command takes."""

    missing: tuple[str, ...]
    allowed: tuple[str, ...] = ()

    @property
    def present(self) -> tuple[str, ...]:
        """The features of the contract the implementation has, in contract order."""
        return tuple(f.name for f in CONTRACT if f.name not in self.missing)

    @property
    def unsupported(self) -> tuple[str, ...]:
        """The missing core features not allowed: each fails the command."""
        return tuple(n for n in self.missing if feature(n).core and n not in self.allowed)

    @property
    def not_judged(self) -> tuple[str, ...]:
        """The missing features that fail nothing: every extension, and the allowed core."""
        return tuple(n for n in self.missing if n not in self.unsupported)

    def judges_family(self, family: str) -> bool:
        """Whether ``family`` can run (no feature it needs is missing)."""
        return not set(needed_by(family=family)) & set(self.missing)

    def lacking(self, *, family: str | None = None, ops: Iterable[str] = ()) -> tuple[str, ...]:
        """The missing features a family or a scenario's steps need (empty: it is judged)."""
        return tuple(n for n in needed_by(family=family, ops=ops) if n in self.missing)

    @property
    def skipped_families(self) -> tuple[str, ...]:
        """The strategy families that cannot run, in contract order."""
        return tuple(
            dict.fromkeys(family for name in self.missing for family in feature(name).families)
        )
