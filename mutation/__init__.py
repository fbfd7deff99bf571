"""The suite's power over its own code, measured: mutation testing with mutmut.

``mutmut run`` (configured in ``pyproject.toml``'s ``[tool.mutmut]``) writes every mutant's fate
under ``mutants/``; this package turns that into the committed report (``python -m mutation
report``) and keeps the harness alive in CI (``python -m mutation smoke``).  The hand-written part
is ``reports/mutation/triage.csv``: one line per surviving mutant, *equivalent* (with the reason)
or *accepted* (with the reason); a survivor that is neither is a gap, and a gap is closed by a test.
"""
