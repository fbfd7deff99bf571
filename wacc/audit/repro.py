"""Reproducers: per failing audit row, one standalone script that shows the failure outside wacc.

``wacc audit --repro DIR`` writes ``DIR/<loop>-<window>.py`` for every FAIL cell and
``DIR/<loop>-<window>-resume.py`` for every loop whose mid-window resume lost the pending gradient
(measured on the audit's first window).  A script imports torch, the framework and the standard
library only: it holds the window's token ids as literals, builds the model from its config (the
audit's plain causal LM written out; a LoRA model's adapters from ``LoraConfig``, drawn from
torch's RNG reseeded with wacc's seed, as :mod:`wacc.audit.models` draws them) with wacc's model
seed, computes the exact gradient (the float64 gradient of the window's mean token loss on a
float64 copy of the model) and runs the framework's accumulation the framework's way
(:mod:`wacc.audit.repro_templates`), then prints the relative L2 error of the gradient the
framework hands its optimizer, and the token counts.

Across ranks (``--world-size N``) a FAIL row gets ``DIR/<loop>-<window>-ranks<N>.py`` instead,
for a loop whose template has a ``ranks`` text: ``python -m torch.distributed.run
--nproc-per-node N`` runs it on a CPU (gloo); every rank's window is in it, each rank builds its
own, the exact gradient is the mean over every rank's tokens, and rank 0 prints the row's float64
error and whether the ranks agree.

Which loops have a template (:data:`wacc.audit.repro_templates.LOOPS`): every loop that can fail
in the audit — ``transformers.Trainer`` (every ``trainer-*`` model family and the PEFT LoRA
loops), ``accelerate`` and ``accelerate-variable``, ``lightning`` and ``lightning-manual``,
``litgpt`` and ``litgpt-bf16-mixed``, ``keras``, ``deepspeed``, ``trl-sft`` and
``trl-sft-packing``, ``nanogpt``, ``pixparse``, ``plain``, ``olmo-core`` and ``torchtune`` (its
recipe class loaded from torchtune's ``recipes`` folder and its ``train()`` run on the window's
objects, as the adapter does) — except ``timm`` (its loop needs torchvision; ``pixparse`` is the
same loop without it: a note says it has none); ``torchtitan`` and the rest pass in the
committed run (``trl-sft-fp32``, the ``wacc_torch`` loops).  A user's own loop
(``module:function`` or ``path/file.py:function``) gets one written from the ``LoopTask`` it ran
(:mod:`wacc.audit.repro_templates.user`; the file ``<module>.<function>-<window>.py``): the script
imports the user's function from where the audit found it and calls it with that task written out
as a class, so it needs whatever the user's module imports.  A failure of a loop without one gets
a note (``no reproducer template for this loop``), and so does a lost resume whose template has
no restart (``plain``, ``pixparse``, ``accelerate*`` and ``lightning*`` have one).

Which number it reproduces, and why it can match: the model has the audit's weights (same class,
config and seed; the weights rounded to the audit's dtype first, as the audit does) and the
window's data, so a cell's script runs the framework in float64 (``DTYPE``) and prints the row's
float64-run error (``f64_rel_l2`` in ``audit.csv``), the error of the loop's weighting alone: the
same float64 operations as the audit's float64 run, its exact side differing from the audit's
truth only in the order of K float64 additions.  Setting ``DTYPE = torch.float32`` gives the
float32 run (the table's ``rel L2``), which adds rounding.  A resume script runs in the audit's
dtype, as the audit's resumed run did, and prints the ``resumed rel L2``.
"""

from __future__ import annotations

import ast
import platform
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from wacc.audit.models import (
    MASK_TOKEN,
    MODEL_KINDS,
    MODEL_SEED,
    PAD_TOKEN,
    POSITIONS,
    ModelSpec,
    lora_options,
)
from wacc.audit.protocol import Adapter
from wacc.audit.repro_templates import LOOPS, LoopTemplate, user
from wacc.audit.repro_templates.common import (
    EXACT,
    FAMILIES,
    GRADIENT,
    PLAIN_MODEL,
    RANK_END,
    RANK_EXACT,
    RANK_GRADIENT,
    RANK_RESULT,
    RESULT,
)
from wacc.audit.results import AuditResult, Cell, LoopFacts
from wacc.audit.windows import IGNORE_INDEX, Window

