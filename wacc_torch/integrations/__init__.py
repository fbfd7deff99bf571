"""Token-weighted, resumable accumulation inside the training frameworks people use, built on
:class:`wacc_torch.WeightedGradientsAccumulator`: one module per framework
(``wacc_torch.integrations.<framework>``), each importing its framework only when used and
raising :class:`ImportError` naming the extra to install when it is missing.  Importing
``wacc_torch`` imports none of them."""
