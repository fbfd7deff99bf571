"""wacc: the judge. Runs any gradient accumulator against the exact reference (``wacc_ref``).

The only package that imports both ``wacc_torch`` (the default implementation under test) and
``wacc_ref`` (the truth); neither of them imports it. The command line is :mod:`wacc.cli`
(``wacc`` or ``python -m wacc``), one module per subcommand under :mod:`wacc.commands`.
"""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("wacc")
except metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
