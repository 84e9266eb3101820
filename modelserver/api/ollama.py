"""Ollama's ``/api/chat``, ``/api/generate``, ``/api/embed`` and ``/api/embeddings``, served at ``/ollama/api/...``.

Each request is translated into the OpenAI request this server already answers (a
:class:`~modelserver.protocol.ChatCompletionRequest`, validated the same way) and runs through the
chat route's pieces: the chat template, the tool parser, structured output (``format``), stop
strings and token counts. Only the framing is Ollama's: NDJSON lines (``application/x-ndjson``,
streamed unless ``"stream": false``), a final object with ``done: true``, ``done_reason`` and the
counts and durations in nanoseconds, ``tool_calls`` whose ``arguments`` is an object, and errors
as ``{"error": "..."}`` (a line of the stream once it runs).

``options`` map onto sampling: ``temperature``, ``top_p``, ``top_k``, ``seed``, ``num_predict``,
``stop``, ``repeat_penalty``, ``presence_penalty``, ``frequency_penalty``; ``num_ctx`` above the
model's context is lowered to it (as Ollama does); numbers may come as floats (``8192.0``). One
extension: ``options.tool_choice`` (``auto``, ``required``, ``none`` or a function name), which
Ollama's API has no field for. The router sends ``X-Ovrouter-Load-Ns`` (its wait for a cold
start), reported as ``load_duration``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modelserver.api import chat, vlm
from modelserver.api.common import ClientGone, SSEResponse, engine_as, engine_errors, note, read_body, runtime, spec
from modelserver.api.embeddings import embed_texts
from modelserver.engines.base import GenerationRequest, TextGenerator
from modelserver.errors import ModelServerError, RequestError, error_response
from modelserver.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from modelserver.tools import ToolCall, ToolStreamSplitter

__all__ = ["chat_routes", "embedding_routes"]

log = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"
LOAD_HEADER = "x-ovrouter-load-ns"
Handler = Callable[[Request], Awaitable[Response]]
Body = TypeVar("Body", bound=BaseModel)


class _Loose(BaseModel):
    """Ollama's fields: unknown ones ignored, numbers as JSON gives them (``8192.0`` for an int is fine)."""

    model_config = ConfigDict(extra="ignore")


class OllamaMessage(_Loose):
    role: str
    content: str | None = ""
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None


class _Generation(_Loose):
    model: str = ""
    stream: bool = True
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] = Field(default_factory=dict)
    think: bool | str | None = None
    keep_alive: Any = None  # the router's business


class OllamaChat(_Generation):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class OllamaGenerate(_Generation):
    prompt: str = ""
    system: str | None = None
    suffix: str | None = None
    raw: bool = False
    images: list[str] | None = None
    template: str | None = None


class OllamaEmbed(_Loose):
    model: str = ""
    input: str | list[str] = Field(default_factory=list)
    truncate: bool = True
    dimensions: int | None = None


class OllamaEmbeddings(_Loose):
    model: str = ""
    prompt: str = ""


# -- errors -------------------------------------------------------------------------------------


def _ollama_errors(handler: Handler) -> Handler:
    """Every error as Ollama writes it: ``{"error": "..."}`` with the status (and headers: X-Backend-Fatal)."""

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ModelServerError as exc:
            if exc.status >= 500:
                log.warning("%s failed: %s", request.url.path, exc.message)
            return error_response(exc, request.url.path)
        except ClientGone:
            return Response(status_code=499)

    return wrapped


async def _read(request: Request, model: type[Body]) -> Body:
    return await read_body(request, model)


# -- translation into the OpenAI request ---------------------------------------------------------

_INT_OPTIONS = {"top_k": "top_k", "seed": "seed", "num_predict": "max_tokens"}
_FLOAT_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "repeat_penalty": "repetition_penalty",
                  "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"options.{name}: expected a number, got {json.dumps(value)[:40]}")
    return float(value)


