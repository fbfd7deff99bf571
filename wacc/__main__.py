"""``python -m wacc`` is the ``wacc`` command."""

from wacc.cli import main

raise SystemExit(main())
