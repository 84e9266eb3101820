"""``/v1/rerank`` (task rerank): the Jina / Cohere shape that llama.cpp, vLLM and OVMS serve.

Request: ``query``, ``documents`` (strings, or objects with a ``text``), ``top_n``,
``return_documents`` (default false, as Cohere). Response: ``results`` best first, each
``{"index", "relevance_score"}`` plus ``"document": {"text"}`` when asked, and ``usage``.
``/v2/rerank`` (Cohere v2's path) is the same handler. A query + document above the encoder's
maximum is a 400 ``context_length_exceeded`` unless the request sends ``truncate: true``.

At most :data:`MAX_DOCUMENTS` documents a request (Cohere's and Voyage's limit): each is a pass of the
cross-encoder, so 100,000 one-word documents kept the fake engine busy past the router's hang bound
(the model was killed as hung) and the real one for minutes. More is a 400 naming the limit.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from modelserver.api.common import (
    ClientGone,
    FastJSONResponse,
    engine_as,
    engine_errors,
    note,
    read_body,
    runtime,
    spec,
    until_disconnect,
)
from modelserver.engines.media_base import Reranker, RerankResult
from modelserver.errors import RequestError
from modelserver.ids import random_hex

__all__ = ["MAX_DOCUMENTS", "RerankRequest", "rerank_body", "routes"]

MAX_DOCUMENTS = 1000


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    model: str | None = None
    query: str = Field(..., min_length=1)
    documents: list[str] = Field(..., min_length=1)
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = False
    #: a query + document above the encoder's maximum is cut instead of a 400 (TEI's field)
    truncate: bool = False

    @field_validator("documents", mode="before")
    @classmethod
    def _texts(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [d["text"] if isinstance(d, dict) and isinstance(d.get("text"), str) else d for d in value]
        return value


def rerank_body(body: RerankRequest, result: RerankResult, model: str) -> dict[str, Any]:
    ranking = result.ranking[: body.top_n] if body.top_n is not None else result.ranking
    results = []
    for index, score in ranking:
        item: dict[str, Any] = {"index": index, "relevance_score": score}
        if body.return_documents:
            item["document"] = {"text": body.documents[index]}
        results.append(item)
    counts = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return {"id": f"rerank-{random_hex()}", "object": "list", "model": model, "results": results, "usage": counts}


async def rerank(request: Request) -> Response:
    body = await read_body(request, RerankRequest)
    if len(body.documents) > MAX_DOCUMENTS:
        raise RequestError(f"documents: at most {MAX_DOCUMENTS} documents a request, got {len(body.documents)}; "
                           "rerank them in several requests (or pre-filter them)", param="documents")
    reranker = engine_as(request, Reranker)
    try:
        with engine_errors(runtime(request)):
            result = await until_disconnect(request, reranker.rerank(body.query, body.documents, body.truncate))
    except ClientGone:
        note(request, finish="cancelled")
        return Response(status_code=499)
    note(request, documents=len(body.documents), prompt_tokens=result.prompt_tokens)
    return FastJSONResponse(rerank_body(body, result, spec(request).name))


routes = [
    Route("/v1/rerank", rerank, methods=["POST"]),
    Route("/v2/rerank", rerank, methods=["POST"]),
]
