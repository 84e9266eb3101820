"""``/v1/embeddings`` (task embeddings): one vector per input, ``float`` or ``base64`` encoded.

``base64`` is little-endian float32, which is what the official SDK asks for by default. An
input above the encoder's maximum is a 400 ``context_length_exceeded`` (as OpenAI answers it),
unless the request sends ``truncate: true`` (as TEI and Cohere accept): then its first tokens
are embedded. ``dimensions`` shortens each vector to its first N numbers (renormalized when the
model normalizes) on a model trained for it (``matryoshka``, :func:`shorten`); any other model
answers 400 naming ``dimensions``, since a cut vector of such a model is not an embedding.
At most :data:`MAX_INPUTS` inputs a request (OpenAI's limit): the answer is ~8 KB of JSON an input
whatever its length, so 100000 one-letter inputs (500 KB sent) made an 810 MB answer and a 2.7 GB peak.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, cast

import numpy as np
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
from modelserver.engines.base import Embedder, EmbeddingResult
from modelserver.errors import RequestError, UnsupportedParameter
from modelserver.protocol import EmbeddingRequest

__all__ = ["MAX_INPUTS", "embed_texts", "encode_vector", "routes", "shorten"]

#: Inputs of one embeddings request (OpenAI's limit; LangChain sends 1000 at a time).
MAX_INPUTS = 2048


def encode_vector(vector: Sequence[float], encoding_format: str) -> Sequence[float] | str:
    """base64 of little-endian float32, or the numbers as they are (:class:`FastJSONResponse` writes them).

    ``struct`` packs a list of floats in half the time numpy takes to build an array of it (384 numbers:
    ~3 us against ~6), to the same bytes (both round each double to the nearest float32)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def shorten(vectors: Sequence[Sequence[float]], dimensions: int | None, embedder: Embedder) -> list[Sequence[float]]:
    """``vectors`` cut to their first ``dimensions`` numbers (None: as they are); 400 on a model not trained for it."""
    if dimensions is None:
        return list(vectors)
    if not embedder.matryoshka:
        raise UnsupportedParameter(
            "dimensions: this model was not trained to give shorter vectors (Matryoshka); omit dimensions, "
            "or set options.matryoshka: true in its config if it was", param="dimensions")
    size = len(vectors[0]) if vectors else dimensions
    if dimensions > size:
        raise RequestError(f"dimensions: this model's vectors have {size} numbers; ask for at most {size}, "
                           f"got {dimensions}", param="dimensions")
    cut = np.asarray(vectors, dtype=np.float64)[:, :dimensions]
    if embedder.normalizes:
        cut /= np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)
    return [row.tolist() for row in cut]


async def embed_texts(request: Request, texts: list[str], truncate: bool, dimensions: int | None) -> EmbeddingResult:
    """The vectors of ``texts``, cut to ``dimensions`` (every embeddings route's one way to the engine);
    :class:`ClientGone` when the client left first."""
    if len(texts) > MAX_INPUTS:
        raise RequestError(f"input: at most {MAX_INPUTS} inputs a request, got {len(texts)}; send them in "
                           f"several requests", param="input")
    embedder = engine_as(request, Embedder)
    if dimensions is not None and not embedder.matryoshka:  # before the work: refused whatever the input
        shorten([], dimensions, embedder)
    try:
        with engine_errors(runtime(request)):
            result = await until_disconnect(request, embedder.embed(texts, truncate))
    except ClientGone:
        note(request, finish="cancelled")
        raise
    note(request, inputs=len(texts), prompt_tokens=result.prompt_tokens)
    if dimensions is None:
        return result
    return replace(result, vectors=cast(list[list[float]], shorten(result.vectors, dimensions, embedder)))


async def embeddings(request: Request) -> Response:
    body = await read_body(request, EmbeddingRequest)
    try:
        result = await embed_texts(request, body.texts(), body.truncate, body.dimensions)
    except ClientGone:
        return Response(status_code=499)
    data: list[dict[str, Any]] = [
        {"object": "embedding", "index": i, "embedding": encode_vector(vector, body.encoding_format)}
        for i, vector in enumerate(result.vectors)
    ]
    counts = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return FastJSONResponse({"object": "list", "data": data, "model": spec(request).name, "usage": counts})


routes = [Route("/v1/embeddings", embeddings, methods=["POST"])]
