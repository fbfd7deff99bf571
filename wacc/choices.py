"""The names the command line offers, importable without torch or the reference.

``wacc --help``, a usage error and a path check answer from these alone, in a fraction of a
second; the commands import torch, ``wacc_ref`` and the judge only when they run. Each name
here is either the definition (``PROFILES``, ``DEFAULT_IMPL``, ``FAMILY_NAMES``,
``ORACLE_SET_NAMES``: their modules import them from here), the contract's features as the
command line names them (``FEATURES``, from :mod:`wacc.judge.contract`, as light), or a copy of a
constant of ``wacc_ref``, which cannot import ``wacc`` (``WORK_DTYPES``): :mod:`wacc.judge.engine`
checks the copy when it is imported, so a drift fails the first command that runs.
"""

from __future__ import annotations

from collections.abc import Mapping

from wacc.judge.contract import CONTRACT

__all__ = [
    "DEFAULT_IMPL",
    "FAMILY_NAMES",
    "FEATURES",
    "MACHINE",
    "ORACLE_SET_NAMES",
    "PROFILES",
    "WORK_DTYPES",
]

DEFAULT_IMPL = "wacc.implementation:wacc_torch_reproducible"

# wacc_ref.formats.WORK_DTYPES (checked by wacc.judge.engine at import)
WORK_DTYPES: tuple[str, ...] = ("float64", "float32", "float16", "bfloat16")

# The strategy families of wacc.judge.engine.FAMILIES, then the stateful machine.
MACHINE = "stateful"
FAMILY_NAMES: tuple[str, ...] = (
    "windows",
    "invalid_weights",
    "interruptions",
    "non_finite",
    "dynamic_scaling",
    "structural",
    MACHINE,
)

# --oracle choice -> what it applies (wacc.judge.verdict.ORACLE_SETS holds the oracles of each).
ORACLE_SET_NAMES: Mapping[str, str] = {
    "strict": "oracles 1-3 (bit-exact emulation, error bound, semantics)",
    "bound": "oracles 2 and 3 only, for implementations that do not claim the reproducible order",
}

# The Hypothesis profiles a user may pick (wacc.judge.profiles registers them).
PROFILES: tuple[str, ...] = ("dev", "ci", "nightly")

# feature -> what missing it means (the words of ``unsupported: <feature>``), in contract order
FEATURES: Mapping[str, str] = {feature.name: feature.missing for feature in CONTRACT}
