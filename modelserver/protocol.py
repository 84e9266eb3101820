"""OpenAI request models (pydantic) and response builders, shared by every engine.

Parameter policy, the way OpenAI-compatible servers (vLLM, llama.cpp's server) behave:

- **Unknown fields are ignored** (logged at DEBUG), so clients that send newer OpenAI
  fields keep working.
- **Known fields are type-checked strictly**: a wrong type or an out-of-range value is a
  400 whose message names the field (``temperature: Input should be a valid number``).
- **Known fields whose value this server cannot honour are a 400**, never silently
  dropped: ``n`` > 1, ``tools`` / ``functions``, a ``response_format`` other than text,
  ``logprobs``, a non-empty ``logit_bias``; for ``/v1/completions`` also ``echo``,
  ``suffix``, ``best_of`` > 1 and more than one prompt.
- Extensions accepted as in vLLM: ``top_k``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``.
- ``max_tokens`` (or ``max_completion_tokens``) defaults to the model's ``default_max_tokens``;
  ``temperature`` omitted means the model's own generation defaults, ``0`` greedy.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from modelserver.errors import RequestError, UnsupportedParameter

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "ChatShape",
    "CompletionRequest",
    "EmbeddingRequest",
    "TextShape",
    "parse_request",
    "usage",
]

Model = TypeVar("Model", bound=BaseModel)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class ContentPart(_Request):
    """One part of a message's content; engines for images or audio read their extra keys."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(p, dict) and isinstance(p.get("type"), str) for p in value):
            return value
        raise ValueError('must be a string or a list of content parts like {"type": "text", "text": "..."}')


class StreamOptions(_Request):
    include_usage: bool = False


class _Sampling(_Request):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool = False
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: Any) -> Any:
        if value is None or (isinstance(value, str) and value):
            return value
        if isinstance(value, list) and len(value) <= 16 and all(isinstance(s, str) and s for s in value):
            return value
        raise ValueError("must be a non-empty string or a list of at most 16 non-empty strings")

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def refuse_unsupported(self) -> None:
        """400 for known parameters whose value this server cannot honour."""
        if self.n > 1:
            raise _unsupported("n", "n > 1 is not supported; send n parallel requests instead")
        if self.logprobs not in (None, False, 0):
            raise _unsupported("logprobs", "logprobs are not supported by this server")
        if self.logit_bias:
            raise _unsupported("logit_bias", "logit_bias is not supported by this server")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    top_logprobs: int | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.tools or self.functions:
            raise _unsupported("tools", "tool calling is not supported by this server; send no `tools`")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise _unsupported("response_format", 'only {"type": "text"} is supported')
        if self.top_logprobs:
            raise _unsupported("top_logprobs", "logprobs are not supported by this server")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise _unsupported("prompt", "send exactly one prompt per request (a string)")
        if self.echo:
            raise _unsupported("echo", "echo is not supported by this server")
        if self.suffix:
            raise _unsupported("suffix", "suffix is not supported by this server")
        if self.best_of is not None and self.best_of > 1:
            raise _unsupported("best_of", "best_of > 1 is not supported")

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class EmbeddingRequest(_Request):
    model: str | None = None
    input: str | list[str]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(s, str) for s in value)):
            return value
        raise ValueError("must be a string or a non-empty list of strings (token arrays are not supported)")

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


def _unsupported(param: str, message: str) -> RequestError:
    return UnsupportedParameter(f"{param}: {message}", param=param)


# -- parsing ----------------------------------------------------------------------------------


def parse_request(body: bytes, model: type[Model]) -> Model:
    """``body`` as ``model``; :class:`RequestError` naming the field for anything wrong."""
    if not body.strip():
        raise RequestError("the request body is empty; send a JSON object")
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc) from None


def _location(loc: tuple[int | str, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _field_path(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """``loc`` without the union-member tags pydantic inserts (``str``, ``list[ContentPart]``)."""
    return tuple(p for p in loc if isinstance(p, int) or ("[" not in p and p not in _UNION_TAGS))


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


def _most_specific(errors: list[Any]) -> list[Any]:
    """One error per field; of a union's alternatives, the one that got deepest into the value."""
    kept: list[Any] = []
    for err in sorted(errors, key=lambda e: -len(_field_path(e["loc"]))):
        path = _field_path(err["loc"])
        if not any(_field_path(k["loc"])[: len(path)] == path for k in kept):
            kept.append(err)
    order = {id(e): i for i, e in enumerate(errors)}
    return sorted(kept, key=lambda e: order[id(e)])


def _invalid(exc: ValidationError) -> RequestError:
    errors = _most_specific(list(exc.errors()))[:3]
    lines = []
    for err in errors:
        where = _location(_field_path(err["loc"]))
        if err["type"] == "missing":
            lines.append(f"{where}: required field is missing")
            continue
        message = str(err["msg"]).removeprefix("Value error, ")
        lines.append(f"{where}: {message} (got {json.dumps(err.get('input'), default=str)[:80]})")
    param = _location(_field_path(errors[0]["loc"])) if errors else None
    return RequestError("invalid request: " + "; ".join(lines), param=param or None)


# -- responses --------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class _Shape:
    """The ids and envelope one response shares across its body or its chunks."""

    prefix = ""

    def __init__(self, model: str) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def usage_chunk(self, counts: dict[str, int]) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object, []), "usage": counts}

    chunk_object = ""


class ChatShape(_Shape):
    """``chat.completion`` bodies and ``chat.completion.chunk`` stream events."""

    prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"

    def body(self, text: str, finish: str, counts: dict[str, int]) -> dict[str, Any]:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish,
        }
        return {**self._envelope("chat.completion", [choice]), "usage": counts}

    def opening(self) -> dict[str, Any] | None:
        return self._chunk({"role": "assistant", "content": ""}, None)

    def delta(self, text: str) -> dict[str, Any]:
        return self._chunk({"content": text}, None)

    def closing(self, finish: str) -> dict[str, Any]:
        return self._chunk({}, finish)

    def _chunk(self, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        return self._envelope(
            self.chunk_object, [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        )


class TextShape(_Shape):
    """``text_completion`` bodies and stream events (the legacy ``/v1/completions``)."""

    prefix = "cmpl"
    chunk_object = "text_completion"

    def body(self, text: str, finish: str, counts: dict[str, int]) -> dict[str, Any]:
        return {**self._envelope("text_completion", [self._choice(text, finish)]), "usage": counts}

    def opening(self) -> dict[str, Any] | None:
        return None

    def delta(self, text: str) -> dict[str, Any]:
        return self._envelope(self.chunk_object, [self._choice(text, None)])

    def closing(self, finish: str) -> dict[str, Any]:
        return self._envelope(self.chunk_object, [self._choice("", finish)])

    @staticmethod
    def _choice(text: str, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
