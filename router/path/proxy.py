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

from router.path.recovery import forward

__all__ = ["forward"]
