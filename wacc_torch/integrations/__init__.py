"""Token-weighted, resumable gradient accumulation inside training frameworks, on ``wacc_torch``.

One module per framework (``wacc_torch.integrations.transformers``, ``...accelerate``, ...). This
package imports nothing: each module imports its framework lazily and raises one ``ImportError``
naming the extra to install when the framework is missing, so ``import wacc_torch`` still needs
torch only.
"""
