"""Forwarding one request to a model's backend: admission, lease, exchange, recovery.

The flow of a proxied request (see router/path/request.py for how it is built, router/path/relay.py
for how the answer reaches the client and router/path/recovery.py for what happens when the
process dies under it)::

    limiter slot (429 when the queue is full)
      -> backend.request()  (procman: cold start / wait for ready, in-flight guard)
        -> upstream request, first byte within request_timeout_s
          -> X-Backend-Fatal: 1, a dead, hung or stalled process: router.path.blame decides —
             retry once on the fresh process (nothing sent yet), resume the stream there
             (max_resumes), or answer naming the request as the cause (request_crashed_model)
          -> relay: headers, then each chunk as it arrives (router.path.relay; a resumable
             stream whole event by whole event, router.path.resume)
"""

from __future__ import annotations

from router.path.recovery import DEATH_GRACE_S, forward
from router.path.relay import run_until_disconnect, send_error
from router.path.request import ProxyRequest, upstream_headers

# ProxyRequest, upstream_headers, run_until_disconnect and send_error are re-exported for older imports
__all__ = ["DEATH_GRACE_S", "ProxyRequest", "forward", "run_until_disconnect", "send_error", "upstream_headers"]
