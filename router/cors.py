"""CORS for browser clients that talk to the router directly, from ``router.cors_origins``.

Empty (the default) adds nothing: no header, and a preflight is an ordinary request.
Otherwise requests under ``/v1``, ``/models`` and ``/upstream`` get Starlette's CORS
handling: preflights (``OPTIONS`` with ``Access-Control-Request-Method``) are answered
without an API key, and responses carry ``Access-Control-Allow-Origin`` for allowed
origins. ``"*"`` allows every origin. The setting is read on every request, so a reload
changes it without a restart.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from router.errors import error_body
from router.service import RouterService

__all__ = ["CORS_PREFIXES", "Cors"]

CORS_PREFIXES = ("/v1/", "/models", "/upstream/")
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
        self._origins: tuple[str, ...] = ()
        self._cors: CORSMiddleware | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        origins = self.service.config.router.cors_origins
        if not origins or scope["type"] != "http" or not _applies(scope["path"]):
            await self.app(scope, receive, send)
            return
        await self._middleware(origins)(scope, receive, send)

    def _middleware(self, origins: tuple[str, ...]) -> CORSMiddleware:
        if self._cors is None or origins != self._origins:
            self._origins = origins
            self._cors = _JsonCors(self.app, allow_origins=list(origins), allow_methods=["*"], allow_headers=["*"],
                                   expose_headers=EXPOSED, max_age=PREFLIGHT_MAX_AGE_S, allow_private_network=True)
        return self._cors


def _applies(path: str) -> bool:
    return path == "/v1" or path.startswith(CORS_PREFIXES)
