"""The report's files: ``index.md`` (headline table, figures inline), ``divergence.csv``, and
``scenarios/`` with the replay file of every failing row; ``.wacc-report-files`` lists what the
report wrote, so that the next report into the folder removes its own stale files and no other."""

from __future__ import annotations

import csv
import dataclasses
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from wacc.judge.verdict import ORACLES
from wacc.report.corpus import CorpusEntry, scenario_of_replay
from wacc.report.provenance import Provenance
from wacc.report.rows import IMPLEMENTATIONS, NotJudged, Row
from wacc.tables import format_metric
from wacc_ref import formats
from wacc_ref.scenario import to_json

__all__ = [
    "CSV_COLUMNS",
    "CSV_NAMES",
    "MANIFEST",
    "ORACLE_COLUMNS",
    "PROVENANCE_COLUMNS",
    "ROW_COLUMNS",
    "ROW_FIELDS",
    "Headline",
    "headline",
    "record_files",
    "write_csv",
    "write_index",
    "write_scenarios",
]

# A row's own fields, then one column per oracle ("pass"/"fail": no string to unpack), then the
# report's provenance on every row (rows of several reports concatenated stay attributable).
ROW_FIELDS: tuple[str, ...] = tuple(field.name for field in dataclasses.fields(Row))
# The CSV names a field by what it measures where the field's name alone would not say it.
CSV_NAMES: dict[str, str] = {"max_rel_error": "max_rel_error_normal"}
ROW_COLUMNS: tuple[str, ...] = tuple(CSV_NAMES.get(name, name) for name in ROW_FIELDS)
ORACLE_COLUMNS: tuple[str, ...] = ORACLES
PROVENANCE_COLUMNS: tuple[str, ...] = (
    "wacc_version", "torch_version", "commit", "corpus_seed", "corpus_size", "date",
)  # fmt: skip
CSV_COLUMNS: tuple[str, ...] = ROW_COLUMNS + ORACLE_COLUMNS + PROVENANCE_COLUMNS


MANIFEST = ".wacc-report-files"  # what the last report wrote, one path (relative, /) a line
# The files a report writes whose names change from run to run: only these are ever removed.
_OWN_FILE = re.compile(r"scenarios/[A-Za-z0-9_.+-]+\.json|figures/[A-Za-z0-9_.+-]+\.png")
_MANIFEST_BYTES = 16 * 2**20


@dataclass(frozen=True)
class Headline:
    """One line of the headline table: a work dtype x implementation (x device)."""

    work_dtype: str
    implementation: str
    device: str
    scenarios: int
    failing: int
    failed_oracles: tuple[str, ...]
    max_ulps: float
    max_rel_error: float
    max_ratio: float

    @property
    def verdict(self) -> str:
        """``pass`` or ``FAIL`` with the failing count and oracles."""
        if not self.failing:
            return "pass"
        return f"FAIL {self.failing}/{self.scenarios} ({', '.join(self.failed_oracles)})"


def headline(rows: Sequence[Row]) -> list[Headline]:
    """Aggregate ``rows`` per work dtype x implementation x device, in table order."""
    order = {name: position for position, name in enumerate(IMPLEMENTATIONS)}
    groups: dict[tuple[str, str, str], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.work_dtype, row.implementation, row.device), []).append(row)
    lines = []
    for (dtype, name, device), group in groups.items():
        oracles = Counter(
            oracle
            for row in group
            if row.verdict != "pass"
            for oracle in row.verdict.removeprefix("fail: ").split(",")
        )
        lines.append(
            Headline(
                work_dtype=dtype,
                implementation=name,
                device=device,
                scenarios=len(group),
                failing=sum(row.verdict != "pass" for row in group),
                failed_oracles=tuple(sorted(oracles)),
                max_ulps=max(row.max_ulps for row in group),
                max_rel_error=max(row.max_rel_error for row in group),
                max_ratio=max(row.max_ratio for row in group),
            )
        )
    dtypes = {dtype: position for position, dtype in enumerate(formats.WORK_DTYPES)}
    lines.sort(key=lambda h: (dtypes[h.work_dtype], order.get(h.implementation, 99), h.device))
    return lines


