"""Every file the ``wacc`` command reads, fuzzed: bad input is exit 2 and ONE line on stderr that
names the file and the field, never a traceback; anything else is a correct run (exit 0 or 1).

The files a subcommand reads from the user (wacc/commands/):

* ``wacc replay FILE``: a scenario file (:func:`wacc_ref.scenario.from_json`);
* ``wacc gate --baseline FILE``: a baseline, and ``wacc gate --merge DIR...``: every ``*.json``
  in the directories, each a shard's results (:func:`wacc.gate.baseline.read_gate_file`).

``wacc check`` and ``wacc audit`` read no data file (IMPL and user loops are Python code, whose
import errors are mapped to exit 2 by wacc.judge.implementation and wacc.audit.protocol); ``wacc
report`` reads only the corpus shipped inside the package.

The property tests start from a valid file, pick one node of the document (every path is a
candidate) and replace it with a hostile value (wrong types, hex overflow, integers of 5000
digits, NaN/inf spellings, empty values, deep nesting, long strings, random JSON), delete it,
add an unknown field or repeat a key; others edit the bytes. They run ``wacc.cli.main`` in
process (an exception escaping it is what a user sees as a traceback); a few subprocess runs
check that the in-process answer is what ``python -m wacc`` prints. A failure names the edit
and the answer; Hypothesis prints the falsifying example and a ``@reproduce_failure`` blob, and
under the derandomized ``ci`` profile the same run finds it again:
``HYPOTHESIS_PROFILE=ci python -m pytest tests/wacc/test_file_fuzz.py -k <test name>``.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from wacc.cli import main
from wacc.gate.baseline import BASELINE_FORMAT, RESULTS_FORMAT, GateFile, write_gate_file
from wacc.gate.measure import GateFinding, Metrics
from wacc_ref.corruption import CORRUPTION_KINDS
from wacc_ref.scenario import (
    Accumulate,
    Checkpoint,
    Finish,
    Restore,
    RestoreCorrupted,
    Scenario,
    to_json,
)
from wacc_ref.strict_json import DOCUMENT, FieldError, field, item, loads

REPO = Path(__file__).resolve().parents[2]
MAX_LINE = 400  # characters besides the file names: one readable line


# ------------------------------------------------------------------------------ running wacc


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str


def run_wacc(*argv: str) -> Outcome:
    """``wacc.cli.main(argv)`` in process, stdout and stderr captured."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    # A real stdout or stderr is UTF-8: what cannot be written there (a lone surrogate read
    # from a file) would be a traceback, which StringIO alone would hide.
    out.getvalue().encode("utf-8")
    err.getvalue().encode("utf-8")
    return Outcome(code, out.getvalue(), err.getvalue())


def error_line(outcome: Outcome, context: str = "") -> str:
    """The one stderr line of an exit-2 outcome, without its ``wacc: error: `` prefix."""
    assert outcome.code == 2, f"{context}: exit {outcome.code}, expected 2\n{outcome.stderr}"
    lines = outcome.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("wacc: error: "), (context, outcome.stderr)
    assert "Traceback" not in outcome.stderr, (context, outcome.stderr)
    return lines[0].removeprefix("wacc: error: ")


def assert_names(outcome: Outcome, file: Path, path: str, context: str = "") -> str:
    """Exit 2, one line, naming ``file`` and the field ``path`` (``(document)`` for ``""``)."""
    line = error_line(outcome, context)
    expected = f"{str(file)!r}: {path or DOCUMENT}: "
    assert line.startswith(expected), f"{context}: expected {expected!r} in\n{line}"
    return line


# ------------------------------------------------------------------------------ valid files


def valid_scenario() -> Scenario:
    """A small scenario with every kind of step and field (so every path can be mutated)."""
    return Scenario(
        work_dtype="float16",
        grad_dtype="float32",
        loss_scale=2.0**15,
        fused=False,
        parameters=(("w", (2,)), ("b", (1,))),
        steps=(
            Accumulate.of("sum", 4000.0, {"w": (2.0**15, -0.0), "b": None}),
            Checkpoint(asynchronous=True),
            Accumulate.of("mean", 96.0, {"w": (2.0**-9, -1.0)}),
            RestoreCorrupted("dtype_wrong"),
            Restore(),
            Finish("sums"),
            Finish("mean"),
        ),
    )


CORPUS_KEY, CHECK_KEY = "float32/windows/corpus", "float16/non_finite/check"
PROVENANCE = {"commit": "abc", "versions": {"torch": "2"}, "devices": ["cpu"], "seconds": 1.5}


def gate_files(folder: Path) -> dict[str, Path]:
    """A baseline and the two shard results of one run (written by the tool itself)."""
    corpus = Metrics(scenarios=3, max_ulps=1.0, max_ratio=0.25)
    check = Metrics(scenarios=5, max_ulps=2.0, max_ratio=math.inf)
    paths = {
        "baseline": folder / "baseline.json",
        "shard-1": folder / "shards" / "s1.json",
        "shard-2": folder / "shards" / "s2.json",
    }
    both = {CORPUS_KEY: corpus, CHECK_KEY: check}
    for name, entries, shard in (("baseline", both, "1/1"),
                                 ("shard-1", {CORPUS_KEY: corpus}, "1/2"),
                                 ("shard-2", {CHECK_KEY: check}, "2/2")):  # fmt: skip
        kind = BASELINE_FORMAT if name == "baseline" else RESULTS_FORMAT
        part = GateFile(kind=kind, implementation="wacc_torch", entries=entries, shard=shard,
                        provenance=PROVENANCE)  # fmt: skip
        write_gate_file(part, paths[name])
    return paths


