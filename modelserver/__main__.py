"""``python -m modelserver``: see :mod:`modelserver.cli`; ``... --spare``: see :mod:`modelserver.spare`."""

from __future__ import annotations

import sys

from modelserver import startup

startup.mark("interpreter")  # before the server's own imports: the cold-start breakdown starts here
startup.fault_log()

if sys.argv[1:2] == ["--spare"]:
    from modelserver.spare import main as spare

    raise SystemExit(spare(sys.argv[2:]))

from modelserver.cli import main  # noqa: E402

raise SystemExit(main())
