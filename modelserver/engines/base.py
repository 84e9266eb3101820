"""What an engine is, per task, in plain-Python types (no OpenVINO, no HTTP).

The ``api/`` modules shape HTTP requests and responses and call these protocols; the
real OpenVINO engines and the fake engine implement them. Adding a task is a protocol
here (when no existing one fits), an engine module, an api module, and one line each in
``modelserver/tasks.py`` and ``modelserver/engines/__init__.py``.

Every engine also satisfies :class:`Engine`: ``describe()`` names the properties logged at
start, ``stats()`` feeds ``/health``, ``close()`` releases threads and device memory.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

__all__ = [
    "ChatTurn",
    "Embedder",
    "EmbeddingResult",
    "Engine",
    "FinishReason",
    "GenerationRequest",
    "PromptCounting",
    "SamplingParams",
    "TextGenerator",
    "TextStream",
    "cached_tokens",
]

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """One chat message reduced to text: ``role`` is system, user, assistant or tool.

    An assistant turn may carry ``tool_calls`` (OpenAI's shape, ``arguments`` parsed into a
    mapping as chat templates expect it); a tool turn names the call it answers.
    """

    role: str
    content: str
    tool_calls: tuple[dict[str, Any], ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    def as_template_message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = list(self.tool_calls)
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            message["name"] = self.name
        return message


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """OpenAI sampling parameters, already validated. ``None`` means "the model's default".

    ``fit_to_context``: the request gave no ``max_tokens``, so ``max_tokens`` (the model's
    default) shrinks to what the context leaves instead of refusing the request.
    """

    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    fit_to_context: bool = False


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A chat (``messages``) or a raw completion (``prompt``): exactly one of the two is set.

    ``tools`` are the OpenAI tool objects the prompt offers (empty: none); ``constraint``
    (a :data:`modelserver.structured.Constraint`) is what the output must match;
    ``logprobs`` asks for each generated token's log probability; ``continue_final`` renders
    the last (assistant) message left open, so the answer continues it (a resumed stream).
    """

    sampling: SamplingParams
    messages: tuple[ChatTurn, ...] | None = None
    prompt: str | None = None
    tools: tuple[dict[str, Any], ...] = ()
    constraint: Any = None
    logprobs: bool = False
    continue_final: bool = False  # the last message is an unfinished assistant answer to continue

    def last_user_text(self) -> str:
        """The text that the fake engine echoes and scans for fault markers."""
        if self.messages is None:
            return self.prompt or ""
        users = [turn.content for turn in self.messages if turn.role == "user"]
        return users[-1] if users else ""


@runtime_checkable
class TextStream(Protocol):
    """One running generation: iterate for text deltas; counts are final once iteration ends.

    ``aclose()`` stops the generation if it is still running (a client went away, or a
    stop string matched) and frees its batch slot; it is safe to call more than once.
    """

    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason | None

    def __aiter__(self) -> AsyncIterator[str]: ...

    async def aclose(self) -> None: ...


def cached_tokens(stream: TextStream) -> int:
    """Prompt tokens of ``stream`` the engine took from its prefix cache (0 where it keeps none).

    Read by every protocol's usage: chat ``prompt_tokens_details.cached_tokens``, Responses
    ``input_tokens_details.cached_tokens``, Messages ``cache_read_input_tokens``.
    """
    return int(getattr(stream, "cached_tokens", 0))


@runtime_checkable
class PromptCounting(Protocol):
    """A text engine that counts a request's prompt tokens without generating (``input_tokens``,
    ``count_tokens``): exactly the ``prompt_tokens`` the same request would be charged."""

    def prompt_tokens(self, request: GenerationRequest) -> int: ...


@runtime_checkable
class Engine(Protocol):
    def describe(self) -> dict[str, Any]: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


@runtime_checkable
class TextGenerator(Engine, Protocol):
    """Tasks ``llm`` (and ``vlm``): chat and completions, always streamed internally.

    ``tool_parser`` names the form of this model's tool calls (:mod:`modelserver.tools`).
    """

    tool_parser: str

    def generate(self, request: GenerationRequest) -> TextStream:
        """Start a generation; errors may surface here or from the stream's first step."""
        ...


@dataclass(frozen=True, slots=True)
class EmbeddingResult:
    vectors: list[list[float]]
    prompt_tokens: int


@runtime_checkable
class Embedder(Engine, Protocol):
    """Task ``embeddings``: one vector per input text, in input order.

    ``matryoshka``: a prefix of each vector is itself an embedding (requests may send ``dimensions``);
    ``normalizes``: vectors are L2-normalized (so is a shortened one).
    """

    matryoshka: bool
    normalizes: bool

    async def embed(self, texts: Sequence[str], truncate: bool = False) -> EmbeddingResult:
        """Vectors of ``texts``; a 400 for a text above the encoder's maximum unless ``truncate``."""
        ...
