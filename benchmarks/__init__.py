"""The performance benchmarks of wacc: ``python -m benchmarks`` (run from the repository root).

Suites (one module each): ``step`` (a whole training step, plain loop vs the accumulator),
``overhead`` (Python overhead on many tiny tensors), ``large`` (memory-bound passes on ~40 M
parameters), ``memory`` (peak gradient memory per mode), ``reference`` (``wacc gate`` wall time and
the reference model's emulation rates). Every ratio is measured side by side in one run against a
floor measured in the same run; nothing here is a timed test. Results go to ``reports/perf/``
(``results.csv`` and ``README.md``; see :mod:`benchmarks.results`).

The older scripts ``bench_accumulate.py``, ``bench_reference.py`` and ``bench_ddp_overlap.py`` still
run on their own (``python benchmarks/bench_accumulate.py``).
"""
