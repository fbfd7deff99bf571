"""Every mutant's fate, read from mutmut's state under ``mutants/`` (after ``mutmut run``).

mutmut keeps one ``.meta`` file per mutated source file (exit code per mutant) and the mutated
sources themselves; the diff of a mutant is rebuilt from them.  These are mutmut's own readers
(pinned to 3.8 by the ``mutation`` extra): the report never re-derives what mutmut decided.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# A mutant's status, as mutmut names it, mapped to how the score counts it.  A timeout is a kill:
# the mutant made a covering test hang or run 15 times its normal time, which a run notices.
DETECTED = frozenset({"killed", "timeout", "caught by type check", "segfault"})
# Not yet decided (a run stopped part way): neither killed nor survived, and never scored.
NOT_RUN = frozenset({"not checked", "check was interrupted by user"})
# A triaged survivor not run again because its function is unchanged (``mutation.carry``): the
# only way this project makes mutmut answer "skipped" (exit 34). It counts as a survivor.
CARRIED = "carried"
_STATUS_NAMES = {"skipped": CARRIED}


@dataclass(frozen=True)
class Outcome:
    """One mutant: its mutmut name, the file and function mutated, its status, the change."""

    name: str
    path: str
    function: str
    status: str
    change: str

    @property
    def detected(self) -> bool:
        return self.status in DETECTED

    @property
    def survived(self) -> bool:
        """Run and not detected: survived, no covering test, or suspicious."""
        return self.status not in DETECTED and self.status not in NOT_RUN


_MUTANT_SUFFIX = re.compile(r"__mutmut_\d+$")


def function_of(name: str) -> str:
    """``wacc_torch.x.xǁCǁf__mutmut_3`` -> ``C.f``; ``wacc_torch.x.x_g__mutmut_1`` -> ``g``."""
    generated = _MUTANT_SUFFIX.sub("", name.rpartition(".")[2])
    if generated.startswith("xǁ"):
        return ".".join(part for part in generated[2:].split("ǁ") if part)
    return generated.removeprefix("x_")


def change_of(diff: str) -> str:
    """The lines a mutant changes, whitespace collapsed: ``old line => new line``."""
    removed, added = [], []
    for line in diff.splitlines():
        if line.startswith(("---", "+++")):
            continue
        if line.startswith("-"):
            removed.append(" ".join(line[1:].split()))
        elif line.startswith("+"):
            added.append(" ".join(line[1:].split()))
    return f"{' / '.join(removed)} => {' / '.join(added)}"


@contextmanager
def in_directory(directory: Path) -> Iterator[None]:
    before = Path.cwd()
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(before)


def _changes(path: Path, names: list[str]) -> dict[str, str]:
    """Each mutant's change, from the mutated file's line index (read once): the unmutated copy
    and the mutant, both renamed to the function's own name, diffed as text.  libcst keeps the
    source text exactly, so this is mutmut's own diff without parsing 6000 functions; a name the
    index does not hold falls back to mutmut's ``get_diff_for_mutant``."""
    from mutmut.mutation.data import MutantLineSpans
    from mutmut.mutation.diff_apply import generated_function_names, get_diff_for_mutant

    spans = MutantLineSpans.load(path)
    lines = (Path("mutants") / path).read_text(encoding="utf-8").splitlines()
    changes = {}
    for name in names:
        orig, mutant = generated_function_names(name)
        if (
            spans is None
            or orig not in spans.span_by_function_name
            or (mutant not in spans.span_by_function_name)
        ):
            changes[name] = change_of(get_diff_for_mutant(name, path=path))
            continue
        texts = []
        for generated in (orig, mutant):
            span = spans.span_by_function_name[generated]
            text = lines[span.start - 1 : span.end]
            at = next(i for i, line in enumerate(text) if f"def {generated}(" in line)
            text[at] = text[at].replace(f"def {generated}(", "def _(", 1)  # renamed alike
            texts.append(text)
        diff = difflib.unified_diff(texts[0], texts[1], lineterm="", n=0)
        changes[name] = change_of("\n".join(diff))
    return changes


def _status(mutmut_status: str) -> str:
    return _STATUS_NAMES.get(mutmut_status, mutmut_status)


def read_outcomes(root: Path) -> list[Outcome]:
    """Every mutant of the last ``mutmut run`` in ``root``, in file and mutant order."""
    from mutmut.configuration import reset_config
    from mutmut.mutation.data import SourceFileMutationData
    from mutmut.stats import status_by_exit_code
    from mutmut.utils.file_utils import walk_mutatable_files

    if not (root / "mutants").is_dir():
        raise FileNotFoundError(f"{root / 'mutants'} does not exist: run `mutmut run` first")
    outcomes = []
    with in_directory(root):
        reset_config()  # mutmut caches the config of the directory it was first asked in
        for path in sorted(walk_mutatable_files(), key=str):
            data = SourceFileMutationData(path=path)
            data.load()
            changes = _changes(path, list(data.exit_code_by_key))
            for name, exit_code in data.exit_code_by_key.items():
                outcomes.append(
                    Outcome(
                        name=name,
                        path=str(path),
                        function=function_of(name),
                        status=_status(status_by_exit_code[exit_code]),
                        change=changes[name],
                    )
                )
    return outcomes
