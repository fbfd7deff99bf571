"""The gate's files: the committed baseline and the per-shard results.

Both are JSON objects with exactly these fields::

    {"format": "wacc-gate-baseline" | "wacc-gate-results", "version": 3,
     "implementation": "<IMPL spec>", "features": ["records", ...],
     "corpus": {"seed": 0, "size": "default"},
     "profile": "ci", "hypothesis": "<version>", "shard": "K/N", "provenance": {...},
     "entries": {"<dtype>/<family>/<source>": {
         "scenarios": int, "failing": int, "max_ulps": "<float.hex>", "max_ratio": "<float.hex>",
         "milliseconds": int,
         "findings": [{"signature": str, "message": str, "replay": str | null, "steps": int}]}}}

Version 2 (wacc 0.2) added ``milliseconds`` (the measured time of the key: the JUnit time) and
made a finding an object (its signature groups failures; ``replay`` is the scenario file
written under ``--out``); a version-1 file is refused with the command that records it anew.

Version 3 (issue 33) added ``features``: the features of the contract (:mod:`wacc.judge.contract`)
the implementation had when the file was made, in contract order, each once. The gate compares them
with the judged implementation's: a feature the baseline was made with and the implementation
has lost is a regression. A version-2 file still loads, and its features are read from what it
shows (:data:`V2_INFERRED`): a version-2 gate ran the dynamic_scaling corpus keys on every
implementation and failed each scenario without ``set_loss_scale`` and ``loss_scaler``, and a
baseline records only a passing run, so a version-2 baseline with judged dynamic_scaling corpus
keys was made with both; the other features cannot be told from it and are read as absent (their
loss is not seen until the baseline is recorded anew with ``--update-baseline``).

Reading is strict (:mod:`wacc_ref.strict_json`) and every problem is a
:class:`~wacc.errors.UsageError` (exit 2) of one line naming the file, the field's path
(``entries['float32/sums/corpus'].max_ulps``) and the value, shortened. What a file may contain,
and why (each rule strict where a lenient reading could hide a corrupt or hand-edited file;
whatever :func:`write_gate_file` writes it reads back, and it checks that before writing):

* ``format`` and ``version``: the kind asked for and the JSON integer 3, or 2 (without
  ``features``; ``true`` and ``3.0``, which equal an integer in Python, are refused); a file of
  another kind is named as such first.
* ``features``: a list of feature names of the contract, in its order, none twice.
* No field missing, none unknown, no key twice in one object (``json`` would keep the last: a
  merge conflict resolved by keeping both lines would silently change the baseline).
* ``max_ulps`` and ``max_ratio``: spelled exactly as :meth:`float.hex` writes them (``inf``
  included; not ``1.8p1``, ``0X1P+0``, ``infinity`` or anything else ``float.fromhex`` would also
  read), ``>= 0``, never NaN or ``-0.0`` (maxima of absolute errors that start at +0.0), within
  float64 (``0x1.0p+1024`` is refused, not an ``OverflowError``). In a **baseline**, the metrics
  of a ``corpus`` key must be finite: ``inf`` would switch the regression check off for that key
  (``x > inf`` never holds), and a passing run never records it; a ``check`` key's metrics are
  shown, never compared, so ``inf`` is accepted there, as in results files.
* ``scenarios``, ``failing`` and ``milliseconds``: JSON integers (never ``true``), ``0 <= failing
  <= scenarios < 2**63``, ``0 <= milliseconds < 2**63``. A **baseline** records a passing run, so
  its ``failing`` is 0 everywhere (``--update-baseline`` refuses a failing run; a hand-edited
  count is refused, not ignored).
* ``findings``: one object per failing scenario of the key (so at most ``failing`` of them, none
  in a baseline), each exactly ``{"signature": str, "message": str, "replay": str or null,
  "steps": int}`` (``steps``: the scenario's length, so a group shows its shortest).
* ``shard``: ``K/N`` in ASCII digits without sign, space or leading zero (``int()`` would take
  ``"+1"``, ``" 1"`` and ``"١"``), ``1 <= K <= N``; ``1/1`` in a baseline. ``--shard`` on the
  command line follows the same rule, and results files record the shard in that spelling.
* ``corpus``: exactly ``{"seed": int, "size": str}``; ``profile``: ``"ci"``; ``implementation``
  a non-empty string; ``hypothesis`` a string; ``entries`` keys ``<work dtype>/<family>/corpus``
  or ``.../check``; ``provenance`` any JSON object (recorded, never read back) without integers too
  long for Python to read.

A foreign file (another corpus, or a baseline of another implementation without
``--allow-other-impl``) is judged by the command (:mod:`wacc.commands.gate`), also with exit 2.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from wacc.choices import WORK_DTYPES
from wacc.errors import UsageError
from wacc.gate.metrics import GATE_CORPUS, GateFinding, Metrics
from wacc.gate.shards import Shard
from wacc.judge.contract import CONTRACT
from wacc_ref.strict_json import (
    FieldError,
    check_free_json,
    expect_int,
    expect_list,
    expect_object,
    expect_str,
    field,
    item,
    loads,
    parse_hex,
    shown,
)

__all__ = [
    "BASELINE_FORMAT",
    "RESULTS_FORMAT",
    "V2_INFERRED",
    "VERSION",
    "GateFile",
    "read_gate_file",
    "write_gate_file",
]

BASELINE_FORMAT = "wacc-gate-baseline"
RESULTS_FORMAT = "wacc-gate-results"
VERSION = 3
_OLDEST_READ = 2  # a version-2 file has no features: read as V2_INFERRED says
# The features a version-2 file shows it was made with when it judged dynamic_scaling corpus keys.
V2_INFERRED: tuple[str, ...] = ("set_loss_scale", "loss_scaler")
_MAX_BYTES = 16 * 2**20
_MAX_COUNT = 2**63 - 1  # a count of scenarios; sums of a few stay printable (int's digit limit)
_TOP_FIELDS = ("format", "version", "implementation", "corpus", "profile", "hypothesis", "shard",
               "provenance", "entries", "features")  # fmt: skip
_ENTRY_FIELDS = ("scenarios", "failing", "max_ulps", "max_ratio", "milliseconds", "findings")
_FINDING_FIELDS = ("signature", "message", "replay", "steps")
_KEY = re.compile(r"([a-z0-9]+)/([a-z0-9_]+)/(?:corpus|check)")


class GateFile:
    """A baseline or a shard's results: identity fields and metrics per key (shards of one run
    share implementation, corpus and Hypothesis version: wacc.commands.gate checks it)."""

    def __init__(
        self,
        *,
        kind: str,
        implementation: str,
        entries: Mapping[str, Metrics],
        shard: str = "1/1",
        provenance: Mapping[str, Any] | None = None,
        corpus: Mapping[str, Any] | None = None,
        hypothesis: str | None = None,
        features: Sequence[str] = (),
        version: int = VERSION,
    ) -> None:
        self.kind = kind
        # the contract's features the implementation had (wacc.judge.contract); ``version`` is the
        # format the file was read in (2: features inferred, see the module docstring)
        self.features = tuple(features)
        self.version = version
        self.implementation = implementation
        self.entries = dict(entries)
        self.shard = shard
        self.provenance = dict(provenance or {})
        self.corpus = dict(corpus or GATE_CORPUS)
        # Read from the installed metadata: importing Hypothesis would slow the first answer.
        self.hypothesis = metadata.version("hypothesis") if hypothesis is None else hypothesis


def _metric(value: object, where: str, *, finite: bool) -> float:
    number = parse_hex(value, where)
    # The tool writes maxima of absolute errors that start at +0.0: never NaN, never negative.
    if math.isnan(number) or math.copysign(1.0, number) < 0:
        raise FieldError(where, f"must be >= 0 (and not -0.0), got {shown(value)}")
    if finite and math.isinf(number):
        raise FieldError(
            where,
            "must be finite in a baseline: inf would switch the regression check off for this "
            "key (a passing run never records it)",
        )
    return number


def _entry(value: object, where: str, *, key: str, kind: str) -> Metrics:
    entry = expect_object(value, where, _ENTRY_FIELDS)
    scenarios = expect_int(entry["scenarios"], field(where, "scenarios"), minimum=0,
                           maximum=_MAX_COUNT)  # fmt: skip
    failing = expect_int(entry["failing"], field(where, "failing"), minimum=0, maximum=scenarios)
    baseline = kind == BASELINE_FORMAT
    if baseline and failing:
        raise FieldError(
            field(where, "failing"),
            f"must be 0 in a baseline (only a passing run is recorded), got {shown(failing)}",
        )
    milliseconds = expect_int(entry["milliseconds"], field(where, "milliseconds"), minimum=0,
                              maximum=_MAX_COUNT)  # fmt: skip
    findings = [
        _finding(finding, item(field(where, "findings"), position))
        for position, finding in enumerate(expect_list(entry["findings"], field(where, "findings")))
    ]
    if len(findings) > failing:  # one per failing scenario: more is a corrupt or edited file
        raise FieldError(
            field(where, "findings"),
            f"{len(findings)} finding(s) for {failing} failing scenario(s): at most one each",
        )
    # Only the corpus keys are compared with the baseline (wacc.gate.compare).
    finite = baseline and key.endswith("/corpus")
    return Metrics(
        scenarios=scenarios,
        failing=failing,
        max_ulps=_metric(entry["max_ulps"], field(where, "max_ulps"), finite=finite),
        max_ratio=_metric(entry["max_ratio"], field(where, "max_ratio"), finite=finite),
        findings=findings,
        milliseconds=milliseconds,
    )


def _finding(value: object, where: str) -> GateFinding:
    finding = expect_object(value, where, _FINDING_FIELDS)
    replay = finding["replay"]
    return GateFinding(
        signature=expect_str(finding["signature"], field(where, "signature")),
        message=expect_str(finding["message"], field(where, "message")),
        replay=None if replay is None else expect_str(replay, field(where, "replay")),
        steps=expect_int(finding["steps"], field(where, "steps"), minimum=0, maximum=_MAX_COUNT),
    )


def _gate_file(document: object, *, kind: str) -> GateFile:
    """The :class:`GateFile` a parsed document holds; :class:`FieldError` for anything else."""
    top = expect_object(document, "")
    # Format and version first: a file of another kind is named as such, not by its first field.
    if top.get("format") != kind:
        raise FieldError("format", f"expected {kind!r}, got {shown(top.get('format'))}")
    version = top.get("version")
    if type(version) is int and 0 < version < _OLDEST_READ:
        raise FieldError(
            "version",
            f"{version} is the format of an older wacc (this one reads {VERSION}): record it "
            "anew (`wacc gate --update-baseline` for a baseline, the shard's run for results)",
        )
    if type(version) is not int or not _OLDEST_READ <= version <= VERSION:  # not true, not 3.0
        raise FieldError("version", f"expected {VERSION}, got {shown(version)}")
    expect_object(top, "", _TOP_FIELDS if version == VERSION else _TOP_FIELDS[:-1])
    implementation = expect_str(top["implementation"], "implementation")
    if not implementation:
        raise FieldError("implementation", "must name the implementation, got ''")
    corpus = expect_object(top["corpus"], "corpus", ("seed", "size"))
    expect_int(corpus["seed"], "corpus.seed")
    expect_str(corpus["size"], "corpus.size")
    expect_str(top["profile"], "profile", choices=("ci",))
    hypothesis = expect_str(top["hypothesis"], "hypothesis")
    shard_text = expect_str(top["shard"], "shard")
    try:
        shard = Shard.parse(shard_text)
    except ValueError as exc:
        raise FieldError("shard", str(exc)) from None
    if kind == BASELINE_FORMAT and shard.count != 1:
        raise FieldError(
            "shard", f"must be '1/1' in a baseline (a whole run), got {shown(shard_text)}"
        )
    provenance = expect_object(top["provenance"], "provenance")
    check_free_json(provenance, "provenance")
    entries: dict[str, Metrics] = {}
    for key, value in expect_object(top["entries"], "entries").items():
        where = item("entries", key)
        match = _KEY.fullmatch(key)
        if match is None or match[1] not in WORK_DTYPES:
            raise FieldError(where, "not a <work dtype>/<family>/corpus|check key")
        entries[key] = _entry(value, where, key=key, kind=kind)
    if version == VERSION:
        features = _features(top["features"])
    else:  # version 2: what its entries show (module docstring)
        judged = any(k.endswith("/dynamic_scaling/corpus") and m.scenarios
                     for k, m in entries.items())  # fmt: skip
        features = V2_INFERRED if judged else ()
    return GateFile(
        kind=kind,
        implementation=implementation,
        entries=entries,
        shard=str(shard),
        provenance=provenance,
        corpus=corpus,
        hypothesis=hypothesis,
        features=features,
        version=version,
    )


def _features(value: object) -> tuple[str, ...]:
    names = [
        expect_str(name, item("features", position), choices=tuple(f.name for f in CONTRACT))
        for position, name in enumerate(expect_list(value, "features"))
    ]
    ordered = tuple(f.name for f in CONTRACT if f.name in names)
    if tuple(names) != ordered:  # one spelling per set: a hand edit or a merge shows
        raise FieldError("features", f"must list each feature once, in contract order {ordered}")
    return ordered


def read_gate_file(path: Path, *, kind: str) -> GateFile:
    """Read and validate a gate file of ``kind`` (baseline or results): :class:`UsageError`
    naming the file, the field and the value for anything that breaks the rules above."""
    from wacc.commands._common import read_bounded

    name = str(path)
    if not path.exists():
        raise UsageError(
            f"no gate file at {name!r} (create a baseline with `wacc gate --update-baseline`)"
        )
    data = read_bounded(path, _MAX_BYTES, what="a gate file")
    try:
        return _gate_file(loads(data), kind=kind)
    except FieldError as exc:
        raise UsageError(f"{name!r}: {exc}") from None


def write_gate_file(gate_file: GateFile, path: Path) -> Path:
    """Write ``gate_file`` as JSON (keys sorted, floats as hex)."""
    document = {
        "format": gate_file.kind,
        "version": VERSION,
        "implementation": gate_file.implementation,
        "features": list(gate_file.features),
        "corpus": gate_file.corpus,
        "profile": "ci",
        "hypothesis": gate_file.hypothesis,
        "shard": gate_file.shard,
        "provenance": gate_file.provenance,
        "entries": {
            key: {
                "scenarios": m.scenarios,
                "failing": m.failing,
                "max_ulps": m.max_ulps.hex(),
                "max_ratio": m.max_ratio.hex(),
                "milliseconds": m.milliseconds,
                "findings": [
                    {
                        "signature": f.signature,
                        "message": f.message,
                        "replay": f.replay,
                        "steps": f.steps,
                    }  # fmt: skip
                    for f in m.findings
                ],
            }
            for key, m in sorted(gate_file.entries.items())
        },
    }
    text = json.dumps(document, indent=1, sort_keys=True) + "\n"
    try:  # what the tool writes, it reads back: checked before anything is written
        _gate_file(loads(text), kind=gate_file.kind)
    except FieldError as exc:
        raise UsageError(f"not writing {str(path)!r}: it could not be read back: {exc}") from None
    # Atomically: the whole file, synced, replaces the old one (a committed baseline is never
    # left half written by a kill or a full disk); the temporary file is in the same folder, so
    # that os.replace is a rename within one file system.
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with temporary.open("w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise UsageError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None
    return path
