"""A lone UTF-16 surrogate in a request body: the one check the model server and the router share.

``"\\ud800"`` is valid JSON but not a character: no text can be encoded with it, so an answer that echoes or
tokenizes it (or a router that re-encodes the body) would fail half-way with a 500. Pure (``re``, ``json``):
the router may import it (``tests/test_import_graph.py``).
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["lone_surrogate"]

#: Where a lone UTF-16 surrogate can come from: a ``\\udXXX`` escape, or its bytes (``json.loads`` decodes bytes
#: with surrogatepass).
_SURROGATE_HINT = re.compile(rb"\\u[dD][89abcdefABCDEF]|\xed[\xa0-\xbf]")


def lone_surrogate(body: bytes, data: Any) -> str | None:
    """The 400's message when a string of ``data`` (parsed from ``body``) holds a lone surrogate, else None.

    A byte scan first; the strings are only looked at for a body in UTF-16/32 or with a surrogate escape (a valid
    pair is fine)."""
    utf8 = b"\x00" not in body[:4] and not body.startswith((b"\xfe\xff", b"\xff\xfe"))  # JSON opens with ASCII
    if utf8 and not _SURROGATE_HINT.search(body):
        return None
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"the request body holds a lone UTF-16 surrogate ({exc.object[exc.start:exc.end]!r}), which is not "
                "a character; send valid Unicode text")
    return None
