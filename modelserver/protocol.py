"""OpenAI request models (pydantic) and response builders, shared by every engine.

Parameter policy, the way OpenAI-compatible servers (vLLM, llama.cpp's server) behave:

- **Unknown fields are ignored** (logged at DEBUG), so clients that send newer OpenAI
  fields keep working.
- **Known fields are type-checked strictly**: a wrong type or an out-of-range value is a
  400 whose message names the field (``temperature: Input should be a valid number``).
- **Known fields whose value this server cannot honour are a 400**, never silently
  dropped: ``n`` above the model's ``max_n``, the legacy ``functions``, ``top_logprobs`` > 0,
  a non-empty ``logit_bias``; for ``/v1/completions`` also ``logprobs``, ``echo``,
  ``suffix``, ``best_of`` > 1 and more prompts x ``n`` than ``max(max_n, 32)``.
- ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` and ``response_format`` (``json_object``,
  ``json_schema``) as OpenAI defines them; at most one output constraint per request
  (``response_format``, ``guided_json``, ``guided_regex``, ``guided_choice``, or a forced
  ``tool_choice``); ``guided_grammar`` is a 400.
- Extensions accepted as in vLLM: ``top_k``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
  ``guided_json``, ``guided_regex``, ``guided_choice``.
- **Ranges** are field constraints here (``seed`` an int64 or up to the engine's 2**64 - 1, a negative one
  meaning a random seed; no
  NaN/Infinity anywhere, ...); whether prompt + ``max_tokens`` fit the model's context is the
  engine's check (:mod:`modelserver.engines.context`); a body nested deeper than
  :data:`MAX_JSON_DEPTH` is a 400 before pydantic recurses into it.
- ``max_tokens`` (or ``max_completion_tokens``) defaults to the model's ``default_max_tokens``;
  ``temperature`` omitted means the model's own generation defaults, ``0`` greedy.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from modelserver.errors import RequestError, UnsupportedParameter
from modelserver.ids import random_hex
from modelserver.surrogates import lone_surrogate

__all__ = [
    "ChatCompletionRequest",
    "Choice",
    "ChatMessage",
    "ChatShape",
    "CompletionRequest",
    "DetokenizeBody",
    "MAX_JSON_DEPTH",
    "SEED_RANGE",
    "EmbeddingRequest",
    "TextShape",
    "TokenizeBody",
    "parse_request",
    "usage",
]


Model = TypeVar("Model", bound=BaseModel)

#: ``seed`` is the engine's ``size_t`` (``GenerationConfig.rng_seed``): 0 .. 2**64 - 1.
SEED_RANGE = 2**64
#: ``max_tokens``, ``min_tokens`` and ``top_k`` beyond any model's context (the context check is per model).
MAX_TOKENS = 2**31 - 1
MAX_REPETITION_PENALTY = 10.0
MAX_STOPS = 16
MAX_STOP_CHARS = 1024
#: Deepest JSON nesting a request body may have (a JSON schema in ``tools`` or ``guided_json`` needs a dozen).
MAX_JSON_DEPTH = 64


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class ContentPart(_Request):
    """One part of a message's content; engines for images or audio read their extra keys."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ToolCallFunction(_Request):
    name: str = Field(..., min_length=1)
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Request):
    """A call in an assistant message of the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(p, dict) and isinstance(p.get("type"), str) for p in value):
            return value
        raise ValueError('must be a string or a list of content parts like {"type": "text", "text": "..."}')

    @model_validator(mode="after")
    def _content_needed(self) -> ChatMessage:
        """Only an assistant message may go without ``content`` (one that made tool calls), as OpenAI has it."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f'a {self.role} message needs "content": a string or a list of content parts')
        return self


class FunctionDef(_Request):
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: ToolChoiceFunction


class JSONSchemaFormat(_Request):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StreamOptions(_Request):
    include_usage: bool = False


