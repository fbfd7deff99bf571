"""``wacc report``: a fixed, seeded corpus run on every implementation, with tables and plots.

* :mod:`wacc.report.corpus` — the deterministic corpus (strategy families x work dtypes x
  gradient dtypes);
* :mod:`wacc.report.rows` — one judged row per scenario x implementation x device;
* :mod:`wacc.report.sweeps` — the dedicated sweeps behind the figures (weight skew, the
  overflow map, conv_D's double rounding);
* :mod:`wacc.report.figures` — the matplotlib figures;
* :mod:`wacc.report.writer` — ``index.md``, ``divergence.csv`` and ``scenarios/``;
* :mod:`wacc.report.provenance` — versions, device, corpus, date and wall time.
"""
