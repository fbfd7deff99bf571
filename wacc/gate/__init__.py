"""``wacc gate``: the CI numerical regression gate.

* :mod:`wacc.gate.measure` — the gate's work units (the seeded corpus and the ci-profile check,
  per work dtype x family), deterministic shards, and the measured metrics per unit key;
* :mod:`wacc.gate.baseline` — the committed baseline file (``reports/baseline.json``) and the
  shard result files: format, validation, reading and writing;
* :mod:`wacc.gate.compare` — hard failures, regressions beyond the headroom (derived there, in
  one place), improvements;
* :mod:`wacc.gate.outputs` — the stdout table, JUnit XML and the pull-request summary.
"""