def headline_markdown(lines: Sequence[Headline]) -> str:
    """The headline table in markdown."""
    out = [
        "| work dtype | implementation | device | scenarios | max ulps vs emulation | "
        "max rel. error (normal range) | max error/bound | verdict |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for h in lines:
        out.append(
            f"| {h.work_dtype} | `{h.implementation}` | {h.device} | {h.scenarios} | "
            f"{format_metric(h.max_ulps)} | {format_metric(h.max_rel_error)} | "
            f"{format_metric(h.max_ratio)} | {h.verdict} |"
        )
    return "\n".join(out)


def write_csv(
    rows: Sequence[Row], path: Path, *, provenance: Provenance, not_judged: Sequence[NotJudged] = ()
) -> Path:
    """``divergence.csv``: one row per scenario x implementation x device (floats as repr),
    with :data:`CSV_COLUMNS`; then one per scenario an implementation is not judged on, its
    verdict ``not judged: <features>``, its oracles ``not judged`` and its metrics empty."""
    stamp = [
        provenance.versions.get("wacc", "?"), provenance.versions.get("torch", "?"),
        provenance.commit, provenance.corpus_seed, provenance.corpus_size, provenance.date,
    ]  # fmt: skip
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_COLUMNS)
        for row in rows:
            failed = set(row.verdict.removeprefix("fail: ").split(",")) if row.failed else set()
            writer.writerow(
                [getattr(row, name) for name in ROW_FIELDS]
                + ["fail" if oracle in failed else "pass" for oracle in ORACLE_COLUMNS]
                + stamp
            )
        for skipped in not_judged:
            writer.writerow(
                [
                    skipped.verdict if name == "verdict" else getattr(skipped, name, "")
                    for name in ROW_FIELDS
                ]
                + ["not judged"] * len(ORACLE_COLUMNS)
                + stamp
            )
    return path


def write_scenarios(rows: Sequence[Row], corpus: Sequence[CorpusEntry], out: Path) -> int:
    """The replay file of every scenario a failing row names; returns how many were written."""
    by_id = {entry.scenario_id: entry for entry in corpus}
    needed = sorted({row.replay for row in rows if row.replay})
    ids = sorted(by_id, key=len, reverse=True)  # the longest id first: ids may share a prefix
    for name in needed:
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        stem = Path(name).stem
        scenario_id = next(i for i in ids if stem.startswith(i))
        scenario = scenario_of_replay(by_id[scenario_id], stem.removeprefix(scenario_id))
        path.write_text(to_json(scenario, indent=1) + "\n", encoding="utf-8")
    return len(needed)


