"""The pytest plugin (entry point ``pytest11``): ``pytest --wacc-impl module:attr``.

With ``--wacc-impl`` (or the ini key ``wacc_impl``) the run collects one test item per work
dtype and strategy family (and the stateful machine), with the node id
``::wacc::check[<impl>-<dtype>-<family>]``: the same property suite as ``wacc check``, judged
with the same oracles, inside the user's own test run and CI. The items are collected like any
test (``collected N items`` counts them, ``-k``, ``--lf`` and ``--collect-only`` see them), and
their node ids do not change between runs, so ``--lf`` reruns only the failed ones. A failing
item shows the shrunk scenario's failure lines and the ``wacc replay`` command for the JSON it
wrote under ``--wacc-out``. Without an implementation the plugin adds nothing.

Features are judged as ``wacc check`` judges them (:mod:`wacc.judge.contract`): a missing core
feature fails every item unless ``--wacc-allow-missing`` names it; an item whose family needs a
missing extension feature (dynamic_scaling without ``set_loss_scale`` or ``loss_scaler``) is skipped
with the ``not judged: ...`` line, and the terminal summary lists every feature not judged.

Options, each also an ini key (``--wacc-dtype`` -> ``wacc_dtype``; the command line wins):
``--wacc-impl IMPL``, ``--wacc-dtype D`` (repeatable, ini: one per line; default all four),
``--wacc-device cpu|cuda``, ``--wacc-oracle strict|bound``, ``--wacc-examples N`` (per dtype and
family; default the Hypothesis profile's), ``--wacc-profile P`` (default ``ci``),
``--wacc-seed N`` (the Hypothesis seed, as ``wacc check --seed``), ``--wacc-allow-missing
FEATURE``, ``--wacc-out DIR`` (default ``wacc-check``). A relative ``file.py`` IMPL or ``DIR``
given in an ini file is relative to that file's directory, as pytest's own path keys are.

A bad value is a usage error before collection, as pytest's own are: ``ERROR: <one line>``,
exit 4 (a ``DIR`` that is a file, or lies under one, included). The IMPL's shape, its file or
module are checked without importing it (nor torch, unless ``cuda`` is asked for): importing
happens when the first item runs.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from wacc.choices import FAMILY_NAMES, FEATURES, ORACLE_SET_NAMES, PROFILES, WORK_DTYPES
from wacc.commands._common import check_out_folder
from wacc.errors import UsageError
from wacc.spec import check_spec

if TYPE_CHECKING:
    from wacc.judge.implementation import Implementation

__all__ = [
    "WaccCheckItem",
    "WaccSettings",
    "pytest_addoption",
    "pytest_make_collect_report",
    "pytest_report_header",
    "pytest_sessionstart",
    "pytest_terminal_summary",
]

_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class _Option:
    """One ``--wacc-<name>`` option and its ini key ``wacc_<name>``."""

    name: str
    help: str
    metavar: str
    repeatable: bool = False

    @property
    def flag(self) -> str:
        return "--wacc-" + self.name.replace("_", "-")

    @property
    def key(self) -> str:
        return "wacc_" + self.name


def _choices(names: Sequence[str]) -> str:
    return ", ".join(names)


_OPTIONS = (
    _Option("impl", "the implementation's factory, module:attr or path/file.py:attr", "IMPL"),
    _Option(
        "dtype",
        f"work dtype to check ({_choices(WORK_DTYPES)}); repeatable (default: all)",
        "D",
        repeatable=True,
    ),
    _Option("device", f"device the scenarios run on ({_choices(_DEVICES)}; default: cpu)", "DEV"),
    _Option(
        "oracle",
        "oracles to apply: "
        + "; ".join(f"{name}: {what}" for name, what in ORACLE_SET_NAMES.items())
        + " (default: strict)",
        "SET",
    ),
    _Option("examples", "examples per dtype and family, >= 1 (default: the profile's)", "N"),
    _Option("profile", f"Hypothesis profile ({_choices(PROFILES)}; default: ci)", "P"),
    _Option("seed", "Hypothesis seed: the same seed, the same run (as wacc check --seed)", "N"),
    _Option(
        "allow_missing",
        f"a feature the implementation may lack ({_choices(tuple(FEATURES))}); repeatable",
        "FEATURE",
        repeatable=True,
    ),
    _Option("out", "where shrunk divergences go (default: ./wacc-check)", "DIR"),
)


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register the ``--wacc-*`` options and their ini keys ``wacc_*``."""
    group = parser.getgroup("wacc", "judge a gradient accumulator against the wacc reference")
    for option in _OPTIONS:
        ini = "ini key " + option.key
        if option.repeatable:
            group.addoption(
                option.flag,
                action="append",
                dest=option.key,
                metavar=option.metavar,
                help=f"{option.help}; {ini} (one per line)",
            )
            parser.addini(option.key, f"{option.help}; one per line", type="linelist")
        else:
            group.addoption(
                option.flag,
                dest=option.key,
                metavar=option.metavar,
                help=f"{option.help}; {ini}",
            )
            parser.addini(option.key, option.help, type="string", default="")