def gate_argv(paths: dict[str, Path]) -> list[str]:
    return ["gate", "--quiet", "--merge", str(paths["shard-1"].parent),
            "--baseline", str(paths["baseline"])]  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder the property tests overwrite (module-scoped: Hypothesis reruns the body)."""
    return tmp_path_factory.mktemp("fuzz")


def test_the_valid_files_run_correctly(folder: Path) -> None:
    """The starting points of the fuzzing are valid: replay agrees, the gate passes."""
    path = folder / "valid.json"
    path.write_text(to_json(valid_scenario()), encoding="utf-8")
    replay = run_wacc("replay", str(path))
    assert replay.code == 0, replay.stdout + replay.stderr
    gate = run_wacc(*gate_argv(gate_files(folder / "valid-gate")))
    assert gate.code == 0 and "wacc gate passed" in gate.stdout, gate.stdout + gate.stderr


# ------------------------------------------------------------------------------ the schemas

# Each node of a document has a kind, looked up by its keys with list indices as "#" and the
# keys of a mapping (names chosen by the file) as "*". "free" is provenance: any JSON.
SCENARIO_KINDS: dict[tuple[str, ...], str] = {
    (): "object",
    ("format",): "const",
    ("version",): "version",
    ("work_dtype",): "enum",
    ("grad_dtype",): "enum",
    ("loss_scale",): "hex",
    ("fused",): "bool",
    ("parameters",): "list",
    ("parameters", "#"): "object",
    ("parameters", "#", "name"): "str",
    ("parameters", "#", "shape"): "list",
    ("parameters", "#", "shape", "#"): "int",
    ("steps",): "list",
    ("steps", "#"): "object",
    ("steps", "#", "op"): "enum",
    ("steps", "#", "weight"): "hex",
    ("steps", "#", "grads"): "mapping",
    ("steps", "#", "grads", "*"): "list|null",
    ("steps", "#", "grads", "*", "#"): "hex",
    ("steps", "#", "asynchronous"): "bool",
    ("steps", "#", "kind"): "enum",
}
GATE_KINDS: dict[tuple[str, ...], str] = {
    (): "object",
    ("format",): "const",
    ("version",): "version",
    ("implementation",): "str",
    ("corpus",): "object",
    ("corpus", "seed"): "int",
    ("corpus", "size"): "str",
    ("profile",): "enum",
    ("hypothesis",): "str",
    ("shard",): "str",
    ("features",): "list",  # gate files of version 3: the features the run was made with
    ("features", "#"): "str",
    ("provenance",): "free",
    ("entries",): "mapping",
    ("entries", "*"): "object",
    ("entries", "*", "scenarios"): "int",
    ("entries", "*", "failing"): "int",
    ("entries", "*", "max_ulps"): "hex",
    ("entries", "*", "max_ratio"): "hex",
    ("entries", "*", "milliseconds"): "int",
    ("entries", "*", "findings"): "list",
    ("entries", "*", "findings", "#"): "object",
    ("entries", "*", "findings", "#", "signature"): "str",
    ("entries", "*", "findings", "#", "message"): "str",
    ("entries", "*", "findings", "#", "replay"): "str",
    ("entries", "*", "findings", "#", "steps"): "int",
}
ENUMS = {
    "work_dtype": ("float64", "float32", "float16", "bfloat16"),
    "grad_dtype": ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"),
    "op": (
        "accumulate_sum",
        "accumulate_mean",
        "finish_sums",
        "finish_mean",
        "checkpoint",
        "restore",
        "restore_corrupted",
    ),  # fmt: skip
    "kind": CORRUPTION_KINDS,
    "profile": ("ci",),
}
_JSON_TYPES = {"str": str, "enum": str, "const": str, "hex": str, "bool": bool, "list": list,
               "object": dict, "mapping": dict}  # fmt: skip


@dataclass(frozen=True)
class Node:
    keys: tuple[str | int, ...]  # how to reach it
    path: str  # how the messages name it
    kind: str
    value: Any


def nodes(document: Any, kinds: dict[tuple[str, ...], str]) -> list[Node]:
    """Every node of ``document``, the root included."""
    found: list[Node] = []
    stack: list[tuple[tuple[str | int, ...], tuple[str, ...], str, Any]] = [((), (), "", document)]
    while stack:
        keys, norm, path, value = stack.pop()
        kind = "free" if norm[:1] == ("provenance",) and norm != ("provenance",) else kinds[norm]
        found.append(Node(keys, path, kind, value))
        if isinstance(value, dict):
            for key, child in value.items():
                named = kind in ("mapping", "free")
                stack.append((keys + (key,), norm + ("*" if named else key,),
                              item(path, key) if named else field(path, key), child))  # fmt: skip
        elif isinstance(value, list):
            for index, child in enumerate(value):
                stack.append((keys + (index,), norm + ("#",), item(path, index), child))
    return found


def wrong_type(kind: str, value: Any) -> bool:
    """Whether ``value`` (as parsed) is not even of the JSON type a node of ``kind`` holds."""
    if kind in ("int", "version"):
        return type(value) is not int
    if kind == "list|null":
        return value is not None and not isinstance(value, list)
    if kind == "free":
        return False
    return not isinstance(value, _JSON_TYPES[kind])


def not_canonical_hex(value: object) -> bool:
    """A string that is not exactly what float.hex writes (the files' one spelling of a float)."""
    if not isinstance(value, str):
        return False
    try:
        return float.fromhex(value).hex() != value
    except (ValueError, OverflowError):
        return True


def refused_at_the_node(node: Node, value: Any, *, baseline: bool) -> bool:
    """Whether the rules refuse ``value`` in ``node``'s place there, at its own path (the
    stronger property; other replacements may be refused elsewhere or be a correct run)."""
    if wrong_type(node.kind, value):
        return True
    name = node.keys[-1] if node.keys else ""
    if node.kind == "hex":
        if not_canonical_hex(value):
            return True
        number = float.fromhex(value)
        if node.keys[0] == "entries":  # metrics: maxima of absolute errors
            corpus = baseline and str(node.keys[1]).endswith("/corpus")
            return (
                math.isnan(number) or math.copysign(1, number) < 0 or corpus and number == math.inf
            )
        if name == "loss_scale":
            return not (math.isfinite(number) and number > 0)
        return False
    if node.kind == "version":
        return value != 1
    if node.kind == "int":  # corpus.seed: any integer is read, then judged as the corpus
        return name != "seed" and not 0 <= value < 2**63
    if node.kind == "enum":
        return value not in ENUMS[str(name)]
    if node.kind == "const":
        return value != node.value
    return False


# ------------------------------------------------------------------------------ hostile values

DEEP = "[" * 100_000 + "]" * 100_000  # beyond any recursion limit
HOSTILE_TEXT = [
    # hex floats: overflow, underflow, other spellings of valid values, decimals, specials
    '"0x1.0p+1024"', '"-0x1.0p+1024"', '"0x1p-1080"', '"0x1.00000000000001p+0"', '"1.8p1"',
    '"0X1.8P+1"', '" 0x1.8000000000000p+1"', '"0x1.8000000000000p+1 "', '"0x1.8p+1"', '"0.125"',
    '"-0x0p+0"', '"-0x0.0p+0"', '"0x0.0p+0"', '"inf"', '"-inf"', '"infinity"', '"nan"', '"-nan"',
    '"NaN"', '"0x1.0000000000000p+0"', '"0x1.0000000000000p-3"',
    # numbers: huge, bool-like, floats for ints, JSON extensions
    "9" * 5000, "-" + "9" * 5000, str(2**63), str(2**64), "-1", "0", "1", "true", "false",
    "1.0", "0.5", "1e999", "-1e999", "NaN", "Infinity", "-Infinity", "null",
    # strings: empty, shards spelled otherwise, digits Python's int() reads, long, line breaks
    '""', '"+1/2"', '" 1/2"', '"1/2 "', '"\\u0661/\\u0662"', '"01/2"', '"0/2"', '"3/2"', '"1/2"',
    '"2/2"', '"1/1"', '"a/b"', '"1/2/3"', '"' + "x" * 100_000 + '"', '"a\\nb\\u2028c"', '"\\ud800"',
    '"a\\udfffb"',
    '"wacc-scenario"', '"wacc-gate-baseline"', '"wacc-gate-results"', '"ci"', '"float64"',
    '"finish_mean"', '"restore"', '"checkpoint"', '"accumulate_sum"', '"w"',
    # containers: empty, deep, long
    "[]", "{}", "[[]]", '{"": {}}', "[" * 50 + "]" * 50, DEEP, "[" + ",".join(["0"] * 2000) + "]",
]  # fmt: skip
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
hostile_text = st.one_of(
    st.sampled_from(HOSTILE_TEXT),
    json_values.map(json.dumps),
    st.floats().map(lambda f: json.dumps(f.hex())),
)
_HOLE = "\x00hostile\x00"  # a string no document holds, replaced by the hostile JSON text


def _set(document: Any, keys: tuple[str | int, ...], value: Any) -> Any:
    if not keys:
        return value
    *parents, last = keys
    target = document
    for key in parents:
        target = target[key]
    target[last] = value
    return document


@dataclass(frozen=True)
class Mutation:
    """One edit of a document and the path the answer must name (None: any path, or a run)."""

    text: str
    names: str | None
    label: str


@st.composite
def mutations(draw: st.DrawFn, document: Any, kinds: dict[tuple[str, ...], str],
              *, baseline: bool = False) -> Mutation:  # fmt: skip
    """A hostile edit of ``document`` at one of its nodes."""
    node = draw(st.sampled_from(nodes(document, kinds)))
    copy = json.loads(json.dumps(document))
    containers = ("object", "mapping", "free")
    edits = ["replace"]
    if node.keys:
        edits.append("delete")
    if node.kind in containers and isinstance(node.value, dict):
        edits += ["unknown field", "repeated key"]
    edit = draw(st.sampled_from(edits))
    label = f"{edit} {node.path or DOCUMENT}"
    if edit == "replace":
        text = draw(hostile_text)
        copy = _set(copy, node.keys, _HOLE)
        document_text = json.dumps(copy).replace(json.dumps(_HOLE), text)
        try:
            value = loads(text)
        except FieldError:  # nested beyond the recursion limit: the document's own problem
            return Mutation(document_text, DOCUMENT, f"{label} = {text[:40]}")
        strong = node.kind != "free" and refused_at_the_node(node, value, baseline=baseline)
        return Mutation(document_text, node.path if strong else None, f"{label} = {text[:40]}")
    if edit == "delete":
        parent = copy
        for key in node.keys[:-1]:
            parent = parent[key]
        del parent[node.keys[-1]]
        parent_kind = kinds.get(tuple("#" if isinstance(k, int) else k for k in node.keys[:-1]))
        fixed = isinstance(node.keys[-1], str) and parent_kind == "object"
        return Mutation(json.dumps(copy), node.path if fixed else None, label)
    target = copy
    for key in node.keys:
        target = target[key]
    if edit == "unknown field":
        target["bogus field"] = 0
        return Mutation(
            json.dumps(copy), item(node.path, "bogus field") if node.kind != "free" else None, label
        )
    key = draw(st.sampled_from(sorted(target)))  # repeated with the same value: only that is wrong
    target[_HOLE] = target[key]
    text = json.dumps(copy).replace(json.dumps(_HOLE), json.dumps(key))
    return Mutation(text, item(node.path, key), f"{label} {key!r}")


# ------------------------------------------------------------------------------ the property


FIELD_NAMES = {key for kinds in (SCENARIO_KINDS, GATE_KINDS) for keys in kinds for key in keys} - {
    "#",
    "*",
}


def _candidates(text: str) -> set[str]:
    """The paths of every node of the document in ``text`` and of every field an object of the
    files may miss (only ``(document)`` if the text is not a JSON document)."""
    try:
        document = loads(text)
    except FieldError:
        return {DOCUMENT}
    paths = {DOCUMENT}
    stack: list[tuple[str, Any]] = [("", document)]
    while stack:
        path, value = stack.pop()
        if path:
            paths.add(path)
        if isinstance(value, dict):
            paths.update(field(path, name) for name in FIELD_NAMES)  # a missing field
            for key, child in value.items():
                stack.append((item(path, key), child))
                stack.append((field(path, key), child))
        elif isinstance(value, list):
            stack.extend((item(path, i), child) for i, child in enumerate(value))
    return paths


def check_outcome(outcome: Outcome, files: dict[Path, str], mutation: Mutation) -> None:
    """The property: a correct run (exit 0 or 1), or exit 2 with one line naming a file that was
    read and a field of it (a node, or a missing field under one); ``mutation.names`` exactly
    when the edit is refused where it stands."""
    context = f"{mutation.label}\n{outcome.stderr}"
    event(f"exit {outcome.code}" + (", at the edited field" if mutation.names is not None else ""))
    if outcome.code in (0, 1) and mutation.names is None:
        return  # a correct run (an exception would have escaped main)
    line = error_line(outcome, context)
    named = [path for path in files if line.startswith(f"{str(path)!r}: ")]
    assert named, f"no file named: {context}"
    rest = line.removeprefix(f"{str(named[0])!r}: ")
    length = len(line) - len(repr(str(named[0])))
    assert length <= MAX_LINE, f"{length} characters: {context}"
    if mutation.names is not None:
        assert rest.startswith(f"{mutation.names or DOCUMENT}: "), (
            f"expected {mutation.names}: {context}"
        )
        return
    paths = _candidates(files[named[0]])
    assert any(rest.startswith(f"{path}: ") for path in paths), (
        f"the line names no field of {named[0].name}: {context}"
    )


# ------------------------------------------------------------------------------ the fuzz tests

_SCENARIO = json.loads(to_json(valid_scenario()))


@given(mutation=mutations(_SCENARIO, SCENARIO_KINDS))
def test_fuzzed_replay_files_are_one_line_exit_2_naming_the_field(
    folder: Path, mutation: Mutation
) -> None:
    """``wacc replay`` on a valid scenario file with one hostile edit (any node: replaced,
    deleted, an unknown field, a repeated key) answers exit 2 and one line naming the file and a
    field (the edited one whenever the edit is refused where it stands), or runs correctly."""
    path = folder / "scenario.json"
    path.write_text(mutation.text, encoding="utf-8")
    check_outcome(run_wacc("replay", str(path)), {path: mutation.text}, mutation)


def _gate_documents() -> dict[str, Any]:
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        paths = gate_files(Path(scratch))
        return {name: json.loads(path.read_text(encoding="utf-8")) for name, path in paths.items()}


_GATE = _gate_documents()
gate_mutations = st.sampled_from(sorted(_GATE)).flatmap(
    lambda name: st.tuples(
        st.just(name), mutations(_GATE[name], GATE_KINDS, baseline=name == "baseline")
    )
)


@given(target=gate_mutations)
def test_fuzzed_gate_files_are_one_line_exit_2_naming_the_field(
    folder: Path, target: tuple[str, Mutation]
) -> None:
    """``wacc gate --merge DIR --baseline FILE`` with one hostile edit in the baseline or in a
    shard's results answers exit 2 and one line naming the file and a field (the edited one
    whenever the edit is refused where it stands), or runs correctly."""
    name, mutation = target
    paths = gate_files(folder / "gate")
    paths[name].write_text(mutation.text, encoding="utf-8")
    texts = {path: path.read_text(encoding="utf-8") for path in paths.values()}
    check_outcome(run_wacc(*gate_argv(paths)), texts, mutation)


_INTERESTING_BYTES = b'"{}[],:\\-.0123456789eEpPx+ \n\xff\x00\xc3'


@st.composite
def byte_edits(draw: st.DrawFn, data: bytes) -> bytes:
    """Up to three byte edits (delete, insert, replace) of ``data``, or a truncation."""
    if draw(st.booleans()):
        return data[: draw(st.integers(0, len(data) - 1))]
    edited = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(edited) - 1))
        byte = draw(st.sampled_from(_INTERESTING_BYTES) | st.integers(0, 255))
        how = draw(st.sampled_from(("delete", "insert", "replace")))
        if how == "delete":
            del edited[at]
        elif how == "insert":
            edited.insert(at, byte)
        else:
            edited[at] = byte
    return bytes(edited)