def write_index(
    out: Path,
    *,
    provenance: Provenance,
    rows: Sequence[Row],
    figures: Mapping[str, tuple[Path, str]],
    variants: Mapping[str, Mapping[str, Counter[str]]],
    replay_files: int,
    unsupported: Mapping[str, Sequence[str]] | None = None,
    not_judged: Sequence[NotJudged] = (),
    compared: tuple[str, Sequence[str], Sequence[Sequence[str]]] | None = None,
    audit: Sequence[str] | None = None,
    device_section: Sequence[str] | None = None,
) -> Path:
    """``index.md``: provenance, the headline table (and, with ``compared`` = (the previous
    report's folder, a header, rows), the same lines next to the previous report's), each
    figure with what it shows, ``audit``'s lines (the training-frameworks section) and the
    ``device_section``'s (:func:`wacc.report.device_section.device_markdown`)."""
    parts = ["# wacc report", "", *provenance.lines(), ""]
    parts += [
        "## Headline",
        "",
        "Every scenario of the corpus judged on every implementation with the three oracles "
        "(emulation bit for bit, error within the derived bound, semantics). `max ulps` is the "
        "distance to the reproducible order's emulation in units of the work dtype (a fused mode "
        "may legitimately differ); `max rel. error (normal range)` is against the exact result "
        "over the elements where a relative error means something: the exact value in the work "
        "dtype's normal range and above its own error bound (below the normal range the "
        "dtype's spacing is fixed, and where the bound reaches the value, a cancellation or an "
        "underflow in between, the bound's absolute part decides: the bound oracle judges "
        "those elements); `max error/bound` <= 1 means the bound held.",
        "",
        headline_markdown(headline(rows)),
        "",
    ]
    if compared is not None:
        folder, header, cells = compared
        parts += [
            f"## Compared with `{folder}`",
            "",
            "Each value as `now (before)`, from that report's `divergence.csv`; `worse`: a "
            "metric or the failing share went up, `better`: down, `new` / `gone`: a line only "
            "one report has. A report from a wacc before 0.2 measured the relative error over "
            "every nonzero exact value, not only the normal range.",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in cells),
            "",
        ]
    lacking = {name: lines for name, lines in (unsupported or {}).items() if lines}
    if lacking:
        skipped = Counter(s.implementation for s in not_judged)
        parts += [
            "## Features the implementations lack",
            "",
            "What the judge found missing (the contract: `wacc.judge.contract`). `unsupported`: a "
            "missing core feature, which fails that implementation unless `--allow-missing` "
            "names it; `not judged`: a missing extension (or an allowed core feature), which "
            "fails nothing. The steps and scenarios that need a missing feature are not run, so "
            "the rows above judge the rest; `divergence.csv` has a `not judged` line for each "
            "scenario left out.",
            "",
            *(f"- `{name}`: {line}" for name, lines in lacking.items() for line in lines),
            *(
                f"- `{name}`: {count} corpus scenario(s) x device(s) not judged"
                for name, count in skipped.items()
            ),
            "",
        ]
    for title, (path, caption) in figures.items():
        parts += [
            f"## {title}",
            "",
            caption,
            "",
            f"![{title}]({path.relative_to(out).as_posix()})",
            "",
        ]
    if variants:
        parts += [
            "## Fused mode: the §6 variant each device took",
            "",
            "Scenarios with a mean step, run with `fused=True`; each counted under the variants "
            "of the reference whose whole trace it equals, named as in `docs/semantics.md` §6: "
            "`fma` (one rounding in D), `op_rounded` (rounded in op(D), then to D), `two_step` "
            "(the reproducible order); `fma+op_rounded`: both of those; `mixed`: none alone, as "
            "when PyTorch's CPU half-precision kernels round the vectorized body and the scalar "
            "tail differently; `any`: the three coincide on the scenario.",
            "",
            "| device | work dtype | variants matched (scenarios) |",
            "|---|---|---|",
        ]
        for device, per_dtype in variants.items():
            for dtype in formats.WORK_DTYPES:
                counts = per_dtype.get(dtype)
                if counts:
                    shown = ", ".join(f"{label}: {n}" for label, n in sorted(counts.items()))
                    parts.append(f"| {device} | {dtype} | {shown} |")
        parts.append("")
    parts += list(audit or ())
    parts += list(device_section or ())
    parts += [
        "## Files",
        "",
        f"- `divergence.csv`: {len(rows)} rows (scenario x implementation x device): "
        + ", ".join(CSV_COLUMNS),
        f"- `scenarios/`: {replay_files} replay files, one per scenario that a row fails "
        "(`wacc replay scenarios/<file> --impl <factory>`)",
        *(
            [
                "- `device.csv`: the device section's tables (column `table`); `reduction.csv`: "
                "the data-parallel reduction's models and gloo measured, per dtype x world size"
            ]
            if device_section
            else []
        ),
        "",
    ]
    path = out / "index.md"
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def record_files(out: Path, written: Iterable[Path]) -> list[Path]:
    """Remove the files the previous report into ``out`` wrote (listed in its :data:`MANIFEST`)
    that this one did not, then list this report's ``written`` files there; returns what was
    removed. Only names of the report's own kinds (a replay file under ``scenarios/``, a figure
    under ``figures/``) are removed, and only if the manifest lists them: a file the report
    never wrote is never touched, whatever folder it is in. Called after every file is written,
    so a report that fails half-way leaves the previous one's files in place."""
    manifest = out / MANIFEST
    listed: list[str] = []
    if manifest.is_file():  # none: a first report, or one by a wacc before 0.3
        try:
            with manifest.open("rb") as handle:
                text = handle.read(_MANIFEST_BYTES).decode("utf-8", errors="replace")
            listed = text.splitlines()
        except OSError:
            listed = []  # unreadable: remove nothing rather than guess
    keep = {path.relative_to(out).as_posix() for path in written}
    removed = []
    for name in dict.fromkeys(listed):
        path = out / name
        if name in keep or _OWN_FILE.fullmatch(name) is None or path.is_symlink():
            continue
        if path.is_file():
            path.unlink()
            removed.append(path)
    temporary = manifest.with_name(f"{MANIFEST}.{os.getpid()}.tmp")
    temporary.write_text("".join(f"{name}\n" for name in sorted(keep)), encoding="utf-8")
    os.replace(temporary, manifest)
    return removed
