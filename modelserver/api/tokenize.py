"""``/tokenize`` and ``/detokenize`` (tasks llm and vlm), in llama.cpp's and vLLM's shapes.

The body says which: llama.cpp's server sends ``content`` (``add_special`` default false,
``with_pieces``) and reads ``{"tokens": [...]}`` (ids, or ``{"id", "piece"}`` objects);
vLLM's sends ``prompt`` (``add_special_tokens`` default true) or chat ``messages`` (the
model's chat template applied, ``add_generation_prompt`` default true,
``add_special_tokens`` default false, ``tools``, ``continue_final_message``) and reads
``{"count", "max_model_len", "tokens", "token_strs"}``. ``/detokenize`` takes ``tokens`` in
both and answers the text under both names (llama.cpp's ``content``, vLLM's ``prompt``);
special tokens are kept, as both servers do. Counts are never cut (see
:mod:`modelserver.engines.tokens`).
"""

from __future__ import annotations

from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modelserver.api.chat import chat_turns
from modelserver.api.common import engine_as, engine_errors, note, read_body, runtime
from modelserver.engines.base import GenerationRequest, SamplingParams
from modelserver.engines.tokens import TokenIds
from modelserver.errors import RequestError, UnsupportedParameter
from modelserver.protocol import DetokenizeBody, TokenizeBody

__all__ = ["routes"]


class Tokenizing(Protocol):
    """What these routes ask of an llm or vlm engine."""

    context_length: int | None
    tokens: TokenIds

    def chat_prompt(self, request: GenerationRequest, add_generation_prompt: bool = True) -> str: ...


def text_of(body: TokenizeBody, engine: Tokenizing) -> tuple[str, bool]:
    """The text to encode and whether to add the special tokens; 400 unless exactly one input is given."""
    given = [key for key in ("content", "prompt", "messages") if getattr(body, key) is not None]
    if len(given) != 1:
        raise RequestError("send one of `content` (llama.cpp's /tokenize), `prompt` or `messages` (vLLM's)"
                           + (f"; got {', '.join(given)}" if given else ""), param="content")
    if body.content is not None:
        if not body.parse_special:
            raise UnsupportedParameter("parse_special: false is not supported; special tokens written in "
                                       "the text are always read as such", param="parse_special")
        return body.content, body.add_special
    if body.prompt is not None:
        return body.prompt, body.add_special_tokens is not False
    chat = GenerationRequest(SamplingParams(max_tokens=1), messages=chat_turns(body.messages or []),
                             tools=tuple(t.model_dump(exclude_none=True) for t in body.tools or ()),
                             continue_final=body.continue_final_message)
    return engine.chat_prompt(chat, body.add_generation_prompt), body.add_special_tokens is True


async def tokenize(request: Request) -> Response:
    body = await read_body(request, TokenizeBody)
    engine = engine_as(request, Tokenizing)
    with engine_errors(runtime(request)):
        text, special = text_of(body, engine)
        ids = engine.tokens.encode(text, special)
        note(request, tokens=len(ids))
        if body.content is not None:  # llama.cpp
            if body.with_pieces:
                pieces = engine.tokens.pieces(ids)
                return JSONResponse({"tokens": [{"id": i, "piece": p} for i, p in zip(ids, pieces, strict=True)]})
            return JSONResponse({"tokens": ids})
        answer: dict[str, Any] = {"count": len(ids), "max_model_len": engine.context_length, "tokens": ids,
                                  "token_strs": engine.tokens.pieces(ids) if body.return_token_strs else None}
        return JSONResponse(answer)


async def detokenize(request: Request) -> Response:
    body = await read_body(request, DetokenizeBody)
    engine = engine_as(request, Tokenizing)
    with engine_errors(runtime(request)):
        text = engine.tokens.decode(body.tokens)
    return JSONResponse({"content": text, "prompt": text})


routes = [
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
]
