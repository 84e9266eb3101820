"""The router's exceptions and their one translation to HTTP.

    RouterError                 every error a client can see; carries status, type, code
     ├ BadRequest               400  invalid_request_error
     ├ Unauthorized             401  authentication_error
     ├ ModelNotFound            404  model_not_found
     ├ NotFound                 404  not_found
     ├ MethodNotAllowed         405  method_not_allowed   (Allow)
     ├ PayloadTooLarge          413  request_too_large
     ├ TooManyRequests          429  rate_limit_exceeded   (Retry-After)
     ├ BadGateway               502  backend_error
     ├ ServiceUnavailable       503  model_unavailable     (Retry-After when known)
     │  └ RouterBusy            503  router_busy           (Retry-After: the router-wide body budget is full)
     └ GatewayTimeout           504  backend_timeout

Every body is ``{"error": {"message", "type", "param", "code"}}`` (``param`` null when no single
parameter is at fault), the OpenAI spec's ``ErrorResponse``; nothing else ever reaches a client,
except on the Anthropic Messages API's routes (:data:`ANTHROPIC_PATHS`), whose clients get
Anthropic's ``{"type": "error", "error": {"type", "message"}}`` (:func:`body_for`):
``not_found_error`` for an unknown model, ``authentication_error``, ``overloaded_error`` for a 503.
"""

from __future__ import annotations

import json
import math
import re

from starlette.responses import Response

from procman import BackendUnavailable, InBackoff

__all__ = [
    "BadGateway",
    "BadRequest",
    "GatewayTimeout",
    "MethodNotAllowed",
    "ModelNotFound",
    "NotFound",
    "PayloadTooLarge",
    "RouterBusy",
    "RouterError",
    "ServiceUnavailable",
    "TooManyRequests",
    "Unauthorized",
    "anthropic_error",
    "body_for",
    "client_line",
    "error_body",
    "error_object",
    "error_response",
    "unavailable",
]


class RouterError(Exception):
    status = 500
    type = "server_error"
    code = "internal_error"
    #: Sent before the request's body was read: the connection is closed after it, not kept reading the rest.
    closes = False

    def __init__(self, message: str, *, retry_after_s: float | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        self.param = param

    def headers(self) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        if self.retry_after_s is not None:
            headers["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
        if self.status == 401:
            headers["www-authenticate"] = "Bearer"
        if self.closes:
            headers["connection"] = "close"
        return headers


class BadRequest(RouterError):
    status, type, code = 400, "invalid_request_error", "invalid_request"


class Unauthorized(RouterError):
    status, type, code = 401, "authentication_error", "invalid_api_key"


class ModelNotFound(RouterError):
    status, type, code = 404, "invalid_request_error", "model_not_found"


class NotFound(RouterError):
    status, type, code = 404, "invalid_request_error", "not_found"


class MethodNotAllowed(RouterError):
    status, type, code = 405, "invalid_request_error", "method_not_allowed"

    def __init__(self, message: str, allow: str | None = None) -> None:
        super().__init__(message)
        self.allow = allow

    def headers(self) -> dict[str, str]:
        return {**super().headers(), **({"allow": self.allow} if self.allow else {})}


class PayloadTooLarge(RouterError):
    status, type, code = 413, "invalid_request_error", "request_too_large"
    closes = True


class TooManyRequests(RouterError):
    status, type, code = 429, "rate_limit_error", "rate_limit_exceeded"


class BadGateway(RouterError):
    status, type, code = 502, "server_error", "backend_error"


class ServiceUnavailable(RouterError):
    status, type, code = 503, "server_error", "model_unavailable"


class RouterBusy(ServiceUnavailable):
    code = "router_busy"
    closes = True


class GatewayTimeout(RouterError):
    status, type, code = 504, "server_error", "backend_timeout"


def error_object(message: str, type_: str, code: str, param: str | None = None) -> dict[str, dict[str, str | None]]:
    """The one OpenAI error body, as data (``param`` null when none: OpenAI's shape); :func:`error_body` as bytes."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_body(message: str, type_: str, code: str, param: str | None = None) -> bytes:
    return json.dumps(error_object(message, type_, code, param)).encode()


def error_response(exc: RouterError, path: str = "") -> Response:
    return Response(body_for(exc, path), status_code=exc.status, headers=exc.headers())


#: Routes whose clients speak Anthropic's Messages API: their errors take its shape.
ANTHROPIC_PATHS = ("/v1/messages",)
#: Ollama's API (router/api/ollama.py), whose errors are ``{"error": "..."}``.
OLLAMA_PATHS = ("/ollama/",)
#: Anthropic's error ``type`` by HTTP status (the model server's Messages routes use the same table).
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                   429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict[str, object]:
    """Anthropic's error object: ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


def body_for(exc: RouterError, path: str) -> bytes:
    """The body of ``exc`` on ``path``: Anthropic's shape on its routes, Ollama's ``{"error": "..."}`` under
    ``/ollama/``, else OpenAI's."""
    if path.startswith(OLLAMA_PATHS):
        return json.dumps({"error": exc.message}).encode()
    if path.startswith(ANTHROPIC_PATHS):
        return json.dumps(anthropic_error(exc.status, exc.message)).encode()
    return error_body(exc.message, exc.type, exc.code, exc.param)


#: Retry-After of a model in backoff whose error did not say how long (it always should).
BACKOFF_RETRY_AFTER_S = 5.0


def unavailable(model: str, exc: BackendUnavailable, what: str = "is unavailable") -> ServiceUnavailable:
    """The one mapping of procman's "no process to talk to" to HTTP: 503, with Retry-After when known.

    The message is one line (:func:`client_line`): log tails, pids and socket paths stay in
    ``/api/models`` and the model's log, which the message names.
    """
    retry = exc.retry_after_s
    if retry is None and isinstance(exc, InBackoff):
        retry = BACKOFF_RETRY_AFTER_S
    reason = client_line(exc.reason, getattr(exc, "log_tail", None))
    return ServiceUnavailable(f"model {model!r} {what}: {reason} (log: GET /api/models/{model}/logs)",
                              retry_after_s=retry)


_PID = re.compile(r"\s*\bpid=\d+")
_SOCKET = re.compile(r"(?:unix:)?/\S*\.sock\b")
_LOG_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d[ T][\d:,.]+\s+(?:[A-Z]+\s+)?[\w.]+:\s*")


def client_line(reason: str, log_tail: list[str] | None = None) -> str:
    """``reason`` as one line a client may see: no log tail, pid or socket path; a start failure gains the
    line of its log that says why (``failed to load …``, else the last one)."""
    line = (reason or "unknown reason").split("; last log lines", 1)[0].splitlines()[0]
    if log_tail:
        why = next((entry for entry in reversed(log_tail) if "failed to load" in entry), log_tail[-1])
        line += ": " + _LOG_PREFIX.sub("", why.strip())[:300]
    line = _SOCKET.sub("<socket>", _PID.sub("", line))
    return line + ")" * max(0, line.count("(") - line.count(")"))