@dataclass(frozen=True)
class WaccSettings:
    """The plugin's options, from the command line or else the ini file, checked."""

    spec: str  # as written: the node ids name it
    load: str  # what is imported (a relative file of an ini key: against the ini file's dir)
    dtypes: tuple[str, ...]
    device: str = "cpu"
    oracle: str = "strict"
    profile: str = "ci"
    seed: int | None = None
    examples: int | None = None
    allow_missing: tuple[str, ...] = ()
    out: Path = Path("wacc-check")


_SETTINGS = pytest.StashKey[WaccSettings | None]()


def _raw(config: pytest.Config, option: _Option) -> tuple[Any, str, Path | None]:
    """The option's value, who gave it (for messages) and the directory a relative path in it
    is relative to (None: the working directory); a value of None when neither gave it."""
    value = config.getoption(option.key)
    if value is not None:
        return value, option.flag, None
    value = config.getini(option.key)
    if value in ("", [], None):
        return None, option.flag, None
    base = config.inipath.parent if config.inipath is not None else None
    return value, f"ini key {option.key}", base


def _one_of(value: Any, names: Sequence[str], what: str, source: str) -> str:
    if str(value) not in names:
        raise pytest.UsageError(
            f"{source}: unknown {what} {value!r} (choose from {_choices(names)})"
        )
    return str(value)


def _integer(value: Any, source: str, *, minimum: int | None = None) -> int:
    try:
        number = int(str(value).strip())
    except ValueError:
        raise pytest.UsageError(f"{source} must be an integer, got {value!r}") from None
    if minimum is not None and number < minimum:
        raise pytest.UsageError(f"{source} must be >= {minimum}, got {number}")
    return number


def _relative_to(base: Path | None, location: str) -> str:
    if base is None or Path(location).is_absolute():
        return location
    return str(base / location)


def _module_found(location: str) -> bool:
    """Whether ``import location`` would find it, importing at most its parent packages."""
    # As wacc.judge.implementation loads it: like ``python -m``, the working directory is on the
    # path.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.util.find_spec(location) is not None
    except (ImportError, ValueError):
        return False