def sampling_fields(options: dict[str, Any], context: int | None, request: Request) -> dict[str, Any]:
    """``options`` as OpenAI sampling fields; Ollama's "off" values (``top_k`` 0, ``seed`` -1, ``num_predict``
    -1 or -2) leave the default; ``num_ctx`` above ``context`` is noted and lowered, as Ollama does."""
    fields: dict[str, Any] = {}
    for name, field in _INT_OPTIONS.items():
        if options.get(name) is not None and (number := int(_number(name, options[name]))) > (-1 if name == "seed"
                                                                                               else 0):
            fields[field] = number
    for name, field in _FLOAT_OPTIONS.items():
        if options.get(name) is not None:
            fields[field] = _number(name, options[name])
    if "temperature" in fields:
        fields["temperature"] = min(max(fields["temperature"], 0.0), 2.0)
    if fields.get("top_p", 1.0) <= 0 or fields.get("top_p", 1.0) > 1:
        fields.pop("top_p")
    if fields.get("repetition_penalty", 1.0) <= 0:
        fields.pop("repetition_penalty")
    for penalty in ("presence_penalty", "frequency_penalty"):
        if penalty in fields:
            fields[penalty] = min(max(fields[penalty], -2.0), 2.0)
    stop = options.get("stop")
    if stop:
        fields["stop"] = [stop] if isinstance(stop, str) else list(stop)
    if options.get("num_ctx") is not None:
        num_ctx = int(_number("num_ctx", options["num_ctx"]))
        if context is not None and num_ctx > context:
            note(request, num_ctx=f"{num_ctx}->{context}")  # Ollama lowers it to the model's with a warning
    if isinstance(choice := options.get("tool_choice"), str):
        fields["tool_choice"] = choice if choice in ("auto", "required", "none") else {
            "type": "function", "function": {"name": choice}}
    return fields


def _format(value: str | dict[str, Any] | None) -> dict[str, Any]:
    if value is None or value == "":
        return {}
    if value == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(value, dict):
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}}
    raise RequestError(f'format: expected "json" or a JSON schema object, got {json.dumps(value)[:60]}')


def _image_url(data: str) -> dict[str, Any]:
    url = data if data.startswith("data:") else "data:image;base64," + data
    return {"type": "image_url", "image_url": {"url": url}}


def _openai_message(message: OllamaMessage, index: int) -> dict[str, Any]:
    if message.role not in ("system", "user", "assistant", "tool"):
        raise RequestError(f"messages[{index}].role: expected system, user, assistant or tool, got {message.role!r}")
    out: dict[str, Any] = {"role": message.role, "content": message.content or ""}
    if message.images:
        out["content"] = [{"type": "text", "text": message.content or ""}, *map(_image_url, message.images)]
    if message.tool_calls:
        out["tool_calls"] = [_history_call(call, index, j) for j, call in enumerate(message.tool_calls)]
    if message.role == "tool" and message.tool_name:
        out["name"] = message.tool_name
    return out