__all__ = ["LOST", "Reproducer", "write_reproducers"]

_STDLIB = frozenset(sys.stdlib_module_names)
LOST = "pending gradient lost"  # the runner's resume fact that gets a reproducer


@dataclass(frozen=True)
class Reproducer:
    """One script written, and the audit's number it prints."""

    path: Path
    loop: str
    window: str
    resume: bool  # a mid-window resume fact (else a FAIL cell)
    dtype: str  # what the script computes in
    expected: float  # the row's number: f64_rel_l2, or resumed rel L2


def write_reproducers(result: AuditResult, directory: Path) -> tuple[list[Reproducer], list[str]]:
    """Write the reproducers of ``result`` into ``directory`` (module docstring); returns them
    and one note per failure that has none (a loop without a template)."""
    windows = {w.name: w for w in result.windows}
    facts = {f.adapter.name: f for f in result.facts}
    written: list[Reproducer] = []
    notes: list[str] = []
    for cell in result.cells:
        if cell.verdict != "FAIL":
            continue
        template = LOOPS.get(cell.adapter) or _user_template(facts[cell.adapter].adapter, result)
        if template is None:
            notes.append(f"{cell.adapter} / {cell.window}: no reproducer template for this loop")
            continue
        if result.world_size > 1:
            if template.ranks is None:
                notes.append(f"{cell.adapter} / {cell.window}: no reproducer across ranks for "
                             "this loop")  # fmt: skip
                continue
            path = directory / f"{cell.adapter}-{cell.window}-ranks{result.world_size}.py"
            ranks = result.rank_windows[cell.window]
            text = _rank_script(result.dtype, facts[cell.adapter].adapter, ranks, template, cell)
            path.write_text(text, encoding="utf-8")
            written.append(
                Reproducer(path, cell.adapter, cell.window, False, "float64", cell.semantic_rel_l2)
            )
            continue
        fact = facts[cell.adapter]
        path = directory / f"{_stem(cell.adapter)}-{cell.window}.py"
        text = _script(result.dtype, fact.adapter, windows[cell.window], template, cell=cell)
        path.write_text(text, encoding="utf-8")
        written.append(
            Reproducer(path, cell.adapter, cell.window, False, "float64", cell.semantic_rel_l2)
        )
    first = result.windows[0] if result.windows and result.world_size == 1 else None
    for fact in result.facts:
        if fact.status != "ok" or fact.resume != LOST or first is None:
            continue
        template = LOOPS.get(fact.adapter.name) or _user_template(fact.adapter, result)
        if template is None or template.resume is None or fact.resume_after is None:
            notes.append(f"{fact.adapter.name}: no reproducer for its mid-window resume")
            continue
        path = directory / f"{_stem(fact.adapter.name)}-{first.name}-resume.py"
        path.write_text(_script(result.dtype, fact.adapter, first, template, fact=fact), "utf-8")
        written.append(
            Reproducer(path, fact.adapter.name, first.name, True, result.dtype, fact.resume_rel_l2)
        )
    return written, notes


def _stem(loop: str) -> str:
    """The file name's start for ``loop``: a built-in loop's name; a user loop's module (or file
    name without ``.py``) and function joined by a dot (no folder, no colon)."""
    if ":" not in loop:
        return loop
    location, function = loop.rsplit(":", 1)
    return f"{Path(location).name.removesuffix('.py')}.{function}"


def _user_template(adapter: Adapter, result: AuditResult) -> LoopTemplate | None:
    """The template of a user loop (``module:function`` or ``path/file.py:function``): its
    function imported from where the audit found it and called with the ``LoopTask`` written out
    (:mod:`wacc.audit.repro_templates.user`); None for a built-in loop or a function whose
    module cannot be located (no file)."""
    from wacc.audit.adapters import ADAPTERS

    if adapter.name in ADAPTERS or ":" not in adapter.name:
        return None
    location, function = adapter.name.rsplit(":", 1)
    module_name = getattr(adapter.run, "__module__", None)
    module = sys.modules.get(module_name) if isinstance(module_name, str) else None
    file = getattr(module, "__file__", None)
    if not isinstance(file, str):
        return None

    def text(resume: bool) -> str:
        weights = result.dtype
        if location.endswith(".py"):
            return user.body(module=None, path=str(Path(file).resolve()), function=function,
                             weights=weights, resume=resume)  # fmt: skip
        # The import root: up from the module's file by its dotted name's depth.
        source = Path(file).resolve()
        if source.name == "__init__.py":
            source = source.parent
        root = source.parents[len(location.split(".")) - 1]
        return user.body(module=location, path=str(root), function=function, weights=weights,
                         resume=resume)  # fmt: skip

    return LoopTemplate(f"the user loop {adapter.name}", (), user.IMPORTS, text(False), text(True))