@given(data=byte_edits(to_json(valid_scenario(), indent=1).encode()))
def test_byte_edited_replay_files_are_one_line_exit_2(folder: Path, data: bytes) -> None:
    """A scenario file with a few edited bytes (not UTF-8, not JSON, or JSON with a changed
    value) is exit 2 with one line naming the file and a field, or a correct run."""
    path = folder / "bytes.json"
    path.write_bytes(data)
    text = data.decode("utf-8", errors="replace")
    check_outcome(run_wacc("replay", str(path)), {path: text}, Mutation(text, None, repr(data)))


@given(
    target=st.sampled_from(sorted(_GATE)).flatmap(
        lambda name: st.tuples(
            st.just(name), byte_edits(json.dumps(_GATE[name], indent=1).encode())
        )
    )
)
def test_byte_edited_gate_files_are_one_line_exit_2(
    folder: Path, target: tuple[str, bytes]
) -> None:
    """A baseline or results file with a few edited bytes is exit 2 with one line naming the
    file and a field, or a correct run."""
    name, data = target
    paths = gate_files(folder / "gate-bytes")
    paths[name].write_bytes(data)
    texts = {p: p.read_bytes().decode("utf-8", errors="replace") for p in paths.values()}
    check_outcome(run_wacc(*gate_argv(paths)), texts, Mutation("", None, f"{name}: {data!r}"))