def _history_call(call: dict[str, Any], index: int, j: int) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(f'messages[{index}].tool_calls[{j}]: expected {{"function": {{"name": ..., '
                           '"arguments": {...}}}}')
    out = {"type": "function", "function": {"name": function["name"], "arguments": function.get("arguments") or {}}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", **{k: v for k, v in tool.items() if k != "type"}}


def _check_think(body: _Generation, request: Request) -> None:
    if body.think not in (None, False):
        raise RequestError(f'"{body.model or spec(request).name}" does not support thinking')


def chat_request(body: OllamaChat, request: Request) -> ChatCompletionRequest:
    """The OpenAI chat request ``body`` stands for (validated: the same 400s as ``/v1/chat/completions``)."""
    _check_think(body, request)
    if not body.messages:
        raise RequestError("messages: send at least one message")
    data: dict[str, Any] = {"model": body.model, "messages": [_openai_message(m, i) for i, m in
                                                                enumerate(body.messages)]}
    if body.tools:
        data["tools"] = [_tool(t) for t in body.tools]
    data.update(sampling_fields(body.options, _context(request), request))
    if not body.tools:
        data.pop("tool_choice", None)
    data.update(_format(body.format))
    return _validated(data, ChatCompletionRequest)


Sampled = TypeVar("Sampled", ChatCompletionRequest, CompletionRequest)


def _validated(data: dict[str, Any], model: type[Sampled]) -> Sampled:
    parsed = parse_request(json.dumps(data).encode(), model)
    parsed.refuse_unsupported()
    return parsed


def _context(request: Request) -> int | None:
    return getattr(engine_as(request, TextGenerator), "context_length", None)


# -- answers ------------------------------------------------------------------------------------


class Clock:
    """The durations of the final object, in nanoseconds (the router's cold-start wait is the load)."""

    def __init__(self, request: Request) -> None:
        self.t0 = time.monotonic_ns()
        try:
            self.load_ns = max(0, int(request.headers.get(LOAD_HEADER, "0")))
        except ValueError:
            self.load_ns = 0
        self.first: int | None = None

    def started(self) -> None:
        self.first = time.monotonic_ns()

    def final(self, runs: list[chat.Run], finish: str) -> dict[str, Any]:
        end, stream = time.monotonic_ns(), runs[0].stream
        first = self.first or end
        return {"done": True, "done_reason": "length" if finish == "length" else "stop",
                "total_duration": end - self.t0 + self.load_ns, "load_duration": self.load_ns,
                "prompt_eval_count": stream.prompt_tokens, "prompt_eval_duration": first - self.t0,
                "eval_count": stream.completion_tokens, "eval_duration": end - first}


def _now() -> str:
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e9):09d}Z"


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def ollama_call(call: ToolCall, index: int) -> dict[str, Any]:
    """A call as Ollama sends it: ``arguments`` an object, not a JSON string."""
    try:
        arguments = json.loads(call.arguments or "{}")
    except json.JSONDecodeError:
        arguments = {}
    return {"id": call.id, "function": {"index": index, "name": call.name, "arguments": arguments}}