def _script(
    dtype: str,
    adapter: Adapter,
    window: Window,
    template: LoopTemplate,
    *,
    cell: Cell | None = None,
    fact: LoopFacts | None = None,
) -> str:
    spec = MODEL_KINDS[adapter.model]
    resume = fact is not None
    body = template.resume if resume else template.body
    assert body is not None
    imports, model = _model(spec, dtype)
    parts = [
        _header(dtype, adapter, window, template, cell=cell, fact=fact),
        _imports([*template.imports, *(template.resume_imports if resume else ()), *imports]),
        _constants(dtype, window, fact),
        model,
        FAMILIES[spec.family].format(pad=PAD_TOKEN, mask=MASK_TOKEN),
        GRADIENT,
        EXACT,
        body,
        RESULT.format(framework=template.framework),
    ]
    return _join(parts)


def _rank_script(
    dtype: str, adapter: Adapter, ranks: Sequence[Window], template: LoopTemplate, cell: Cell
) -> str:
    """The script of a FAIL cell across ranks: run by ``torchrun --nproc-per-node N`` (gloo)."""
    spec = MODEL_KINDS[adapter.model]
    assert template.ranks is not None
    imports, model = _model(spec, dtype)
    ranks_imports = template.imports if template.ranks_imports is None else template.ranks_imports
    n = len(ranks)
    totals = ", ".join(str(w.total_targets) for w in ranks)
    docstring = [
        f"{template.framework} ({_model_name(adapter)}) across {n} data-parallel ranks "
        f"(torch.distributed, gloo): each rank accumulates over its own window of "
        f"{len(ranks[0].targets)} microbatches, {totals} target tokens per rank, against the exact "
        "gradient of the mean token loss over every rank's tokens.  Rank 0 prints the relative L2 "
        "error of the gradient the loop hands its optimizer (0 up to rounding for a loop that "
        "computes the mean) and whether every rank holds the same gradient.",
        f"Run: python -m torch.distributed.run --nproc-per-node {n} {cell.adapter}-{cell.window}"
        f"-ranks{n}.py (or torchrun; a CPU is enough, neither wacc nor a GPU is needed).",
        f"Code path: {adapter.code_path}.",
        f"Reproduces the `wacc audit --dtype {dtype} --world-size {n}` row {adapter.name} / "
        f"{cell.window}: f64 rel L2 {cell.semantic_rel_l2:.12g} (printed here), {dtype} run "
        f"{cell.rel_l2:.6g}.",
        f"Generated with Python {platform.python_version()}, {_versions(template)}.",
    ]
    header = '"""' + "\n".join(textwrap.fill(p, width=96) for p in docstring) + '\n"""'
    tokens, labelled = zip(*(_tokens(w) for w in ranks), strict=True)
    constants = "\n".join(
        [
            f"DTYPE = torch.float64  # the audit's float64 run (torch.{dtype}: its {dtype} run)",
            "RANK_TOKENS = [  # per rank: its window's microbatches (token ids, batch size 1)\n"
            + "".join(
                "    [\n"
                + "".join(f"        {_literal(t, '        ')},\n" for t in rank)
                + "    ],\n"
                for rank in tokens
            )
            + "]",
            f"RANK_LABELLED = {list(labelled)}  # False: a microbatch without target tokens",
        ]
    )
    parts = [
        header,
        _imports(["import gc", "import torch.distributed as dist", *ranks_imports, *imports]),
        constants,
        model,
        FAMILIES[spec.family].format(pad=PAD_TOKEN, mask=MASK_TOKEN),
        RANK_GRADIENT,
        RANK_EXACT,
        template.ranks,
        RANK_RESULT.format(framework=template.framework),
        RANK_END.format(delete=_delete(template.ranks)),
    ]
    return _join(parts)


