"""``python -m modelserver``: see :mod:`modelserver.cli`."""

from __future__ import annotations

from modelserver import startup

startup.mark("interpreter")  # before the server's own imports: the cold-start breakdown starts here
startup.fault_log()

from modelserver.cli import main  # noqa: E402

raise SystemExit(main())