# ------------------------------------------------------------------------------ the defects
# Each of these failed on 04a5ee3 with a traceback (OverflowError, ValueError, TypeError).

OVERFLOW = "0x1.0p+1024"


def scenario_file(folder: Path, edit: Any, name: str = "edited.json") -> Path:
    """The valid scenario with ``edit(document)`` applied, written to ``folder/name``."""
    document = json.loads(to_json(valid_scenario()))
    edit(document)
    path = folder / name
    path.write_text(json.dumps(document), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("path", "edit"),
    [
        ("loss_scale", lambda d: d.update(loss_scale=OVERFLOW)),
        ("steps[0].weight", lambda d: d["steps"][0].update(weight=OVERFLOW)),
        ("steps[2].grads['w'][1]", lambda d: d["steps"][2]["grads"]["w"].__setitem__(1, OVERFLOW)),
    ],
    ids=["loss_scale", "weight", "gradient"],
)
def test_replay_of_an_overflowing_hex_float_is_exit_2_naming_the_field(
    folder: Path, path: str, edit: Any
) -> None:
    """A float.hex string beyond float64 as loss scale, weight or gradient is exit 2, one line
    naming the file, the field and the value (it was an OverflowError traceback, exit 1)."""
    file = scenario_file(folder, edit)
    line = assert_names(run_wacc("replay", str(file)), file, path)
    assert OVERFLOW in line


