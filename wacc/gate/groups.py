"""The gate's failures grouped by signature: one bug, one group, with counts.

A wrong division fails hundreds of corpus scenarios and every check family on every dtype, each
with other numbers; :mod:`wacc.judge.signature` gives them one signature, and a group counts its
scenarios per key and keeps the first finding (its message and replay file) to show.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from wacc.gate.measure import GateFinding, Metrics

__all__ = ["UNREPRODUCED", "FailureGroup", "group_findings"]

# A check family's failure is judged once more after the (time-boxed) shrink; a failure that
# does not recur has no finding of its own, and still fails the gate: it gets this one.
UNREPRODUCED = GateFinding(
    signature="(a failure that did not recur when judged again)",
    message="a scenario failed, and passed when judged again: is the implementation "
    "deterministic? (`wacc check` on this dtype and family searches and shrinks it)",
)


@dataclass
class FailureGroup:
    """The failing scenarios of one signature."""

    signature: str
    first_key: str
    first: GateFinding  # the example shown: the shortest replayable scenario of the group
    keys: dict[str, int] = field(default_factory=dict)  # key -> scenarios, first seen first
    replays: list[str] = field(default_factory=list)  # every replay file written for the group

    @property
    def count(self) -> int:
        """Failing scenarios with this signature."""
        return sum(self.keys.values())


def _shorter(finding: GateFinding, shown: GateFinding) -> bool:
    """Whether ``finding`` is a better example than ``shown``: replayable first, then fewer
    steps (the first one found among equals)."""
    if (finding.replay is None) != (shown.replay is None):
        return shown.replay is None
    return finding.steps < shown.steps


def group_findings(run: Mapping[str, Metrics]) -> list[FailureGroup]:
    """The findings of ``run`` grouped by signature: the largest group first, then in key order
    (a finding's own order within a key); each group's example is its shortest replayable
    scenario."""
    groups: dict[str, FailureGroup] = {}
    for key in sorted(run):
        metrics = run[key]
        unexplained = max(0, metrics.failing - len(metrics.findings))
        for finding in [*metrics.findings, *[UNREPRODUCED] * unexplained]:
            group = groups.get(finding.signature)
            if group is None:
                group = groups[finding.signature] = FailureGroup(
                    signature=finding.signature, first_key=key, first=finding
                )
            group.keys[key] = group.keys.get(key, 0) + 1
            if finding.replay is not None:
                group.replays.append(finding.replay)
            if _shorter(finding, group.first):  # the group shows its shortest replayable one
                group.first_key, group.first = key, finding
    return sorted(groups.values(), key=lambda group: -group.count)
