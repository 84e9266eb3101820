"""A spare interpreter without the warm imports (``python -m modelserver --spare`` minus OpenVINO): the
hand-over protocol of :mod:`modelserver.spare`, cheap enough for tests of the pool around it."""

from __future__ import annotations

import sys

import modelserver.spare as spare

spare.warm_imports = lambda pairs=(): None
raise SystemExit(spare.main(sys.argv[1:]))
