"""What makes two divergences one finding: their signature.

The same bug (a wrong division, say) fails in float32 and in bfloat16, in several families and
in many corpus scenarios, each time with other values, steps, sizes, parameter names and
wording. The signature keeps what diverged, not how the line reads: at the first step that
fails, the oracle that saw it, the kind of step (``accumulate``, ``finish``, ``checkpoint``,
``restore``, ...: a sum and a mean are one kind) and the quantity compared there (a counter of
the state, the pending buffers, the finished gradients, the error class expected and raised,
the error bound). An error the semantics demand is one quantity whatever came instead (``None``,
another class due at that step too, a crash of the implementation: the refusal is what is
missing); an error raised where none was due is one per class raised (which check misfired), and
so is a §11 class raised where the semantics demand another and none of its class is due at all
(the reference's ``due`` refusals: a check that misfired before the one that should refuse).
A step that raised and changed the state is that (§11), whichever counter or buffer moved; a
checkpoint whose record is not right is "record" (§9), whichever field shows it; an exception
from the implementation's ``state_dict()`` or ``state`` when the judge reads the state after a
step is "state read", whatever the step was and whatever it was expected to do.
Where one step fails several oracles, the semantics' (an error class or a counter) is what
diverged, the values (emulation) and their error bound (bound) follow from it; where no step
fails, the scenario's own finding (resume), or, when the scenario without its checkpoints and
restores fails on its own, that run's (the restore hid what the whole window shows). ``wacc
check`` prints one block per signature, ``wacc gate`` one group per signature (with counts and
one replay command): both call :func:`signature`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the judge is imported by the commands when they run (a fast --help)
    from wacc.judge.verdict import ScenarioVerdict

__all__ = ["divergence", "line_signature", "signature"]

# Quoted names first (parameters differ from one family to the next), then hex floats, inf/nan,
# booleans and decimal numbers (a leading sign included: -0.0 and +0.0 are one shape).
# (inf and nan as words: "found_inf" is a name)
_VALUE = re.compile(
    r"'[^']*'|-?(?:0x[0-9a-f.]+p[+-]?\d+|\b(?:inf|nan|True|False)\b|\d+(?:\.\d+)?(?:e[+-]?\d+)?)"
)
# A step's failure line: "step N (op[, weight W])", then " quantity: ..." or ": what ...".
_STEP = re.compile(r"^step \d+ \((?P<op>[a-z_]+)[^)]*\)(?P<rest>.*)$", re.DOTALL)
_SUM_OR_MEAN = re.compile(r"_(?:sum|sums|mean)$")
_ERROR = re.compile(r"^(?:error )?expected (?P<expected>.+?), got (?P<actual>.+)$", re.DOTALL)
_NOT_DUE = re.compile(r" \(no \w+ is due at this step\)$")  # wacc_ref.oracles' annotation
_SUBSCRIPT = re.compile(r"\[[^\]]*\]")  # [flat 3], ['w'], [#]: which element, not what
_END_OF_QUANTITY = re.compile(r":| =| >| expected|,|;")
_PREFERENCE = ("semantics", "emulation", "bound")  # what diverged first at a failing step
# A raise that changed the state (§11: a step that raises changes nothing) and a record that is
# not its state (§9): the invariant is the quantity, which field shows it is a detail.
_CHANGED_BY_A_RAISE = " raised but changed state"
_WHICH_FIELD = re.compile(r"^(raised but changed state|record)\.\S+$")
# The implementation's state_dict() or state raising when the judge reads the state after a step
# (wacc.judge.runner): one bug of its own, whatever the step did or was expected to do.
_STATE_READ = re.compile(
    r"unexpected (?P<cls>\w+) from (?P<call>state_dict\(\)|state|reading the record of "
    r"state_dict\(\))$"
)


def line_signature(line: str) -> str:
    """``line`` with every number, hex float and quoted name replaced by ``#``."""
    return _VALUE.sub("#", line)


def divergence(oracle: str, line: str) -> str:
    """``[oracle] kind: quantity`` of one failure line of ``oracle`` (see the module
    docstring): the values, names and positions in it, and its wording, left out."""
    match = _STEP.match(line)
    if match is None:  # a scenario's own line ("resume is not bit-identical: ...")
        return f"[{oracle}] scenario: {line_signature(line).split(':', 1)[0]}"
    kind = _SUM_OR_MEAN.sub("", match["op"])
    rest = match["rest"].removeprefix(":").strip()
    error = _ERROR.match(rest)
    read = _STATE_READ.search(rest) if oracle == "semantics" else None
    if read is not None:  # whichever step came before and whatever it was expected to do
        return f"[{oracle}] state read: unexpected {read['cls']} from {read['call']}"
    if oracle == "bound":  # its one quantity, however the line shows the worst element
        quantity = "error within the bound"
    elif error is not None and error["expected"] != "None" and _NOT_DUE.search(error["actual"]):
        # A refusal whose class is due nowhere in the step's checks (the reference's order
        # demands another first): the check that misfired is the fault, as where none was due.
        quantity = f"error expected None, got {_NOT_DUE.sub('', error['actual'])}"
    elif error is not None and error["expected"] != "None":  # a refusal that did not come
        quantity = f"error expected {error['expected']}"
    elif error is not None:  # a refusal where none was due: the class raised says which check
        quantity = f"error expected None, got {error['actual'].split(':', 1)[0]}"
    else:
        head = _END_OF_QUANTITY.split(line_signature(rest), maxsplit=1)[0]
        quantity = _SUBSCRIPT.sub("", head).strip() or line_signature(rest)
        if kind == "checkpoint" or quantity.startswith(_CHANGED_BY_A_RAISE.strip()):
            quantity = _WHICH_FIELD.sub(r"\1", quantity)
    return f"[{oracle}] {kind}: {quantity}"


def signature(verdict: ScenarioVerdict) -> str:
    """What diverged at the first failing step of ``verdict`` (see the module docstring)."""
    for step in verdict.steps:
        firsts = dict(step.firsts)
        raised = [line for line in step.lines if _CHANGED_BY_A_RAISE in line]
        if "semantics" in firsts and raised:  # the raise's own fault, whatever else differs
            return divergence("semantics", raised[0])
        for oracle in _PREFERENCE:
            if oracle in firsts:
                return divergence(oracle, firsts[oracle])
    if verdict.uninterrupted is not None:  # a restore hid what the whole window shows
        return signature(verdict.uninterrupted)
    lines = verdict.describe(limit=1)
    return divergence("semantics", lines[0]) if lines else "(no divergence)"