def _implementation_spec(spec: str, source: str, base: Path | None) -> str:
    """The spec to load; :class:`pytest.UsageError` when it is malformed or names a file or a
    module that does not exist (nothing of the implementation is imported)."""
    load = spec
    if spec.count(":") == 1 and spec.split(":")[0].endswith(".py"):
        location, attr = spec.split(":")
        load = f"{_relative_to(base, location)}:{attr}"
    try:
        location, _ = check_spec(load)
    except UsageError as exc:
        raise pytest.UsageError(f"{source}: {exc}") from None
    if not location.endswith(".py") and not _module_found(location):
        raise pytest.UsageError(f"{source}: implementation {spec!r}: no module named {location!r}")
    return load


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _settings(config: pytest.Config) -> WaccSettings | None:
    """The checked settings, or None without an implementation."""
    options = {option.name: option for option in _OPTIONS}
    spec, source, base = _raw(config, options["impl"])
    if spec is None:
        return None
    load = _implementation_spec(str(spec).strip(), source, base)
    settings: dict[str, Any] = {"spec": str(spec).strip(), "load": load}

    dtypes, source, _ = _raw(config, options["dtype"])
    dtypes = dtypes or WORK_DTYPES
    settings["dtypes"] = tuple(
        dict.fromkeys(_one_of(d, WORK_DTYPES, "dtype", source) for d in dtypes)
    )
    device, source, _ = _raw(config, options["device"])
    if device is not None:
        settings["device"] = _one_of(device, _DEVICES, "device", source)
        if settings["device"] == "cuda" and not _cuda_available():
            raise pytest.UsageError(f"{source}: cuda was asked for, but torch sees no CUDA device")
    oracle, source, _ = _raw(config, options["oracle"])
    if oracle is not None:
        settings["oracle"] = _one_of(oracle, tuple(ORACLE_SET_NAMES), "oracle set", source)
    profile, source, _ = _raw(config, options["profile"])
    if profile is not None:
        settings["profile"] = _one_of(profile, PROFILES, "profile", source)
    seed, source, _ = _raw(config, options["seed"])
    if seed is not None:
        settings["seed"] = _integer(seed, source)
    examples, source, _ = _raw(config, options["examples"])
    if examples is not None:
        settings["examples"] = _integer(examples, source, minimum=1)
    allowed, source, _ = _raw(config, options["allow_missing"])
    settings["allow_missing"] = tuple(
        _one_of(feature, tuple(FEATURES), "feature", source) for feature in allowed or ()
    )
    out, source, base = _raw(config, options["out"])
    if out is not None:
        settings["out"] = Path(_relative_to(base, str(out)))
    try:  # a folder that can never be written: one line now, not a traceback per failing item
        check_out_folder(source, settings.get("out", WaccSettings.out))
    except UsageError as exc:
        raise pytest.UsageError(str(exc)) from None
    return WaccSettings(**settings)


@pytest.hookimpl(tryfirst=True)  # before the terminal's header: a usage error is one line
def pytest_sessionstart(session: pytest.Session) -> None:
    """Check the options before collection: a bad one is ``ERROR: <line>``, exit 4. An IMPL
    that names a missing attribute, does not import (a syntax error) or whose factory raises is
    a usage error too, as for ``wacc check`` (exit 2 there): it is loaded here, once, unless
    only collecting (``--collect-only`` lists the items without importing torch)."""
    settings = _settings(session.config)
    session.config.stash[_SETTINGS] = settings
    if settings is not None and not session.config.option.collectonly:
        try:
            _implementation(settings.load)
        except UsageError as exc:
            raise pytest.UsageError(f"--wacc-impl {settings.spec}: {exc}") from None


def pytest_report_header(config: pytest.Config) -> str | None:
    """What the wacc items will run, the seed included (so a run can be repeated)."""
    settings = config.stash.get(_SETTINGS, None)
    if settings is None:
        return None
    seed = "the profile's" if settings.seed is None else str(settings.seed)
    return (
        f"wacc: {settings.spec}; dtypes {', '.join(settings.dtypes)}; {settings.device}; "
        f"oracles {settings.oracle}; profile {settings.profile}; seed {seed}"
    )


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """What the wacc items did not judge, and why (a missing extension fails nothing, so this
    line is where a run says it), when the implementation was loaded."""
    settings = terminalreporter.config.stash.get(_SETTINGS, None)
    loaded = _LOADED.get(settings.load) if settings is not None else None
    if settings is None or loaded is None or isinstance(loaded, UsageError):
        return
    for feature in loaded.coverage(settings.allow_missing).not_judged:
        terminalreporter.write_line(
            f"wacc: {loaded.not_judged(feature, flag='--wacc-allow-missing')}"
        )


class _WaccFailure(Exception):
    """A divergence found by a wacc item (shown without a traceback)."""


