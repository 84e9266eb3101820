"""The model server's exceptions, and the one place that turns them into HTTP responses.

::

    ModelServerError                 every error a client may see (status, type, code)
    ├── RequestError                 400  the request is wrong; the message says what to fix
    │   ├── UnsupportedParameter     400  a known parameter with a value this server cannot honour
    │   ├── ContextLengthExceeded    400  prompt + completion longer than the model's context
    │   └── BodyTooLarge             413  the body is above ``max_request_mb``
    ├── Unauthorized                 401  no or a wrong bearer token (a server given one requires it)
    ├── NoRoute                      404  no such path (``status`` 405: a path without that method)
    ├── NotReady                     503  the engine is still loading, or failed to load
    └── EngineError                  500  the engine failed this request; the server keeps serving
        ├── SuspectEngineError       500  a suspect device error (``suspect_patterns``): ordinary, but
        │                                 the second within ``SUSPECT_WINDOW_S`` fails the process
        └── FatalEngineError         500  + ``X-Backend-Fatal: 1``: the process is beyond repair; it
                                          answers and exits without touching the pipeline again

    LoadError                        (not an HTTP error) the model cannot be loaded; the process exits

Engines raise plain exceptions (``RuntimeError`` from OpenVINO, or the fake engine's
injected faults); :func:`classify` maps them onto :class:`EngineError`,
:class:`SuspectEngineError` or :class:`FatalEngineError` by the model's ``fatal_patterns``
and ``suspect_patterns`` (case-insensitive substrings), and :func:`error_response`
renders any :class:`ModelServerError` as ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.responses import JSONResponse

__all__ = [
    "FATAL_HEADER",
    "BodyTooLarge",
    "ContextLengthExceeded",
    "EngineError",
    "FatalEngineError",
    "LoadError",
    "ModelServerError",
    "NoRoute",
    "NotReady",
    "RequestError",
    "SuspectEngineError",
    "Unauthorized",
    "UnsupportedParameter",
    "anthropic_error_body",
    "anthropic_error_response",
    "classify",
    "matches",
    "error_body",
    "error_response",
]

#: Response header that tells the router this process must be replaced.
FATAL_HEADER = "X-Backend-Fatal"


class ModelServerError(Exception):
    """An error with an HTTP status and an OpenAI-style ``type`` and ``code``."""

    status = 500
    type = "server_error"
    code = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def headers(self) -> dict[str, str]:
        return {}


class RequestError(ModelServerError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class Unauthorized(ModelServerError):
    status = 401
    type = "authentication_error"
    code = "invalid_token"

    def headers(self) -> dict[str, str]:
        return {"www-authenticate": "Bearer"}


class NoRoute(RequestError):
    """Starlette's 404 (no such path), or its 405 (the path without that method; ``allow``: the methods it takes)."""

    status = 404
    code = "not_found"

    def __init__(self, message: str, status: int = 404, allow: str | None = None) -> None:
        super().__init__(message)
        self.allow = allow
        if status == 405:
            self.status, self.code = 405, "method_not_allowed"

    def headers(self) -> dict[str, str]:
        return {"allow": self.allow} if self.allow else {}


class UnsupportedParameter(RequestError):
    code = "unsupported_parameter"


class ContextLengthExceeded(RequestError):
    """OpenAI's 400 for a prompt (and completion) longer than the model's context, naming both numbers."""

    code = "context_length_exceeded"

    def __init__(self, context: int, prompt_tokens: int, completion_tokens: int, param: str,
                 where: str = "messages", about: bool = False) -> None:
        approx = "about " if about else ""
        super().__init__(
            f"This model's maximum context length is {context} tokens. However, you requested {approx}"
            f"{prompt_tokens + completion_tokens} tokens ({approx}{prompt_tokens} in the {where}, {completion_tokens} "
            f"in the completion). Please reduce the length of the {where} or of the completion (max_tokens).",
            param=param,
        )


class BodyTooLarge(RequestError):
    status = 413
    code = "request_too_large"

    def __init__(self, limit_mb: float) -> None:
        super().__init__(
            f"request body is larger than the limit of {limit_mb:g} MiB (max_request_mb); "
            "send a smaller body or raise max_request_mb for this model"
        )


class NotReady(ModelServerError):
    status = 503
    type = "service_unavailable"
    code = "model_not_ready"

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"}


class EngineError(ModelServerError):
    status = 500
    type = "server_error"
    code = "engine_error"


class SuspectEngineError(EngineError):
    """An error that may mean a sick device (``suspect_patterns``); one alone is an ordinary 500."""

    code = "engine_suspect"


class FatalEngineError(EngineError):
    code = "engine_fatal"

    def headers(self) -> dict[str, str]:
        return {FATAL_HEADER: "1"}


class LoadError(Exception):
    """The model cannot be loaded (missing file, bad option, unsupported model); the process exits non-zero."""


def matches(text: str, patterns: Sequence[str]) -> str | None:
    """The first of ``patterns`` that ``text`` contains, ignoring case; None when none does."""
    lowered = text.lower()
    return next((pattern for pattern in patterns if pattern and pattern.lower() in lowered), None)


def classify(
    exc: BaseException, fatal_patterns: Sequence[str], suspect_patterns: Sequence[str] = ()
) -> ModelServerError:
    """``exc`` as a client-facing error: fatal when its text contains one of ``fatal_patterns``,
    suspect when it contains one of ``suspect_patterns``, else an ordinary engine error."""
    if isinstance(exc, ModelServerError):
        return exc
    text = " ".join(str(exc).split()) or type(exc).__name__  # one line: OpenVINO's come with C++ locations
    if matches(text, fatal_patterns):
        return FatalEngineError(f"engine failed beyond repair: {text}")
    if matches(text, suspect_patterns):
        return SuspectEngineError(f"engine error: {text}")
    return EngineError(f"engine error: {text}")


def error_body(exc: ModelServerError) -> dict[str, Any]:
    """OpenAI's error object: ``param`` is always there (null when no single parameter is at fault)."""
    return {"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}}


def error_response(exc: ModelServerError, path: str = "") -> JSONResponse:
    """The one translation of an error into HTTP: status, headers and the JSON body in the shape of
    ``path``'s protocol: Ollama's ``{"error": "..."}`` under ``/ollama/``, Anthropic's on the Messages
    API's routes (``/v1/messages...``), else OpenAI's."""
    if path.startswith("/ollama/"):
        return JSONResponse({"error": exc.message}, status_code=exc.status, headers=exc.headers())
    if path.startswith("/v1/messages"):
        return anthropic_error_response(exc)
    return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.headers())


#: Anthropic's error ``type`` by HTTP status (the Messages API's routes answer in its shape).
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                   429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_body(exc: ModelServerError) -> dict[str, Any]:
    """Anthropic's error object; ``code`` (ours) rides along, so the router still tells a fatal error."""
    kind = ANTHROPIC_TYPES.get(exc.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message, "code": exc.code}}


def anthropic_error_response(exc: ModelServerError) -> JSONResponse:
    """:func:`error_response` in Anthropic's shape, for the Messages API's routes."""
    return JSONResponse(anthropic_error_body(exc), status_code=exc.status, headers=exc.headers())
