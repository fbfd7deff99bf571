"""``wacc gate``: the CI numerical regression gate.

* :mod:`wacc.gate.shards` — ``K/N``, parsed without importing the judge;
* :mod:`wacc.gate.measure` — the gate's work units (the seeded corpus and the ci-profile check,
  per work dtype x family), and the measured metrics and failing scenarios per unit key;
* :mod:`wacc.gate.baseline` — the committed baseline file (``reports/baseline.json``) and the
  shard result files: format, validation, reading and writing;
* :mod:`wacc.gate.compare` — hard failures, regressions beyond the headroom (derived there, in
  one place), improvements;
* :mod:`wacc.gate.groups` — failures grouped by signature, with counts;
* :mod:`wacc.gate.outputs` — the stdout table and failure groups, JUnit XML and the
  pull-request summary.
"""
