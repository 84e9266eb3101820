"""The HTTP edge: what touches a socket, and the JSON of every refusal.

Owns the bounds on a client connection (``coalesce``: one write per loop turn; ``connlimits``:
per-connection limits and the open-file limit), reading a request body under its limits
(``body``), every error a client sees and the one procman -> HTTP mapping (``errors``), and
the hop to a model server: the ``Upstream`` protocol and its keep-alive pool (``upstream``)
over the small HTTP/1.1 client (``httpclient``), which judges a waiting request by its
heartbeats (``heartbeat``); tests inject a fake ``Upstream``.

Imports: the standard library, starlette, procman's errors. Never another ``router``
package and never the router's root modules: everything else builds on this one.
"""