def gate_folder(folder: Path, name: str) -> dict[str, Path]:
    """Fresh valid gate files under ``folder/name``."""
    return gate_files(folder / name)


def edit_json(path: Path, edit: Any) -> None:
    document = json.loads(path.read_text(encoding="utf-8"))
    edit(document)
    path.write_text(json.dumps(document), encoding="utf-8")


@pytest.mark.parametrize("shard", ["a/b", "1/x", "", "1/2/3", "12", "/"])
def test_merging_results_with_a_malformed_shard_is_exit_2_naming_it(
    folder: Path, shard: str
) -> None:
    """``--merge`` of a results file whose ``shard`` is not K/N is exit 2, one line naming the
    file and ``shard`` (it was a ValueError traceback, exit 1)."""
    paths = gate_folder(folder, f"shard-{len(shard)}")
    edit_json(paths["shard-2"], lambda d: d.update(shard=shard))
    assert_names(run_wacc(*gate_argv(paths)), paths["shard-2"], "shard")


@pytest.mark.parametrize("name", ["baseline", "shard-1"])
@pytest.mark.parametrize("metric", ["max_ulps", "max_ratio"])
def test_an_overflowing_hex_metric_is_exit_2_naming_the_field(
    folder: Path, name: str, metric: str
) -> None:
    """A metric beyond float64 in a baseline or results file is exit 2, one line naming the file
    and ``entries[<key>].<metric>`` (it was an OverflowError traceback, exit 1)."""
    paths = gate_folder(folder, f"overflow-{name}-{metric}")
    edit_json(paths[name], lambda d: d["entries"][CORPUS_KEY].update({metric: OVERFLOW}))
    assert_names(run_wacc(*gate_argv(paths)), paths[name], f"entries[{CORPUS_KEY!r}].{metric}")


@pytest.mark.parametrize("path", ["corpus.seed", "provenance['big']"])
def test_the_gate_defects_found_by_the_fuzzing_are_exit_2(folder: Path, path: str) -> None:
    """Found while fuzzing, not in the issue: a list as ``corpus.seed`` (TypeError: unhashable
    type) and an integer of more than 4300 digits anywhere (ValueError from json) in a results
    file were tracebacks; both are exit 2 naming the field."""
    paths = gate_folder(folder, f"found-{len(path)}")
    if path == "corpus.seed":
        edit_json(paths["shard-1"], lambda d: d["corpus"].update(seed=[0]))
    else:  # json.dumps cannot even write such an integer: edit the text
        text = paths["shard-1"].read_text(encoding="utf-8")
        huge = text.replace('"provenance": {', '"provenance": {"big": ' + "9" * 5000 + ", ", 1)
        paths["shard-1"].write_text(huge, encoding="utf-8")
    assert_names(run_wacc(*gate_argv(paths)), paths["shard-1"], path)


def test_a_shape_whose_product_python_cannot_print_is_exit_2(folder: Path) -> None:
    """Found while fuzzing: dimensions of 3000 digits each made replay's size message raise
    ValueError (str() of an int over 4300 digits); a dimension is now below 2**63, named."""

    def edit(document: Any) -> None:  # no steps: the count is then only in replay's message
        document["parameters"][0].update(shape=[10**3000, 10**3000])
        document["steps"] = []

    file = scenario_file(folder, edit)
    assert_names(run_wacc("replay", str(file)), file, "parameters[0].shape[0]")


def test_a_lone_surrogate_in_every_gate_file_is_exit_2_naming_the_field(folder: Path) -> None:
    """Found in review: ``"\\ud800"`` (a JSON escape of a lone surrogate) as the implementation of
    the baseline and of every shard merged, then printed in the verdict line, raised
    UnicodeEncodeError on a real (UTF-8) stdout; it is now exit 2 naming the field."""
    paths = gate_folder(folder, "surrogate")
    for name in ("baseline", "shard-1", "shard-2"):
        text = paths[name].read_text(encoding="utf-8")
        paths[name].write_text(text.replace('"wacc_torch"', '"\\ud800"'), encoding="utf-8")
    line = error_line(run_wacc(*gate_argv(paths)))
    assert "implementation: must be Unicode text" in line, line


@pytest.mark.parametrize("shape", [[0, 2**63 - 1, 2**63 - 1], [2**62, 2**62, 0]], ids=repr)
def test_a_zero_size_shape_with_huge_dimensions_is_exit_2(folder: Path, shape: list[int]) -> None:
    """Found in review: a shape with no element passed the size limit, and torch then failed
    computing its strides (RuntimeError, a traceback); each zero-size dimension now counts as 1."""

    def edit(document: Any) -> None:
        document["parameters"][0].update(shape=shape)
        document["steps"] = []

    file = scenario_file(folder, edit)
    line = error_line(run_wacc("replay", str(file)), str(shape))
    assert "parameters:" in line and "zero-size dimension counted as 1" in line, line


