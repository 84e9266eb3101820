"""CORS for browser clients that talk to the router directly, from ``router.cors_origins``.

Unset (the default), pages served from this machine may call the router: the loopback
origins ``http://localhost:*``, ``http://127.0.0.1:*`` and ``http://[::1]:*`` (and their
``https`` forms), as Ollama allows by default — a browser UI on ``http://localhost:3000``
works with no setting. A list replaces that default: ``["*"]`` allows every origin, ``[]``
none (no header, and a preflight is an ordinary request).

Requests under ``/v1`` (and ``/v2/rerank``), ``/models``, ``/tokenize``, ``/detokenize``, ``/ollama`` and
``/upstream`` get Starlette's CORS handling: preflights (``OPTIONS`` with ``Access-Control-Request-Method``)
are answered without an API key, and responses carry ``Access-Control-Allow-Origin`` for
allowed origins. The setting is read on every request, so a reload changes it without a restart.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from router.edge.errors import error_body
from router.service import RouterService

__all__ = ["CORS_PREFIXES", "LOOPBACK_ORIGINS", "Cors"]

CORS_PREFIXES = ("/v1/", "/v2/rerank", "/models", "/upstream/", "/tokenize", "/detokenize", "/ollama")
#: The origins allowed when ``router.cors_origins`` is unset: pages on this machine, any port.
LOOPBACK_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:[0-9]{1,5})?"
#: Response headers a browser script may read.
EXPOSED = ["Retry-After", "X-Request-Id"]
PREFLIGHT_MAX_AGE_S = 600


class _JsonCors(CORSMiddleware):
    """Starlette's CORS, with a refused preflight answered by an OpenAI-style error body."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        reason = bytes(response.body).decode()
        message = f"{reason} (origin {request_headers['origin']!r}); allow it in router.cors_origins"
        headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
        return Response(error_body(message, "invalid_request_error", "cors_rejected"), status_code=400,
                        media_type="application/json", headers=headers)


class Cors:
    """ASGI wrapper: CORS on the client-facing prefixes when origins are configured, nothing otherwise."""

    def __init__(self, app: ASGIApp, service: RouterService) -> None:
        self.app = app
        self.service = service
        self._origins: tuple[str, ...] | None = ()
        self._cors: CORSMiddleware | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        origins = self.service.config.router.cors_origins
        if origins == () or scope["type"] != "http" or not _applies(scope["path"]):
            await self.app(scope, receive, send)
            return
        await self._middleware(origins)(scope, receive, send)

    def _middleware(self, origins: tuple[str, ...] | None) -> CORSMiddleware:
        """Built again only when the setting changed (``None``: the loopback default)."""
        if self._cors is None or origins != self._origins:
            self._origins = origins
            self._cors = _JsonCors(self.app, allow_origins=list(origins or ()),
                                   allow_origin_regex=LOOPBACK_ORIGINS if origins is None else None,
                                   allow_methods=["*"], allow_headers=["*"], expose_headers=EXPOSED,
                                   max_age=PREFLIGHT_MAX_AGE_S, allow_private_network=True)
        return self._cors


def _applies(path: str) -> bool:
    return path == "/v1" or path.startswith(CORS_PREFIXES)