class Shape:
    """Where the text goes: ``message.content`` (chat) or ``response`` (generate)."""

    def __init__(self, model: str, is_chat: bool) -> None:
        self.model = model
        self.is_chat = is_chat

    def piece(self, text: str, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        head: dict[str, Any] = {"model": self.model, "created_at": _now()}
        if not self.is_chat:
            return {**head, "response": text, "done": False}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        return {**head, "message": message, "done": False}


async def _answer(request: Request, body: _Generation, generation: Any, stops: list[str],
                  parser: str | None, is_chat: bool) -> Response:
    clock, shape = Clock(request), Shape(body.model or spec(request).name, is_chat)
    generator = engine_as(request, TextGenerator)
    note(request, stream=body.stream, api="ollama")
    runs = await chat.start_runs(request, generator, [generation], stops)
    clock.started()
    if body.stream:
        return SSEResponse(_stream(request, runs, shape, parser, clock), lambda: chat.close_runs(request, runs),
                           media_type=NDJSON)
    try:
        with engine_errors(runtime(request)):
            choice = await chat.collect(runs[0], 0, parser, False)
    finally:
        await chat.close_runs(request, runs)
    calls = [ollama_call(_as_call(c), i) for i, c in enumerate(choice.tool_calls)]
    result = shape.piece(choice.text or "", calls)
    return JSONResponse({**result, **clock.final(runs, choice.finish)})


def _as_call(openai_call: dict[str, Any]) -> ToolCall:
    function = openai_call["function"]
    return ToolCall(function["name"], function["arguments"], openai_call["id"])


async def _stream(request: Request, runs: list[chat.Run], shape: Shape, parser: str | None,
                  clock: Clock) -> AsyncIterator[bytes]:
    run = runs[0]
    try:
        with engine_errors(runtime(request)):
            if parser is None:
                async for text in run.deltas():
                    yield _line(shape.piece(text))
            else:
                splitter = ToolStreamSplitter(parser)
                async for delta in run.deltas():
                    for line in _split(shape, splitter, *splitter.push(delta)):
                        yield line
                for line in _split(shape, splitter, *splitter.finish(cut=run.finish == "length")):
                    yield line
    except ModelServerError as exc:
        note(request, error=exc.code)
        yield _line({"error": exc.message})
        return
    last = shape.piece("")
    yield _line({**last, **clock.final(runs, run.finish or "stop")})


def _split(shape: Shape, splitter: ToolStreamSplitter, text: str, calls: tuple[ToolCall, ...]) -> list[bytes]:
    lines = [_line(shape.piece(text))] if text else []
    if calls:
        first = splitter.calls_sent - len(calls)
        lines.append(_line(shape.piece("", [ollama_call(call, first + k) for k, call in enumerate(calls)])))
    return lines


# -- the routes ---------------------------------------------------------------------------------


@_ollama_errors
async def api_chat(request: Request) -> Response:
    body: OllamaChat = await _read(request, OllamaChat)
    openai = chat_request(body, request)
    generation, parser = await vlm.plan_generation(request, openai)
    return await _answer(request, body, generation, openai.stop_strings(), parser, is_chat=True)


@_ollama_errors
async def api_generate(request: Request) -> Response:
    body: OllamaGenerate = await _read(request, OllamaGenerate)
    _check_think(body, request)
    if body.suffix:
        raise RequestError(f'"{body.model or spec(request).name}" does not support insert')
    if body.template:
        raise RequestError("template: a per-request prompt template is not supported; send raw: true with a "
                           "prompt already formatted, or use /api/chat")
    if not body.raw:  # the prompt goes through the chat template, as one user turn after the system prompt
        messages = ([OllamaMessage(role="system", content=body.system)] if body.system else []) + [
            OllamaMessage(role="user", content=body.prompt, images=body.images)]
        chat_body = OllamaChat(model=body.model, stream=body.stream, format=body.format, options=body.options,
                               messages=messages)
        openai = chat_request(chat_body, request)
        generation, _ = await vlm.plan_generation(request, openai)  # a generate body carries no tools
        return await _answer(request, body, generation, openai.stop_strings(), None, is_chat=False)
    if body.images or body.format:
        raise RequestError("raw: images and format need the chat template; send them without raw")
    data = {"model": body.model, "prompt": body.prompt, **sampling_fields(body.options, _context(request), request)}
    data.pop("tool_choice", None)
    completion: CompletionRequest = _validated(data, CompletionRequest)
    generation = GenerationRequest(sampling=chat.sampling(completion, spec(request).default_max_tokens),
                                   prompt=completion.prompt_text())
    return await _answer(request, body, generation, completion.stop_strings(), None, is_chat=False)


@_ollama_errors
async def api_embed(request: Request) -> Response:
    clock = Clock(request)
    body: OllamaEmbed = await _read(request, OllamaEmbed)
    texts = [body.input] if isinstance(body.input, str) else list(body.input)
    if not texts or any(not isinstance(t, str) or not t for t in texts):
        raise RequestError("input: send a non-empty string or a list of non-empty strings")
    result = await embed_texts(request, texts, body.truncate, body.dimensions)
    total = time.monotonic_ns() - clock.t0 + clock.load_ns
    return JSONResponse({"model": body.model or spec(request).name, "embeddings": result.vectors,
                         "total_duration": total, "load_duration": clock.load_ns,
                         "prompt_eval_count": result.prompt_tokens})


@_ollama_errors
async def api_embeddings(request: Request) -> Response:
    body: OllamaEmbeddings = await _read(request, OllamaEmbeddings)
    if not body.prompt:
        return JSONResponse({"embedding": []})
    result = await embed_texts(request, [body.prompt], True, None)
    return JSONResponse({"embedding": result.vectors[0]})


chat_routes = [
    Route("/ollama/api/chat", api_chat, methods=["POST"]),
    Route("/ollama/api/generate", api_generate, methods=["POST"]),
]
embedding_routes = [
    Route("/ollama/api/embed", api_embed, methods=["POST"]),
    Route("/ollama/api/embeddings", api_embeddings, methods=["POST"]),
]