def test_a_split_into_a_billion_shards_is_answered_at_once(folder: Path) -> None:
    """Found while fuzzing: ``--merge`` listed every shard 1..N of the split to compare, so a
    results file with shard ``1/999999999`` ran out of time and memory; the missing shards are
    now found among the few the files hold, and the answer names the file and ``shard``."""
    paths = gate_folder(folder, "billion")
    edit_json(paths["shard-1"], lambda d: d.update(shard="1/999999999"))
    edit_json(paths["shard-2"], lambda d: d.update(shard="2/999999999"))
    started = time.perf_counter()
    line = assert_names(run_wacc(*gate_argv(paths)), paths["shard-1"], "shard")
    assert time.perf_counter() - started < 10 and "3/999999999" in line, line


# ------------------------------------------------------------------------------ the decisions
# What the files may contain where a lenient reading is possible (documented in
# wacc_ref/strict_json.py, wacc/gate/baseline.py and the README).


@pytest.mark.parametrize(
    ("name", "key", "outcome"),
    [
        ("baseline", CORPUS_KEY, 2),  # would switch the regression check off: refused
        ("baseline", CHECK_KEY, 0),  # shown, never compared: accepted
        ("shard-1", CORPUS_KEY, 1),  # a measurement: accepted, and a regression
    ],
)
def test_an_inf_metric_is_refused_only_where_it_would_switch_the_gate_off(
    folder: Path, name: str, key: str, outcome: int
) -> None:
    """``"inf"`` as a baseline's corpus metric is exit 2 naming it (``x > inf`` never holds, so
    the key would never regress); in a check key or a results file it is a value like another."""
    paths = gate_folder(folder, f"inf-{name}-{key.replace('/', '-')}")
    edit_json(paths[name], lambda d: d["entries"][key].update(max_ulps="inf"))
    result = run_wacc(*gate_argv(paths))
    if outcome == 2:
        line = assert_names(result, paths[name], f"entries[{key!r}].max_ulps")
        assert "regression check off" in line
    else:
        assert result.code == outcome, result.stdout + result.stderr
        assert (outcome == 1) == (f"REGRESSION: {key}: max_ulps inf" in result.stdout)


@pytest.mark.parametrize(("name", "outcome"), [("baseline", 2), ("shard-1", 1)])
def test_failing_scenarios_are_refused_in_a_baseline_only(
    folder: Path, name: str, outcome: int
) -> None:
    """``failing > 0`` in a baseline is exit 2 naming it (a baseline records a passing run); in
    results it is a shard's hard failure, merged and reported (exit 1)."""
    paths = gate_folder(folder, f"failing-{name}")
    finding = {"signature": "[bound] x", "message": "[bound] x", "replay": None, "steps": 2}
    edit_json(paths[name], lambda d: d["entries"][CORPUS_KEY].update(failing=1, findings=[finding]))
    result = run_wacc(*gate_argv(paths))
    if outcome == 2:
        assert_names(result, paths[name], f"entries[{CORPUS_KEY!r}].failing")
    else:
        assert result.code == 1, result.stdout + result.stderr
        assert "FAILURE 1 scenario(s) in 1 key(s): [bound] x" in result.stdout
        assert f"keys: {CORPUS_KEY} (1)" in result.stdout


SHARD_SPELLINGS = [
    "+2/2", " 2/2", "2/2 ", "2/2\n", "\u0662/\u0662", "02/2", "2/02", "0/2", "3/2", "2/+2", "-2/2",
    "2 /2", "2/2.0", "\uff12/\uff12", "1" * 5000 + "/2",
]  # fmt: skip


@pytest.mark.parametrize("shard", SHARD_SPELLINGS)
def test_a_shard_has_one_spelling_in_files_and_on_the_command_line(
    folder: Path, shard: str
) -> None:
    """``K/N`` is ASCII digits without sign, space or leading zero, ``1 <= K <= N`` (``int()``
    reads ``"+2"``, ``" 2"``, ``"\u0662"`` and ``"\uff12"`` as 2): refused in a results file and
    in ``--shard``; the canonical ``2/2`` is accepted (the valid files use it)."""
    paths = gate_folder(folder, f"spelling-{SHARD_SPELLINGS.index(shard)}")
    edit_json(paths["shard-2"], lambda d: d.update(shard=shard))
    assert_names(run_wacc(*gate_argv(paths)), paths["shard-2"], "shard")
    assert error_line(run_wacc("gate", f"--shard={shard}")).startswith("--shard: ")


def test_a_baseline_covers_the_whole_run(folder: Path) -> None:
    """A baseline's ``shard`` is ``1/1``: ``2/4`` (a valid spelling) is exit 2 naming it."""
    paths = gate_folder(folder, "baseline-shard")
    edit_json(paths["baseline"], lambda d: d.update(shard="2/4"))
    assert_names(run_wacc(*gate_argv(paths)), paths["baseline"], "shard")


@pytest.mark.parametrize("value", [True, 1.0, "1", 4])
def test_version_is_the_json_integer_1(folder: Path, value: object) -> None:
    """``"version": true`` and ``1.0`` equal 1 in Python but are refused, like ``"1"`` and 4
    (scenario files have versions 1 to 3, gate files 2 and 3), in scenario files and gate files
    alike."""
    file = scenario_file(folder, lambda d: d.update(version=value), f"version-{value!r}.json")
    assert_names(run_wacc("replay", str(file)), file, "version")
    paths = gate_folder(folder, f"version-{value!r}")
    edit_json(paths["baseline"], lambda d: d.update(version=value))
    assert_names(run_wacc(*gate_argv(paths)), paths["baseline"], "version")


def test_a_version_1_gate_file_is_refused_with_how_to_record_it_anew(folder: Path) -> None:
    """A gate file of the older format (version 1: findings as strings, no times) is one line
    naming ``version`` and the command that records the baseline anew, not a field error."""
    paths = gate_folder(folder, "version-old")
    edit_json(paths["baseline"], lambda d: d.update(version=1))
    line = assert_names(run_wacc(*gate_argv(paths)), paths["baseline"], "version")
    assert "older wacc" in line and "--update-baseline" in line


def _failing_shard(document: dict[str, Any], findings: list[object]) -> None:
    entry = document["entries"][CHECK_KEY]
    entry.update(failing=1, findings=findings)


