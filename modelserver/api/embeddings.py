"""``/v1/embeddings`` (task embeddings): one vector per input, ``float`` or ``base64`` encoded.

``base64`` is little-endian float32, which is what the official SDK asks for by default. An
input above the encoder's maximum is a 400 ``context_length_exceeded`` (as OpenAI answers it),
unless the request sends ``truncate: true`` (as TEI and Cohere accept): then its first tokens
are embedded.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modelserver.api.common import (
    ClientGone,
    engine_as,
    engine_errors,
    note,
    read_body,
    runtime,
    spec,
    until_disconnect,
)
from modelserver.engines.base import Embedder
from modelserver.errors import UnsupportedParameter
from modelserver.protocol import EmbeddingRequest

__all__ = ["encode_vector", "routes"]


def encode_vector(vector: Sequence[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


async def embeddings(request: Request) -> Response:
    body = await read_body(request, EmbeddingRequest)
    if body.dimensions is not None:
        raise UnsupportedParameter("dimensions: choosing the vector size is not supported", param="dimensions")
    embedder = engine_as(request, Embedder)
    texts = body.texts()
    try:
        with engine_errors(runtime(request)):
            result = await until_disconnect(request, embedder.embed(texts, body.truncate))
    except ClientGone:
        note(request, finish="cancelled")
        return Response(status_code=499)
    note(request, inputs=len(texts), prompt_tokens=result.prompt_tokens)
    data: list[dict[str, Any]] = [
        {"object": "embedding", "index": i, "embedding": encode_vector(vector, body.encoding_format)}
        for i, vector in enumerate(result.vectors)
    ]
    counts = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return JSONResponse({"object": "list", "data": data, "model": spec(request).name, "usage": counts})


routes = [Route("/v1/embeddings", embeddings, methods=["POST"])]
