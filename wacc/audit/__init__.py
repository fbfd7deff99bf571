"""``wacc audit``: does a real training loop hand the optimizer the full-batch gradient?

Each framework's public code path runs on the same windows of unequal microbatches; the gradient it
hands to the optimizer (captured right before the optimizer changes it) is compared with the truth,
the gradient of the mean token loss over the whole window computed in float64 on a float64 copy of
the same model.  One module per concept: :mod:`~wacc.audit.protocol` (what a loop adapter is),
:mod:`~wacc.audit.models` (the tiny models), :mod:`~wacc.audit.windows`, :mod:`~wacc.audit.truth`,
:mod:`~wacc.audit.metrics`, :mod:`~wacc.audit.runner`, :mod:`~wacc.audit.report` (table, md, csv),
:mod:`~wacc.audit.plot`, and one adapter module per framework under :mod:`wacc.audit.adapters`.
"""