GOOD_FINDING = {
    "signature": "[bound] #", "message": "[bound] 1", "replay": "out/gate-00001.json", "steps": 3,
}  # fmt: skip


@pytest.mark.parametrize(
    ("findings", "where"),
    [
        ([GOOD_FINDING, GOOD_FINDING], ""),
        (["[bound] 1"], "[0]"),
        ([{**GOOD_FINDING, "replay": 3}], "[0].replay"),
        ([{"signature": "s", "message": "m", "steps": 1}], "[0].replay"),
        ([{**GOOD_FINDING, "steps": -1}], "[0].steps"),
        ([{**GOOD_FINDING, "extra": 1}], "[0]['extra']"),
        ([{**GOOD_FINDING, "message": None}], "[0].message"),
    ],
    ids=[
        "more-than-failing",
        "a-string",
        "replay-number",
        "replay-missing",
        "negative-steps",
        "unknown",
        "message",
    ],  # fmt: skip
)
def test_a_results_file_holds_at_most_one_well_formed_finding_per_failing_scenario(
    folder: Path, findings: list[object], where: str
) -> None:
    """A shard's ``findings`` are objects with exactly signature, message and replay (a string
    or null), at most one per failing scenario: anything else is one line naming the field."""
    paths = gate_folder(folder, "findings")  # written afresh for each case
    edit_json(paths["shard-2"], lambda d: _failing_shard(d, findings))
    field = f"entries[{CHECK_KEY!r}].findings{where}"
    assert_names(run_wacc(*gate_argv(paths)), paths["shard-2"], field)


def test_a_well_formed_finding_fails_the_merged_gate_with_its_replay_command(
    folder: Path,
) -> None:
    """The same shard with one well-formed finding is read: the merge fails (exit 1) and prints
    the finding's group with its replay command."""
    paths = gate_folder(folder, "findings-good")
    edit_json(paths["shard-2"], lambda d: _failing_shard(d, [GOOD_FINDING]))
    outcome = run_wacc(*gate_argv(paths))
    assert outcome.code == 1, outcome.stdout + outcome.stderr
    assert "FAILURE 1 scenario(s) in 1 key(s): [bound] #" in outcome.stdout
    assert "replay: wacc replay out/gate-00001.json --impl wacc_torch" in outcome.stdout


def test_a_version_2_scenario_without_its_scaler_field_names_it(folder: Path) -> None:
    """A scenario file that says version 2 (dynamic loss scaling) must carry ``scaler`` (an
    object or null): one line naming the missing field, exit 2."""
    file = scenario_file(folder, lambda d: d.update(version=2), "version-2.json")
    assert_names(run_wacc("replay", str(file)), file, "scaler")


@pytest.mark.parametrize(
    ("path", "edit"),
    [
        ("parameters[0].shape[0]", lambda d: d["parameters"][0].update(shape=[True, True])),
        ("steps[1].asynchronous", lambda d: d["steps"][1].update(asynchronous=1)),
        ("fused", lambda d: d.update(fused=0)),
    ],
    ids=["shape", "asynchronous", "fused"],
)
def test_bool_and_int_never_stand_for_each_other_in_a_scenario(
    folder: Path, path: str, edit: Any
) -> None:
    """A ``true`` where an integer belongs, or 0/1 where a bool belongs, is exit 2 naming it."""
    file = scenario_file(folder, edit, f"bool-{path[:5]}.json")
    assert_names(run_wacc("replay", str(file)), file, path)


@pytest.mark.parametrize(
    ("path", "edit"),
    [
        (
            f"entries[{CORPUS_KEY!r}].scenarios",
            lambda d: d["entries"][CORPUS_KEY].update(scenarios=True),
        ),
        (
            f"entries[{CORPUS_KEY!r}].failing",
            lambda d: d["entries"][CORPUS_KEY].update(failing=False),
        ),
        ("corpus.seed", lambda d: d["corpus"].update(seed=False)),  # False == 0 == the gate's seed
    ],
    ids=["scenarios", "failing", "seed"],
)
def test_bool_never_counts_as_an_int_in_a_gate_file(folder: Path, path: str, edit: Any) -> None:
    """``true``/``false`` as a count or a seed is exit 2 naming it (``False == 0`` in Python:
    ``{"seed": false}`` would otherwise equal the gate's corpus)."""
    paths = gate_folder(folder, f"bool-{path[:12].replace('/', '-')}")
    edit_json(paths["baseline"], edit)
    assert_names(run_wacc(*gate_argv(paths)), paths["baseline"], path)


# Spellings float.fromhex reads but float.hex never writes: refused, the message saying how the
# value they read as is written (a decimal "0.125" reads as hex 0x0.125 = 0.0715...).
THREE = "0x1.8000000000000p+1"
OTHER_SPELLINGS = {
    "1.8p1": THREE, "0X1.8P+1": THREE, "0x1.8p+1": THREE,
    " 0x1.8000000000000p+1": THREE, "0x1.8000000000000p+1\n": THREE,
    "+0x1.8000000000000p+1": THREE, "-0x0p+0": "-0x0.0p+0", "0x1p-1080": "0x0.0p+0",
    "0.125": "0x1.2500000000000p-4", "infinity": "inf", "Infinity": "inf", "-nan": "nan",
    "NaN": "nan", "0x1.00000000000001p+0": "0x1.0000000000000p+0",
}  # fmt: skip


@pytest.mark.parametrize("spelling", sorted(OTHER_SPELLINGS))
def test_a_float_has_the_one_spelling_float_hex_writes(folder: Path, spelling: str) -> None:
    """Every other spelling ``float.fromhex`` reads (no ``0x``, ``0X``, spaces, ``+``, short or
    long mantissas, ``infinity``, ``-nan``, a decimal) is exit 2 naming the field, and the line
    says how the value it reads as is written."""
    file = scenario_file(
        folder, lambda d: d["steps"][0].update(weight=spelling), f"spelling-{len(spelling)}.json"
    )
    line = assert_names(run_wacc("replay", str(file)), file, "steps[0].weight")
    assert repr(OTHER_SPELLINGS[spelling]) in line


