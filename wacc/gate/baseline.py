"""The gate's files: the committed baseline and the per-shard results.

Both are JSON objects::

    {"format": "wacc-gate-baseline" | "wacc-gate-results", "version": 1,
     "implementation": "<factory spec>", "corpus": {"seed": 0, "size": "default"},
     "profile": "ci", "hypothesis": "<version>", "shard": "K/N" (results only),
     "provenance": {...},
     "entries": {"<dtype>/<family>/<source>": {"scenarios": int, "failing": int,
                 "max_ulps": "<float.hex>", "max_ratio": "<float.hex>", "findings": [str]}}}

Floats are ``float.hex`` strings (exact, inf included). Reading validates everything and raises
:class:`~wacc.errors.UsageError` naming the file and the problem (missing, not JSON, another
format or version, another implementation, corpus or Hypothesis version: a foreign baseline).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hypothesis import __version__ as hypothesis_version

from wacc.errors import UsageError
from wacc.gate.measure import GATE_CORPUS, Metrics

__all__ = [
    "BASELINE_FORMAT",
    "RESULTS_FORMAT",
    "VERSION",
    "GateFile",
    "read_gate_file",
    "write_gate_file",
]

BASELINE_FORMAT = "wacc-gate-baseline"
RESULTS_FORMAT = "wacc-gate-results"
VERSION = 1
_MAX_BYTES = 16 * 2**20


class GateFile:
    """A baseline or a shard's results: identity fields and metrics per key."""

    def __init__(
        self,
        *,
        kind: str,
        implementation: str,
        entries: Mapping[str, Metrics],
        shard: str = "1/1",
        provenance: Mapping[str, Any] | None = None,
        corpus: Mapping[str, Any] | None = None,
        hypothesis: str = hypothesis_version,
    ) -> None:
        self.kind = kind
        self.implementation = implementation
        self.entries = dict(entries)
        self.shard = shard
        self.provenance = dict(provenance or {})
        self.corpus = dict(corpus or GATE_CORPUS)
        self.hypothesis = hypothesis

    def identity(self) -> tuple[object, ...]:
        """What two files must share to be compared or merged."""
        return (self.implementation, tuple(sorted(self.corpus.items())), self.hypothesis)


def _float(text: object, *, where: str) -> float:
    if not isinstance(text, str):
        raise UsageError(f"{where} must be a float.hex string, got {text!r}")
    try:
        value = float.fromhex(text)
    except ValueError:
        raise UsageError(f"{where} is not a float.hex string: {text!r}") from None
    if math.isnan(value) or value < 0:
        raise UsageError(f"{where} must be >= 0, got {text!r}")
    return value


def _count(value: object, *, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UsageError(f"{where} must be an int >= 0, got {value!r}")
    return value


def read_gate_file(path: Path, *, kind: str) -> GateFile:
    """Read and validate a gate file of ``kind`` (baseline or results)."""
    name = str(path)
    try:
        if path.stat().st_size > _MAX_BYTES:
            raise UsageError(f"{name!r} is larger than {_MAX_BYTES} bytes: not a gate file")
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(
            f"no gate file at {name!r} (create a baseline with `wacc gate --update-baseline`)"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise UsageError(f"{name!r} is not a readable JSON gate file: {exc}") from None
    if not isinstance(document, dict):
        raise UsageError(f"{name!r} is not a JSON object")
    if document.get("format") != kind or document.get("version") != VERSION:
        raise UsageError(
            f"{name!r} has format {document.get('format')!r} version {document.get('version')!r}, "
            f"expected {kind!r} version {VERSION}"
        )
    for field, kind_of in (
        ("implementation", str), ("corpus", dict), ("hypothesis", str), ("entries", dict),
        ("provenance", dict), ("shard", str),
    ):  # fmt: skip
        if not isinstance(document.get(field), kind_of):
            raise UsageError(f"{name!r}: field {field!r} is missing or not a {kind_of.__name__}")
    entries: dict[str, Metrics] = {}
    for key, entry in document["entries"].items():
        where = f"{name!r}: entries[{key!r}]"
        if not isinstance(entry, dict) or set(entry) != {
            "scenarios", "failing", "max_ulps", "max_ratio", "findings"
        }:  # fmt: skip
            raise UsageError(f"{where} must hold scenarios, failing, max_ulps, max_ratio, findings")
        findings = entry["findings"]
        if not isinstance(findings, list) or not all(isinstance(f, str) for f in findings):
            raise UsageError(f"{where}.findings must be a list of strings")
        entries[key] = Metrics(
            scenarios=_count(entry["scenarios"], where=f"{where}.scenarios"),
            failing=_count(entry["failing"], where=f"{where}.failing"),
            max_ulps=_float(entry["max_ulps"], where=f"{where}.max_ulps"),
            max_ratio=_float(entry["max_ratio"], where=f"{where}.max_ratio"),
            findings=list(findings),
        )
    return GateFile(
        kind=kind,
        implementation=document["implementation"],
        entries=entries,
        shard=document["shard"],
        provenance=document["provenance"],
        corpus=document["corpus"],
        hypothesis=document["hypothesis"],
    )


def write_gate_file(gate_file: GateFile, path: Path) -> Path:
    """Write ``gate_file`` as JSON (keys sorted, floats as hex)."""
    document = {
        "format": gate_file.kind,
        "version": VERSION,
        "implementation": gate_file.implementation,
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
                "findings": m.findings,
            }
            for key, m in sorted(gate_file.entries.items())
        },
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return path