class _Sampling(_Request):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1, le=MAX_TOKENS)
    seed: int | None = Field(None, ge=-(2**63), le=SEED_RANGE - 1)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=MAX_REPETITION_PENALTY)
    min_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS)
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = None

    @field_validator("seed")
    @classmethod
    def _random_seed(cls, value: int | None) -> int | None:
        """A negative seed (OpenAI's spec allows any int64) asks for a random one, as llama.cpp's -1 does."""
        return None if value is not None and value < 0 else value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: Any) -> Any:
        if value is None or _stop_ok(value):
            return value
        if isinstance(value, list) and len(value) <= MAX_STOPS and all(_stop_ok(s) for s in value):
            return value
        raise ValueError(
            f"must be a non-empty string or a list of at most {MAX_STOPS} non-empty strings, "
            f"each at most {MAX_STOP_CHARS} characters"
        )

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def refuse_unsupported(self, max_n: int = 1) -> None:
        """400 for known parameters whose value this server cannot honour."""
        if self.n > max_n:
            raise _unsupported("n", f"n must be at most {max_n} for this model (its max_n); send more requests instead")
        if self.logit_bias:
            raise _unsupported("logit_bias", "logit_bias is not supported by this server")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: Any = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    #: vLLM's name: the last message is an unfinished assistant answer; the model continues it
    #: (what the router sends to resume a stream whose backend died)
    continue_final_message: bool = False

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, value: Any) -> Any:
        if value is None or value in ("none", "auto", "required"):
            return value
        if isinstance(value, dict) and value.get("type") == "function":
            return value
        raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')

    def refuse_unsupported(self, max_n: int = 1) -> None:
        super().refuse_unsupported(max_n)
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise RequestError(
                "continue_final_message: the last message must be the assistant's answer to continue",
                param="continue_final_message",
            )
        if self.functions:
            raise _unsupported("functions", "the legacy `functions` are not supported; send them as `tools`")
        if self.top_logprobs:
            raise _unsupported(
                "top_logprobs", "only the chosen token's logprob is available (`logprobs: true`, top_logprobs 0)"
            )
        if self.guided_grammar is not None:
            raise _unsupported(
                "guided_grammar",
                "grammars are not accepted (one that fails to compile would fail every request in flight); "
                "use guided_json, guided_regex or guided_choice",
            )
        self._check_tools()
        wanted = [name for name in _CONSTRAINTS if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type == "text":
            wanted.remove("response_format")
        if len(wanted) > 1:
            raise _unsupported(wanted[1], f"give only one of {', '.join(wanted)}")
        if self.response_format is not None and self.response_format.type == "json_schema":
            if self.response_format.json_schema is None:
                raise RequestError(
                    'response_format.json_schema: required for type json_schema ({"name": ..., "schema": {...}})',
                    param="response_format",
                )

    def _check_tools(self) -> None:
        names = [tool.function.name for tool in self.tools or ()]
        if self.tool_choice is not None and self.tool_choice != "none" and not names:
            raise RequestError("tool_choice: needs `tools` to choose from", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise RequestError(
                f"tool_choice.function.name: {self.tool_choice.function.name!r} is not one of the tools "
                f"({', '.join(names)})",
                param="tool_choice",
            )

    def tool_mode(self) -> str:
        """none (no tools offered), auto, required, or the name of the one function that must be called."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or "auto"

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


_CONSTRAINTS = ("response_format", "guided_json", "guided_regex", "guided_choice")


#: The most choices (prompts x ``n``) one ``/v1/completions`` request may ask for when ``max_n`` is lower:
#: LangChain's ``OpenAI`` LLM sends its batches as one request of up to 20 prompts (its ``batch_size``).
MAX_PROMPTS = 32


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_text(cls, value: Any) -> Any:
        if _token_ids(value):
            raise ValueError("token-id prompts are not supported: send the prompt as text (a string or a list "
                             "of strings)")
        return value

    def refuse_unsupported(self, max_n: int = 1) -> None:
        super().refuse_unsupported(max_n)
        if self.logprobs:
            raise _unsupported("logprobs", "logprobs are not supported on /v1/completions; use the chat endpoint")
        if isinstance(self.prompt, list) and not self.prompt:
            raise RequestError("prompt: send a string or a non-empty list of strings", param="prompt")
        if len(self.prompts()) * self.n > max(max_n, MAX_PROMPTS):
            raise _unsupported("prompt", f"{len(self.prompts())} prompts x n={self.n} is more than the "
                               f"{max(max_n, MAX_PROMPTS)} choices one request may ask for; send fewer prompts")
        if self.echo:
            raise _unsupported("echo", "echo is not supported by this server")
        if self.suffix:
            raise _unsupported("suffix", "suffix is not supported by this server")
        if self.best_of is not None and self.best_of > 1:
            raise _unsupported("best_of", "best_of > 1 is not supported")

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def prompts(self) -> list[str]:
        """Every prompt: OpenAI takes a list and answers ``n`` choices for each, numbered prompt by prompt."""
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


#: Token-id input is refused: a client's ids (LangChain's OpenAIEmbeddings sends tiktoken ids by default) are
#: not this model's tokens, and decoding them with this model's tokenizer would embed silently wrong text.
TOKEN_ARRAYS = (
    "token-id arrays are not supported: send the text (this model's tokenizer is not the client's; "
    "with LangChain, OpenAIEmbeddings(..., check_embedding_ctx_length=False) sends text)"
)


class TokenizeBody(_Request):
    """``/tokenize``: llama.cpp's ``content`` or vLLM's ``prompt`` / ``messages`` (modelserver/api/tokenize.py)."""

    model: str | None = None
    content: str | None = None  # llama.cpp
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False
    prompt: str | None = None  # vLLM
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    return_token_strs: bool = False


class DetokenizeBody(_Request):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=MAX_TOKENS)]]


def _token_ids(value: Any) -> bool:
    items = value if isinstance(value, list) else []
    return bool(items) and all(isinstance(i, int) or (isinstance(i, list) and bool(i) and isinstance(i[0], int))
                               for i in items)


class EmbeddingRequest(_Request):
    model: str | None = None
    input: str | list[str]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    #: as TEI and Cohere: cut an input longer than the encoder's maximum instead of a 400
    truncate: bool = False

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(s, str) for s in value)):
            if value == "" or (isinstance(value, list) and "" in value):
                raise ValueError("must not be empty: an empty string has no embedding; send some text")
            return value
        raise ValueError(TOKEN_ARRAYS if _token_ids(value) else "must be a string or a non-empty list of strings")

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


def _stop_ok(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_STOP_CHARS


def _unsupported(param: str, message: str) -> RequestError:
    return UnsupportedParameter(f"{param}: {message}", param=param)


# -- parsing ----------------------------------------------------------------------------------


def parse_request(body: bytes, model: type[Model]) -> Model:
    """``body`` as ``model``; :class:`RequestError` naming the field for anything wrong."""
    if not body.strip():
        raise RequestError("the request body is empty; send a JSON object")
    try:
        data = json.loads(body)  # C; a nesting past the recursion limit is a RecursionError, not a crash
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise _too_deep(MAX_JSON_DEPTH) from None
    except ValueError as exc:  # "Exceeds the limit (4300 digits) for integer string conversion"
        raise RequestError(f"the request body holds a number too long to read ({str(exc).split(':')[0]})") from None
    check_depth(body)  # before pydantic (and whatever reads the values) recurses into it
    check_characters(body, data)
    if not isinstance(data, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc) from None


def check_characters(body: bytes, data: Any) -> None:
    """400 when a string of ``data`` holds a lone surrogate (``"\\ud800"``): no text can be encoded with it
    (:func:`modelserver.surrogates.lone_surrogate`)."""
    if (message := lone_surrogate(body, data)) is not None:
        raise RequestError(message)


#: A JSON string, escapes included (its brackets are text, not structure).
_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_OPENERS = np.zeros(256, dtype=np.int8)
_OPENERS[[ord("["), ord("{")]] = 1
_OPENERS[[ord("]"), ord("}")]] = -1


def check_depth(body: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    """400 when the arrays and objects of ``body`` (valid JSON) nest deeper than ``limit``.

    Strings are cut out and the brackets left are summed in numpy, so a large flat body costs
    milliseconds, not a Python loop per bracket. Only for a body that parsed: the string scan
    is linear on valid JSON (an unterminated string could make it quadratic).
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return
    brackets = np.frombuffer(_STRINGS.sub(b"", body).translate(None, _NOT_BRACKETS), dtype=np.uint8)
    depth = 0
    for start in range(0, len(brackets), 1 << 20):
        levels = np.cumsum(_OPENERS[brackets[start : start + (1 << 20)]], dtype=np.int64) + depth
        if int(levels.max()) > limit:
            raise _too_deep(limit)
        depth = int(levels[-1])


def _too_deep(limit: int) -> RequestError:
    return RequestError(
        f"the request body is nested too deeply: more than {limit} levels of arrays/objects; send a flatter JSON object"
    )


def _location(loc: tuple[int | str, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _field_path(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """``loc`` without the union-member tags pydantic inserts (``str``, ``list[ContentPart]``, ``NamedToolChoice``)."""
    return tuple(p for p in loc if isinstance(p, int) or not _is_union_tag(p))


def _is_union_tag(part: str) -> bool:
    return "[" in part or part in _UNION_TAGS or part[:1].isupper()  # model names (NamedToolChoice) are tags too


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


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; with ``cached_tokens`` (chat) also ``prompt_tokens_details.cached_tokens``."""
    counts: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        counts["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return counts


@dataclass(slots=True)
class Choice:
    """One finished choice: its text (``None`` when it is all tool calls), calls, finish and logprobs."""

    index: int
    text: str | None
    finish: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None


class _Shape:
    """The ids and envelope one response shares across its body or its chunks.

    ``system_fingerprint`` names the backend configuration; with ``include_usage`` every
    chunk carries ``"usage": null`` until the final usage chunk, as OpenAI sends them.
    """

    prefix = ""
    chunk_object = ""

    def __init__(self, model: str, fingerprint: str | None = None, include_usage: bool = False) -> None:
        self.id = f"{self.prefix}-{random_hex()}"
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint
        self.include_usage = include_usage

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        envelope = {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                    "system_fingerprint": self.fingerprint, "choices": choices}
        if self.include_usage and kind == self.chunk_object:
            envelope["usage"] = None
        return envelope

    def usage_chunk(self, counts: dict[str, Any]) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object, []), "usage": counts}


class ChatShape(_Shape):
    """``chat.completion`` bodies and ``chat.completion.chunk`` stream events."""

    prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"

    def body(self, choices: list[Choice], counts: dict[str, Any]) -> dict[str, Any]:
        return {**self._envelope("chat.completion", [self._choice(c) for c in choices]), "usage": counts}

    @staticmethod
    def _choice(choice: Choice) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": choice.text, "refusal": None}
        if choice.tool_calls:
            message["tool_calls"] = choice.tool_calls
        logprobs = None if choice.logprobs is None else {"content": choice.logprobs, "refusal": None}
        return {"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": choice.finish}

    def opening(self, index: int = 0) -> dict[str, Any] | None:
        return self._chunk({"role": "assistant", "content": "", "refusal": None}, None, index)

    def delta(self, text: str, index: int = 0) -> dict[str, Any]:
        return self._chunk({"content": text}, None, index)

    def tool_calls(self, calls: list[dict[str, Any]], index: int = 0) -> dict[str, Any]:
        """One chunk per call, whole: id, name and the complete arguments, as the SDKs assemble them."""
        return self._chunk({"tool_calls": calls}, None, index)

    def closing(self, finish: str, index: int = 0, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The last chunk of a choice; a stream with ``logprobs`` carries them all here."""
        chunk = self._chunk({}, finish, index)
        if logprobs is not None:
            chunk["choices"][0]["logprobs"] = {"content": logprobs, "refusal": None}
        return chunk

    def _chunk(self, delta: dict[str, Any], finish: str | None, index: int) -> dict[str, Any]:
        return self._envelope(
            self.chunk_object, [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]
        )


class TextShape(_Shape):
    """``text_completion`` bodies and stream events (the legacy ``/v1/completions``)."""

    prefix = "cmpl"
    chunk_object = "text_completion"

    def body(self, choices: list[Choice], counts: dict[str, Any]) -> dict[str, Any]:
        rendered = [self._choice(c.text or "", c.finish, c.index) for c in choices]
        return {**self._envelope("text_completion", rendered), "usage": counts}

    def opening(self, index: int = 0) -> dict[str, Any] | None:
        return None

    def delta(self, text: str, index: int = 0) -> dict[str, Any]:
        return self._envelope(self.chunk_object, [self._choice(text, None, index)])

    def tool_calls(self, calls: list[dict[str, Any]], index: int = 0) -> dict[str, Any]:
        raise NotImplementedError("completions have no tool calls")

    def closing(self, finish: str, index: int = 0, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return self._envelope(self.chunk_object, [self._choice("", finish, index)])

    @staticmethod
    def _choice(text: str, finish: str | None, index: int) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