_LOADED: dict[str, Implementation | UsageError] = {}


def _implementation(spec: str) -> Implementation:
    """The implementation, loaded once per process (a load error too: it fails every item)."""
    if spec not in _LOADED:
        from wacc.judge.implementation import load_implementation

        try:
            _LOADED[spec] = load_implementation(spec)
        except UsageError as exc:
            _LOADED[spec] = exc
    loaded = _LOADED[spec]
    if isinstance(loaded, UsageError):
        raise loaded
    return loaded


class WaccCheckItem(pytest.Item):
    """One dtype x family of ``wacc check`` against the implementation under test."""

    def __init__(self, *, settings: WaccSettings, dtype: str, family: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.settings, self.dtype, self.family = settings, dtype, family

    def runtest(self) -> None:
        """Run the family; raise with the shrunk divergence if an oracle fails."""
        from wacc.commands._common import raised_line
        from wacc.judge.engine import CheckConfig, Finding, run_family, write_finding
        from wacc.judge.verdict import ORACLE_SETS

        settings = self.settings
        implementation = _implementation(settings.load)
        coverage = implementation.coverage(settings.allow_missing)
        flag = "--wacc-allow-missing"
        if coverage.unsupported:  # a missing core feature fails unless allowed
            raise _WaccFailure(
                "\n".join(implementation.unsupported(f, flag=flag) for f in coverage.unsupported)
            )
        lacking = coverage.lacking(family=self.family)
        if lacking:  # a family that needs a missing feature is not judged: skipped, with why
            pytest.skip("; ".join(implementation.not_judged(f, flag=flag) for f in lacking))
        config = CheckConfig(
            dtypes=(self.dtype,),
            device=settings.device,
            profile=settings.profile,
            seed=settings.seed,
            oracles=ORACLE_SETS[settings.oracle],
            examples=settings.examples,
        )
        shrunk = run_family(implementation, self.dtype, self.family, config)
        if shrunk is None:
            return
        finding = Finding(dtype=self.dtype, family=self.family, verdict=shrunk)
        path = write_finding(finding, settings.out)
        command = shlex.join(["wacc", "replay", str(path), "--impl", settings.load])
        # The implementation's own exceptions, their text and file:line: what `wacc check`
        # prints under the same lines (a bare "got unexpected RuntimeError" says too little).
        raised = [raised_line(shrunk, i, message) for i, message in sorted(shrunk.messages.items())]
        lines = "\n".join(f"  {line}" for line in [*shrunk.describe(), *raised])
        raise _WaccFailure(
            f"{settings.spec} diverges from the reference on {self.dtype}/{self.family} "
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
    """The parent node of the wacc items (node id ``::wacc``), a child of the session."""

    def __init__(self, *, settings: WaccSettings, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.settings = settings

    def collect(self) -> list[pytest.Item]:
        """One item per dtype and family, each with a node id that does not change between
        runs (the one ``--lf`` reads back from the cache)."""
        items: list[pytest.Item] = []
        for dtype in self.settings.dtypes:
            for family in FAMILY_NAMES:
                name = f"check[{self.settings.spec}-{dtype}-{family}]"
                items.append(
                    WaccCheckItem.from_parent(
                        self,
                        name=name,
                        # As a string, parsed as --lf parses the ids it cached (an id built
                        # from the parent's would keep "[...]" in the name and never match).
                        nodeid=f"{self.nodeid}::{name}",
                        settings=self.settings,
                        dtype=dtype,
                        family=family,
                    )
                )
        return items

    def reportinfo(self) -> tuple[str, int | None, str]:
        """Where pytest says the collector lives."""
        return "wacc", None, self.name


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    """Add the wacc collector to what the session collects, so that its items are collected
    (and counted, selected and cached) like any test."""
    report = yield
    if isinstance(collector, pytest.Session) and report.passed:
        settings = collector.config.stash.get(_SETTINGS, None)
        if settings is not None:
            report.result.append(
                _WaccCollector.from_parent(collector, name="wacc", settings=settings)
            )
    return report
