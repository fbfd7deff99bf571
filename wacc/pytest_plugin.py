"""The pytest plugin (entry point ``pytest11``): ``pytest --wacc-impl module:attr``.

With ``--wacc-impl`` the run gains one test per work dtype and strategy family (and the stateful
machine), named ``wacc::check[<impl>-<dtype>-<family>]``: the same property suite as
``wacc check``, judged with the same oracles, inside the user's own test run and CI. A failing
item shows the shrunk scenario's failure lines and the ``wacc replay`` command for the JSON it
wrote under ``--wacc-out``. Without ``--wacc-impl`` the plugin adds nothing.

Options: ``--wacc-dtype D`` (repeatable; default all four), ``--wacc-device cpu|cuda``,
``--wacc-oracle strict|bound``, ``--wacc-examples N`` (per dtype and family; default the
Hypothesis profile's), ``--wacc-profile P`` (default ``ci``), ``--wacc-allow-missing FEATURE``,
``--wacc-out DIR`` (default ``wacc-check``).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest

from wacc.errors import UsageError
from wacc.implementation import FEATURES, Implementation, load_implementation
from wacc.profiles import PROFILES
from wacc.verdict import ORACLE_SETS
from wacc_ref import formats

__all__ = ["WaccCheckItem", "pytest_addoption", "pytest_collection_modifyitems"]


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register the ``--wacc-*`` options."""
    group = parser.getgroup("wacc", "judge a gradient accumulator against the wacc reference")
    group.addoption("--wacc-impl", metavar="IMPL", help="factory module:attr or file.py:attr")
    group.addoption("--wacc-dtype", action="append", choices=formats.WORK_DTYPES, metavar="D")
    group.addoption("--wacc-device", default="cpu", choices=("cpu", "cuda"))
    group.addoption("--wacc-oracle", default="strict", choices=tuple(ORACLE_SETS))
    group.addoption("--wacc-examples", type=int, metavar="N")
    group.addoption("--wacc-profile", default="ci", choices=PROFILES)
    group.addoption("--wacc-allow-missing", action="append", default=[], choices=tuple(FEATURES))
    group.addoption("--wacc-out", default="wacc-check", metavar="DIR")


class _WaccFailure(Exception):
    """A divergence found by a wacc item (shown without a traceback)."""


class WaccCheckItem(pytest.Item):
    """One dtype x family of ``wacc check`` against the implementation under test."""

    def __init__(self, *, spec: str, dtype: str, family: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spec, self.dtype, self.family = spec, dtype, family

    def runtest(self) -> None:
        """Run the family; raise with the shrunk divergence if an oracle fails."""
        from wacc.engine import CheckConfig, Finding, run_family, write_finding

        options = self.config.option
        implementation = _implementation(self.config, self.spec)
        missing = [f for f in implementation.missing if f not in options.wacc_allow_missing]
        if missing:
            flag = "--wacc-allow-missing"
            raise _WaccFailure("\n".join(implementation.unsupported(f, flag=flag) for f in missing))
        config = CheckConfig(
            dtypes=(self.dtype,),
            device=options.wacc_device,
            profile=options.wacc_profile,
            oracles=ORACLE_SETS[options.wacc_oracle],
            examples=options.wacc_examples,
        )
        shrunk = run_family(implementation, self.dtype, self.family, config)
        if shrunk is None:
            return
        finding = Finding(dtype=self.dtype, family=self.family, verdict=shrunk)
        path = write_finding(finding, Path(options.wacc_out))
        command = shlex.join(["wacc", "replay", str(path), "--impl", self.spec])
        lines = "\n".join(f"  {line}" for line in shrunk.describe())
        raise _WaccFailure(
            f"{self.spec} diverges from the reference on {self.dtype}/{self.family} "
            f"[{', '.join(shrunk.failed_oracles)}]:\n{lines}\nreplay: {command}"
        )

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        """The divergence message alone (the traceback is the judge's, not the user's)."""
        if isinstance(excinfo.value, _WaccFailure | UsageError):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[str, int | None, str]:
        """Where pytest says the item lives."""
        return "wacc", None, self.name


class _WaccCollector(pytest.Collector):
    """The parent node of the wacc items (node id ``::wacc``)."""

    def __init__(self, *, spec: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spec = spec

    def collect(self) -> list[pytest.Item]:
        """One item per dtype and family."""
        from wacc.engine import family_names

        dtypes = self.config.option.wacc_dtype or formats.WORK_DTYPES
        return [
            WaccCheckItem.from_parent(
                self,
                name=f"check[{self.spec}-{dtype}-{family}]",
                spec=self.spec,
                dtype=dtype,
                family=family,
            )
            for dtype in dtypes
            for family in family_names()
        ]


_LOADED: dict[str, Implementation] = {}


def _implementation(config: pytest.Config, spec: str) -> Implementation:
    if spec not in _LOADED:
        _LOADED[spec] = load_implementation(spec)
    return _LOADED[spec]


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect, so they select wacc items too
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Append the wacc items when ``--wacc-impl`` is given."""
    spec = config.option.wacc_impl
    if not spec:
        return
    collector = _WaccCollector.from_parent(session, name="wacc", spec=spec)
    items.extend(collector.collect())