# What RANK_RESULT and RANK_END read: the loop's names they must not lose.
_READ_AFTER_LOOP = frozenset(
    node.id
    for part in (RANK_RESULT.format(framework=""), RANK_END.format(delete=""))
    for node in ast.walk(ast.parse(part))
    if isinstance(node, ast.Name)
)


def _delete(loop: str) -> str:
    """``del NAMES\n`` of the names ``loop``'s top-level statements always assign (so each is
    bound when the line runs), but those read after it; empty when there are none."""
    names: list[str] = []
    for statement in ast.parse(loop).body:
        if isinstance(statement, ast.Assign):
            targets = statement.targets
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            targets = [statement.target]
        else:
            continue
        for target in targets:
            for node in ast.walk(target):
                if (
                    isinstance(node, ast.Name)
                    and isinstance(node.ctx, ast.Store)
                    and node.id not in _READ_AFTER_LOOP
                    and node.id not in names
                ):
                    names.append(node.id)
    return f"del {', '.join(names)}\n" if names else ""


def _join(parts: Sequence[str]) -> str:
    text = parts[0].strip("\n")
    for part in parts[1:]:
        part = part.strip("\n")
        # Two blank lines around a function or class (PEP 8), one elsewhere.
        around_def = part.startswith(("def ", "class ")) or text.splitlines()[-1].startswith(" ")
        text += ("\n\n\n" if around_def else "\n\n") + part
    return text + "\n"


def _imports(lines: Sequence[str]) -> str:
    """The import block: the standard library first, then torch, then the frameworks."""
    lines = list(dict.fromkeys(lines))  # a line two parts need, once
    stdlib = sorted(line for line in lines if line.split()[1].split(".")[0] in _STDLIB)
    torch_lines = ["import torch", "from torch.nn import functional as F"]
    others = [line for line in lines if line not in stdlib]
    return "\n\n".join(
        block for block in ("\n".join(stdlib), "\n".join(torch_lines + others)) if block
    )


def _versions(template: LoopTemplate) -> str:
    names = ("torch", *template.distributions)
    return ", ".join(f"{n} {metadata.version(n)}" for n in names)


def _header(
    dtype: str,
    adapter: Adapter,
    window: Window,
    template: LoopTemplate,
    *,
    cell: Cell | None,
    fact: LoopFacts | None,
) -> str:
    counts = ", ".join(str(n) for n in window.targets)
    k = len(window.targets)
    resumed = ""
    if fact is not None:
        resumed = (
            f", checkpointed after {fact.resume_after} of them (the loop's own save and load) "
            "and resumed in fresh objects"
        )
    what = (
        f"{template.framework} ({_model_name(adapter)}): gradient accumulation over K = {k} "
        f"microbatches of {counts} target tokens{resumed}, against the exact gradient of the "
        "window's mean token loss.  Prints the relative L2 error of the gradient the loop hands "
        "its optimizer (0 up to rounding for a loop that computes the mean)."
    )
    if template.window_note:
        what += " " + template.window_note
    if fact is not None:
        row = (
            f"Reproduces the mid-window resume of {adapter.name} in `wacc audit --dtype {dtype}` "
            f"(window {window.name}): resumed rel L2 {fact.resume_rel_l2:.12g} (run in {dtype}, "
            "as here)."
        )
    else:
        assert cell is not None
        row = (
            f"Reproduces the `wacc audit --dtype {dtype}` row {adapter.name} / {window.name}: "
            f"f64 rel L2 {cell.semantic_rel_l2:.12g} (printed here), {dtype} run "
            f"{cell.rel_l2:.6g}."
        )
    paragraphs = [
        what,
        f"Code path: {adapter.code_path}.",
        row,
        f"Generated with Python {platform.python_version()}, {_versions(template)}.",
    ]
    return '"""' + "\n".join(textwrap.fill(p, width=96) for p in paragraphs) + '\n"""'


def _model_name(adapter: Adapter) -> str:
    spec = MODEL_KINDS[adapter.model]
    base = MODEL_KINDS[spec.lora or spec.name].build(torch.float32)
    name = type(base).__name__ + (" built from a config" if hasattr(base, "config") else "")
    return name + (" with LoRA adapters" if spec.lora else "")


