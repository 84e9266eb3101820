"""Building one proxied request from the ASGI scope: auth, body under its limit, the model it names.

The request path a newcomer follows, one file each::

    router/path/request.py   scope -> (Model, ProxyRequest): key check, body read under the limit,
                        the model by the body's `model` (or /upstream/{model}), headers to forward
    router/path/proxy.py     forward(): limiter slot, backend lease, the upstream exchange,
                        retry on a fatal error or a dead process
    router/path/relay.py     the answer to the client, chunk by chunk; the disconnect race; error events
    router/edge/errors.py    every error a client sees, and the one procman -> HTTP mapping
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from starlette.types import Receive, Scope

from procman import State
from router.edge.body import model_of, read_body, too_large
from router.edge.errors import BadRequest, ModelNotFound
from router.state.registry import Model, Registry

__all__ = ["HOP_BY_HOP", "MODEL_OPTIONAL", "ProxyRequest", "body_charge", "client_of", "content_length", "header",
           "implied_model", "proxied", "raw", "unknown_model", "upstream_headers"]

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
#: The tasks whose model server answers each OpenAI route (modelserver/tasks.py's TASK_ROUTES, inverted).
ENDPOINT_TASKS: dict[str, tuple[str, ...]] = {
    "/v1/chat/completions": ("llm", "vlm"),
    "/v1/completions": ("llm", "vlm"),
    "/v1/embeddings": ("embeddings",),
    "/v1/rerank": ("rerank",),
    "/v2/rerank": ("rerank",),
    "/v1/audio/speech": ("speech",),
    "/v1/audio/transcriptions": ("transcription",),
    "/v1/audio/translations": ("transcription",),
    "/tokenize": ("llm", "vlm"),
    "/detokenize": ("llm", "vlm"),
    "/v1/responses": ("llm", "vlm"),
    "/v1/responses/input_tokens": ("llm", "vlm"),
    "/v1/messages": ("llm", "vlm"),
    "/v1/messages/count_tokens": ("llm", "vlm"),
}
#: Routes whose JSON body may leave out ``model``: llama.cpp's server serves one model, so its clients
#: (SillyTavern's token counter, for one) send none. See :func:`implied_model`.
MODEL_OPTIONAL = frozenset({"/tokenize", "/detokenize"})
#: Request headers the router owns: the client's key is for the router, not the backend.
REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "authorization", "x-api-key", "expect"}


@dataclass(frozen=True, slots=True)
class ProxyRequest:
    method: str
    path: str  # path and query string as sent to the backend
    headers: list[tuple[str, str]]
    body: bytes
    retryable: bool  # a non-streamed request: safe to send again when nothing reached the client
    #: a stream's first events, sent at once while its model starts (the Responses API's created/in_progress)
    opening: bytes = b""


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def client_of(scope: Scope) -> str | None:
    client = scope.get("client")
    return str(client[0]) if client else None


def upstream_headers(raw: list[tuple[bytes, bytes]], client: str | None) -> list[tuple[str, str]]:
    named = ((k.decode("latin-1"), v) for k, v in raw)
    headers = [(key, v.decode("latin-1")) for key, v in named if key not in REQUEST_DROP]
    if client:
        headers.append(("x-forwarded-for", client))
    return headers


def unknown_model(name: str, known: Iterable[str]) -> ModelNotFound:
    return ModelNotFound(
        f"model {_shown(name)} is not configured; known models: {', '.join(sorted(known)) or 'none'}", param="model"
    )


def _shown(name: str, limit: int = 100) -> str:
    """``name`` quoted for a message, cut to ``limit`` characters (a client may send megabytes)."""
    return repr(name) if len(name) <= limit else f"{name[:limit]!r}... ({len(name)} characters)"


def content_length(scope: Scope) -> int | None:
    value = header(scope, b"content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        raise BadRequest(f"Content-Length is not a number: {value!r}") from None


def body_charge(scope: Scope, limit_bytes: int) -> int:
    """What a request's body may take in memory, known before it is read: its ``Content-Length``
    (413 beyond ``limit_bytes``), ``limit_bytes`` for a chunked one, else 0."""
    declared = content_length(scope)
    if declared is not None:
        if declared > limit_bytes:
            raise too_large(limit_bytes)
        return declared
    return limit_bytes if "chunked" in (header(scope, b"transfer-encoding") or "").lower() else 0


def _query(scope: Scope) -> str:
    return ("?" + scope["query_string"].decode("latin-1")) if scope["query_string"] else ""


def implied_model(registry: Registry, tasks: tuple[str, ...]) -> str | None:
    """The model a body without ``model`` goes to: the only one configured for ``tasks``, else the only one
    of them loaded; None (the body must name one) when that is not one model — token ids differ between
    models, so a guess would give wrong counts without a word."""
    candidates = [m for m in registry.models.values() if m.spec.task in tasks]
    if len(candidates) > 1:
        candidates = [m for m in candidates if m.backend.state is State.READY]
    return candidates[0].spec.name if len(candidates) == 1 else None


async def proxied(scope: Scope, receive: Receive, registry: Registry) -> tuple[Model, ProxyRequest]:
    """An OpenAI route: the body names the model; a stream is never retried."""
    body = await read_body(receive, content_length(scope), registry.max_body_bytes)
    implied = implied_model(registry, ENDPOINT_TASKS[scope["path"]]) if scope["path"] in MODEL_OPTIONAL else None
    routed = model_of(body, header(scope, b"content-type") or "application/json", registry.models, implied)
    model = registry.resolve(routed.model)
    if model is None:
        raise unknown_model(routed.model, registry.models)
    if len(body) > model.spec.max_request_bytes:
        raise too_large(model.spec.max_request_bytes, f"request body for model {model.spec.name!r}")
    tasks = ENDPOINT_TASKS.get(scope["path"])
    if tasks and model.spec.launches_modelserver and model.spec.task not in tasks:  # no cold start for a 404
        serving = sorted(name for name, m in registry.models.items() if m.spec.task in tasks)
        raise BadRequest(f"model {model.spec.name!r} has task {model.spec.task}; {scope['path']} needs task "
                         f"{' or '.join(tasks)} (models: {', '.join(serving) or 'none configured'})", param="model")
    headers = upstream_headers(scope["headers"], client_of(scope))
    path = scope["path"] + _query(scope)
    return model, ProxyRequest(scope["method"], path, headers, body, retryable=not routed.stream)


async def raw(scope: Scope, receive: Receive, registry: Registry) -> tuple[Model, ProxyRequest]:
    """``/upstream/{model}/{path}``: any method and path, as sent (%-escapes kept), never retried."""
    params = scope.get("path_params", {})
    model = registry.resolve(params.get("model", ""))
    if model is None:
        raise unknown_model(params.get("model", ""), registry.models)
    body = await read_body(receive, content_length(scope), model.spec.max_request_bytes)
    path_bytes = scope.get("raw_path") or scope["path"].encode("latin-1")
    parts = path_bytes.split(b"/", 3)  # b"", b"upstream", model, rest
    path = "/" + (parts[3].decode("latin-1") if len(parts) > 3 else "") + _query(scope)
    headers = upstream_headers(scope["headers"], client_of(scope))
    return model, ProxyRequest(scope["method"], path, headers, body, retryable=False)