@pytest.mark.parametrize("weight", ["nan", "inf", "-inf", "-0x0.0p+0", "-0x1.0000000000000p+0"])
def test_special_values_are_scenario_data(folder: Path, weight: str) -> None:
    """NaN, infinities, -0.0 and negative weights spelled as float.hex writes them are read
    (they model error paths): the replay runs (exit 0, wacc_torch agrees)."""
    file = scenario_file(folder, lambda d: d["steps"][0].update(weight=weight), "special.json")
    result = run_wacc("replay", str(file))
    assert result.code == 0, result.stdout + result.stderr


@pytest.mark.parametrize("value", ["nan", "-0x0.0p+0", "-0x1.0000000000000p-1"])
def test_a_metric_is_never_nan_or_negative(folder: Path, value: str) -> None:
    """A gate metric is a maximum of absolute errors starting at +0.0: NaN, -0.0 and negatives
    are exit 2 naming it, in results files as in baselines."""
    paths = gate_folder(folder, f"metric-{len(value)}")
    edit_json(paths["shard-1"], lambda d: d["entries"][CORPUS_KEY].update(max_ratio=value))
    assert_names(
        run_wacc(*gate_argv(paths)), paths["shard-1"], f"entries[{CORPUS_KEY!r}].max_ratio"
    )


def test_a_repeated_key_is_refused(folder: Path) -> None:
    """Two equal keys in one object (``json`` keeps the last: a merge conflict resolved by keeping
    both lines) is exit 2 naming the key, in a baseline as in a scenario file."""
    paths = gate_folder(folder, "repeated")
    text = paths["baseline"].read_text(encoding="utf-8")
    looser = text.replace(
        '"max_ulps": "0x1.0000000000000p+0"',
        '"max_ulps": "0x1.0000000000000p+0", "max_ulps": "inf"',
        1,
    )
    assert looser != text
    paths["baseline"].write_text(looser, encoding="utf-8")
    assert_names(
        run_wacc(*gate_argv(paths)), paths["baseline"], f"entries[{CORPUS_KEY!r}]['max_ulps']"
    )


def test_a_file_name_with_a_line_break_stays_one_line(folder: Path) -> None:
    """The one-line contract holds when the file's name has a line break in it."""
    file = scenario_file(folder, lambda d: d.update(loss_scale=OVERFLOW), "two\nlines\u2028.json")
    assert_names(run_wacc("replay", str(file)), file, "loss_scale")


# ------------------------------------------------------------------------------ read back


@given(
    entries=st.dictionaries(
        st.sampled_from([CORPUS_KEY, CHECK_KEY, "bfloat16/interruptions/corpus"]),
        st.builds(
            Metrics,
            scenarios=st.integers(0, 2**63 - 1),
            failing=st.integers(0, 3),
            max_ulps=st.floats(min_value=0.0),
            max_ratio=st.floats(min_value=0.0),
            findings=st.lists(
                st.builds(
                    GateFinding,
                    st.text(max_size=20),
                    st.text(max_size=20),
                    st.none() | st.text(max_size=20),
                ),
                max_size=3,
            ),  # fmt: skip
            milliseconds=st.integers(0, 2**63 - 1),
        ),
        max_size=3,
    ),
    kind=st.sampled_from([BASELINE_FORMAT, RESULTS_FORMAT]),
    shard=st.sampled_from(["1/1", "1/2", "7/9"]),
)
def test_what_the_gate_writes_it_reads_back(
    folder: Path, entries: dict[str, Metrics], kind: str, shard: str
) -> None:
    """``write_gate_file`` writes a file that ``read_gate_file`` returns unchanged, or refuses
    before writing anything, exactly when the content breaks the rules (failing > scenarios or
    more findings than failing scenarios, which no run records; and in a baseline failing > 0, a
    shard other than 1/1 or an inf corpus metric)."""
    from wacc.errors import UsageError
    from wacc.gate.baseline import read_gate_file

    baseline = kind == BASELINE_FORMAT
    breaks_rules = (
        any(m.failing > m.scenarios or len(m.findings) > m.failing for m in entries.values())
        or baseline
        and (
            shard != "1/1"
            or any(m.failing for m in entries.values())
            or any(
                k.endswith("/corpus") and math.inf in (m.max_ulps, m.max_ratio)
                for k, m in entries.items()
            )  # fmt: skip
        )
    )
    path = folder / "round-trip" / "file.json"
    path.unlink(missing_ok=True)
    gate_file = GateFile(kind=kind, implementation="x", entries=entries, shard=shard,
                         provenance=PROVENANCE)  # fmt: skip
    try:
        write_gate_file(gate_file, path)
    except UsageError as exc:
        event("refused")
        assert breaks_rules, f"refused content within the rules: {exc}"
        assert not path.exists() and "could not be read back" in str(exc), str(exc)
        return
    assert not breaks_rules, f"wrote content that breaks the rules: {entries}, {kind}, {shard}"
    back = read_gate_file(path, kind=kind)
    assert back.entries == entries and back.shard == shard and back.provenance == PROVENANCE


# ------------------------------------------------------------------------------ what a user sees


def wacc_subprocess(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "wacc", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip


def test_the_command_prints_what_main_returns(folder: Path) -> None:
    """``python -m wacc`` answers the overflowing loss scale and the malformed shard exactly as
    ``main`` does in process: exit 2, the same one line, no traceback (two real runs)."""
    file = scenario_file(folder, lambda d: d.update(loss_scale=OVERFLOW), "subprocess.json")
    paths = gate_folder(folder, "subprocess")
    edit_json(paths["shard-2"], lambda d: d.update(shard="a/b"))
    for argv in (["replay", str(file)], gate_argv(paths)):
        inside = run_wacc(*argv)
        outside = wacc_subprocess(*argv)
        assert (outside.returncode, outside.stderr) == (inside.code, inside.stderr), (
            f"wacc {' '.join(argv)}\n{outside.stderr}"
        )
        error_line(inside)
