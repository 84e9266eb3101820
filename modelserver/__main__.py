"""``python -m modelserver``: see :mod:`modelserver.cli`."""

from __future__ import annotations

from modelserver.cli import main

raise SystemExit(main())
