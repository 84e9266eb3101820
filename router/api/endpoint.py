"""The raw ASGI endpoint of every proxied route: key, body under the budget, the model, the exchange, errors.

:class:`ProxyEndpoint` serves the OpenAI routes (``router.app``); a protocol with its own request
reading or exchange (``/upstream``, ``/v1/responses``, Ollama's ``/ollama/api/chat``) subclasses it
and overrides :meth:`~ProxyEndpoint.prepare` or :meth:`~ProxyEndpoint.exchange`; the accounting (body
budget, request metrics) stays here, once, and errors take the path's shape (:func:`router.edge.errors.body_for`).
"""

from __future__ import annotations

import logging
import time

from starlette.types import Receive, Scope, Send

from router.edge.errors import RouterError
from router.path import request
from router.path.proxy import forward
from router.path.relay import run_until_disconnect, send_error
from router.path.request import ProxyRequest
from router.service import RouterService, check_key, credential
from router.state.registry import Model

__all__ = ["ProxyEndpoint"]

log = logging.getLogger("router.app")


class ProxyEndpoint:
    """Raw ASGI endpoint: the hot path avoids building Request/Response objects."""

    def __init__(self, service: RouterService) -> None:
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        name, status, held = "-", 500, 0
        bodies = self.service.registry.bodies
        try:
            keys = self.service.config.router.api_keys
            if keys:  # open: not even the header to look for
                presented = credential(request.header(scope, b"authorization"), request.header(scope, b"x-api-key"))
                check_key(presented, keys, "api_keys")
            charge = request.body_charge(scope, self.service.registry.max_body_bytes)
            await bodies.take(charge)  # before the body is read: memory stays bounded (503 when full)
            held = charge
            model, req = await self.prepare(scope, receive)
            bodies.give(held - len(req.body))  # a chunked body took the most it could be
            held = len(req.body)
            name = model.spec.name
            status = await self.exchange(model, req, scope, receive, send)
        except RouterError as exc:
            status = exc.status
            await send_error(send, exc, scope["path"])
        except Exception:  # never a traceback or an HTML page to the client
            log.exception("unhandled error proxying %s", scope["path"])
            await send_error(send, RouterError("internal router error; see the router log"), scope["path"])
        finally:
            bodies.give(held)
            self._count(name, status, time.perf_counter() - started)

    def _count(self, name: str, status: int, elapsed_s: float) -> None:
        if name in self.service.registry.models:
            self.service.metrics.observe_request(name, status, elapsed_s)

    async def prepare(self, scope: Scope, receive: Receive) -> tuple[Model, ProxyRequest]:
        return await request.proxied(scope, receive, self.service.registry)

    async def exchange(self, model: Model, req: ProxyRequest, scope: Scope, receive: Receive, send: Send) -> int:
        """Forward ``req`` and relay the answer, racing the client's leaving; the status the client got."""
        activity, pool, client = self.service.console.activity, self.service.pool, request.client_of(scope)
        status, gone = await run_until_disconnect(
            lambda s: activity.run(model, req, client, s, lambda s2: forward(model, req, pool, s2)),
            receive, send, scope["path"],
        )
        if gone:
            log.info("%s %s: client disconnected, upstream closed", model.spec.name, req.path)
        return status
