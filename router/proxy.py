"""Forwarding one request to a model's backend: admission, lease, exchange, retry.

The flow of a proxied request (see router/request.py for how it is built and
router/relay.py for how the answer reaches the client)::

    limiter slot (429 when the queue is full)
      -> backend.request()  (procman: cold start / wait for ready, in-flight guard)
        -> upstream request, first byte within request_timeout_s
          -> X-Backend-Fatal: 1 or a dead process: restart the backend; a non-streamed
             request with nothing sent yet is retried once on the fresh process
          -> relay: headers, then each chunk as it arrives (router.relay)
"""

from __future__ import annotations

import asyncio
import json
import logging

from starlette.types import Send

from procman import BackendUnavailable, Lease
from router.errors import BadGateway, GatewayTimeout, ServiceUnavailable, unavailable
from router.httpclient import UpstreamError, UpstreamTimeout
from router.registry import Model
from router.relay import relay, run_until_disconnect, send_error
from router.request import ProxyRequest, upstream_headers
from router.upstream import Upstream, UpstreamReply

# ProxyRequest, upstream_headers, run_until_disconnect and send_error are re-exported for older imports
__all__ = ["ProxyRequest", "forward", "run_until_disconnect", "send_error", "upstream_headers"]

log = logging.getLogger(__name__)

DEATH_GRACE_S = 2.0


async def forward(model: Model, req: ProxyRequest, pool: Upstream, send: Send) -> int:
    """Proxy ``req`` to ``model`` and relay the answer; returns the HTTP status the client got."""
    async with model.limiter:
        for attempt in (1, 2):
            try:
                async with model.backend.request() as lease:
                    result = await _exchange(model, req, pool, lease, send, may_retry=attempt == 1)
            except BackendUnavailable as exc:
                raise unavailable(model.spec.name, exc) from None
            if result is not None:
                return result
        raise AssertionError("unreachable: the second attempt never asks for a retry")


def _can_retry(model: Model, req: ProxyRequest, may_retry: bool) -> bool:
    return may_retry and req.retryable and model.spec.retry_on_fatal


async def _exchange(
    model: Model, req: ProxyRequest, pool: Upstream, lease: Lease, send: Send, may_retry: bool
) -> int | None:
    """One try. Returns the status relayed, or None to ask for one retry on a fresh backend."""
    spec = model.spec
    try:
        resp = await pool.request(lease.address, req.method, req.path, req.headers, req.body, spec.request_timeout_s)
    except UpstreamTimeout:
        raise GatewayTimeout(
            f"model {spec.name!r} sent no response within request_timeout_s={spec.request_timeout_s:g}s"
        ) from None
    except UpstreamError as exc:
        return await _backend_failed(model, req, lease, exc, may_retry)
    try:
        if resp.header(b"x-backend-fatal") == b"1":
            return await _fatal(model, req, lease, resp, may_retry)
        return await relay(model, resp, send)
    finally:
        resp.close()


async def _backend_failed(
    model: Model, req: ProxyRequest, lease: Lease, exc: Exception, may_retry: bool
) -> int | None:
    """The connection failed before any answer: the process most likely died mid-request."""
    died = await _wait_replaced(model, lease)
    if died and _can_retry(model, req, may_retry):
        log.warning("%s died mid-request (%s); retrying once on a fresh process", model.spec.name, exc)
        return None
    what = "died while handling the request" if died else f"could not be reached ({exc})"
    raise BadGateway(f"model {model.spec.name!r} {what}; it is being restarted, retry the request")


async def _wait_replaced(model: Model, lease: Lease) -> bool:
    """Whether the process behind ``lease`` is gone: its exit future completes within ``DEATH_GRACE_S``."""
    await asyncio.wait({lease.exited}, timeout=DEATH_GRACE_S)
    return lease.exited.done()


async def _fatal(
    model: Model, req: ProxyRequest, lease: Lease, resp: UpstreamReply, may_retry: bool
) -> int | None:
    try:
        detail = _error_message(await resp.read(idle_timeout_s=5.0))
    except UpstreamError:
        detail = "no detail"
    log.warning("%s reported a fatal engine error (%s); restarting it", model.spec.name, detail)
    restart = model.backend.restart("fatal", generation=lease.generation)  # queued now, before any later request
    if _can_retry(model, req, may_retry):
        await restart  # the retry must land on the fresh process
        return None
    raise ServiceUnavailable(
        f"model {model.spec.name!r} hit an unrecoverable engine error and is being restarted: {detail}",
        retry_after_s=2.0,
    )


def _error_message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:300].decode("utf-8", "replace") or "no detail"