def _literal(values: Sequence[Any], indent: str) -> str:
    lines = textwrap.wrap(", ".join(str(v) for v in values), width=96 - len(indent))
    return "[" + f"\n{indent} ".join(lines) + "]"


def _tokens(window: Window) -> tuple[list[list[int]], list[bool]]:
    """The window's microbatches without their right padding, and which have targets."""
    tokens, labelled = [], []
    for mb in window.microbatches:
        ids, labels = mb["input_ids"].tolist(), mb["labels"].tolist()
        # The right padding: trailing pad ids whose labels are ignored.
        while ids and ids[-1] == PAD_TOKEN and labels[-1] == IGNORE_INDEX:
            ids.pop()
            labels.pop()
        if labels not in (ids, [IGNORE_INDEX] * len(ids)):
            raise ValueError(f"window {window.name}: a microbatch the reproducer cannot write")
        tokens.append(ids)
        labelled.append(labels == ids)
    return tokens, labelled


def _constants(dtype: str, window: Window, fact: LoopFacts | None) -> str:
    tokens, labelled = _tokens(window)
    if fact is None:
        run = f"torch.{dtype}: its {dtype} run"
        lines = [f"DTYPE = torch.float64  # the audit's float64 run ({run})"]
    else:
        lines = [f"DTYPE = torch.{dtype}  # the audit's resumed run"]
        lines.append(f"CHECKPOINT_AFTER = {fact.resume_after}  # microbatches before the restart")
    lines.append(
        "TOKENS = [  # the window: one optimizer step's microbatches (token ids, batch size 1)\n"
        + "".join(f"    {_literal(t, '    ')},\n" for t in tokens)
        + "]"
    )
    lines.append(f"LABELLED = {labelled}  # False: a microbatch without target tokens")
    return "\n".join(lines)


def _model(spec: ModelSpec, dtype: str) -> tuple[list[str], str]:
    """The import lines and the ``build_model`` source for ``spec`` (the audit's weights; a LoRA
    model: its base model's, then the adapters, drawn from torch's RNG reseeded right after the
    base as :mod:`wacc.audit.models` does)."""
    base = MODEL_KINDS[spec.lora or spec.name].build(torch.float32)
    weights = "" if dtype == "float32" else f".to(torch.{dtype})"  # the audit rounds them first
    config = getattr(base, "config", None)
    if config is None:  # the audit's own plain model, written out
        embed = base.get_submodule("embed")
        assert isinstance(embed, torch.nn.Embedding)
        source = PLAIN_MODEL.format(
            vocab=embed.num_embeddings, width=embed.embedding_dim, positions=POSITIONS
        )
        imports: list[str] = []
        make = "TinyCausalLM()"
    else:
        kind = type(config)
        full = {k: v for k, v in config.to_dict().items() if k != "transformers_version"}
        defaults = kind().to_dict()
        kwargs = {k: v for k, v in full.items() if k not in defaults or defaults[k] != v}
        rebuilt = {k: v for k, v in kind(**kwargs).to_dict().items() if k in full}
        if rebuilt != full:  # the literal config must rebuild this one exactly
            raise ValueError(f"{spec.name}: its config does not round-trip through its kwargs")
        arguments = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        imports = [f"from transformers import {kind.__name__}, {type(base).__name__}"]
        source = "\nconfig = " + kind.__name__ + "(\n    "
        source += "\n    ".join(textwrap.wrap(arguments + ",", width=92)) + "\n)\n"
        make = f"{type(base).__name__}(config)"
    built = f"return {make}{weights}.to(DTYPE)"
    if spec.lora is not None:
        imports.append("from peft import LoraConfig, get_peft_model")
        options = ", ".join(f"{k}={v!r}" for k, v in lora_options(spec.lora).items())
        built = f"""model = {make}
    torch.manual_seed({MODEL_SEED})  # the LoRA weights: torch's RNG, reseeded as wacc does
    lora = LoraConfig(
{textwrap.fill(options + ",", width=96, initial_indent=" " * 8, subsequent_indent=" " * 8)}
    )
    return get_peft_model(model, lora){weights}.to(DTYPE)"""
    source += f"""

def build_model():
    torch.manual_seed({MODEL_SEED})  # wacc's model seed: the audit's weights
    {built}
"""
    return imports, source
