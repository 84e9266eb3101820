"""Engine protocols of the tasks beyond text: rerank, transcription, speech, vlm (plain Python, no OpenVINO).

Companion of :mod:`modelserver.engines.base` (llm, embeddings), with the same rules: the
``api/`` modules shape HTTP and call these; the OpenVINO engines and the fake ones in
:mod:`modelserver.engines.fake_media` implement them. Audio is a float32 numpy array,
an image an ``HxWx3`` uint8 numpy array.

:class:`SerialWorker` is the one way these engines call a blocking pipeline: one thread
per model, so a pipeline object is never entered by two requests at once, while the event
loop (``/health`` included) keeps answering.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

import numpy as np

from modelserver.engines.base import ChatTurn, Engine, GenerationRequest, SamplingParams, TextStream

__all__ = [
    "RerankResult",
    "Reranker",
    "Segment",
    "SerialWorker",
    "SpeechRequest",
    "SpeechResult",
    "SpeechSynthesizer",
    "Transcriber",
    "TranscriptionRequest",
    "TranscriptionResult",
    "VisionGenerator",
    "VisionRequest",
    "Word",
    "IMAGE_TAG",
    "image_tag",
]

T = TypeVar("T")


# -- rerank -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RerankResult:
    ranking: list[tuple[int, float]]  # (index into the documents, relevance score), best first, every document
    prompt_tokens: int


@runtime_checkable
class Reranker(Engine, Protocol):
    """Task ``rerank``: a relevance score of every document for the query."""

    async def rerank(self, query: str, documents: Sequence[str], truncate: bool = False) -> RerankResult:
        """Every document scored; a 400 for a query + document above the encoder's maximum unless ``truncate``."""
        ...


# -- transcription ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TranscriptionRequest:
    samples: np.ndarray  # float32 mono at 16 kHz
    language: str | None = None
    task: Literal["transcribe", "translate"] = "transcribe"
    prompt: str | None = None
    temperature: float | None = None
    segment_timestamps: bool = False
    word_timestamps: bool = False
    #: Streamed transcription: called (on the engine's thread) with each piece of text as it is decoded;
    #: answering True stops the decoding (the client went away).
    on_text: Callable[[str], bool] | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Segment:
    start_s: float
    end_s: float
    text: str


@dataclass(frozen=True, slots=True)
class Word:
    start_s: float
    end_s: float
    word: str


@dataclass(frozen=True, slots=True)
class TranscriptionResult:
    text: str
    language: str | None
    segments: list[Segment] = field(default_factory=list)
    words: list[Word] = field(default_factory=list)


@runtime_checkable
class Transcriber(Engine, Protocol):
    """Task ``transcription``: speech to text."""

    async def transcribe(self, request: TranscriptionRequest) -> TranscriptionResult: ...


# -- speech -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SpeechRequest:
    text: str
    voice: str
    speed: float = 1.0


@dataclass(frozen=True, slots=True)
class SpeechResult:
    samples: np.ndarray  # float32 mono in [-1, 1]
    rate: int


@runtime_checkable
class SpeechSynthesizer(Engine, Protocol):
    """Task ``speech``: text to a waveform; ``voices()`` names the voices a request may ask for."""

    def voices(self) -> list[str]: ...

    async def synthesize(self, request: SpeechRequest) -> SpeechResult: ...


# -- vlm ----------------------------------------------------------------------------------------


#: How an image marker looks in a turn's text (what :func:`image_tag` writes).
IMAGE_TAG = re.compile(r"<ov_genai_image_(\d+)>")


def image_tag(index: int) -> str:
    """The marker of image ``index`` (0-based, across the whole request) inside a turn's text."""
    return f"<ov_genai_image_{index}>"


@dataclass(frozen=True, slots=True)
class VisionRequest:
    """A chat whose turns may hold images: :func:`image_tag` markers in the text, in ``images`` order."""

    sampling: SamplingParams
    messages: tuple[ChatTurn, ...]
    images: tuple[np.ndarray, ...] = ()
    tools: tuple[dict[str, Any], ...] = ()  # as GenerationRequest's (tool calling)
    constraint: Any = None

    def last_user_text(self) -> str:
        users = [turn.content for turn in self.messages if turn.role == "user"]
        return users[-1] if users else ""


@runtime_checkable
class VisionGenerator(Engine, Protocol):
    """Task ``vlm``: chat over text and images, streamed like :class:`~modelserver.engines.base.TextGenerator`;
    a :class:`GenerationRequest` (``/v1/completions``) is a raw text prompt."""

    def generate(self, request: VisionRequest | GenerationRequest) -> TextStream: ...

    def prompt_tokens(self, request: VisionRequest | GenerationRequest) -> int: ...


# -- running blocking pipelines -----------------------------------------------------------------


class SerialWorker:
    """One thread that runs a model's blocking calls in order, with the counters ``/health`` shows.

    :meth:`run` awaits a call; :meth:`call` hands one over with a callback that the event loop runs
    with its answer: one hop there and one back, no task or wrapped future between them (the
    batcher's way: at one short text a request, each loop step is a part of the request's cost).
    """

    def __init__(self, name: str) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.running = 0
        self.completed = 0
        self.failed = 0

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        self.running += 1
        try:
            result = await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))
        except BaseException:
            self.failed += 1
            raise
        finally:
            self.running -= 1
        self.completed += 1
        return result

    def call(self, fn: Callable[[], T], done: Callable[[T | BaseException], None]) -> None:
        """Run ``fn`` on the worker; ``done`` gets its result, or the exception it raised, on the event loop
        (a closed worker: an exception at once)."""
        loop = asyncio.get_running_loop()

        def finish(answer: T | BaseException) -> None:
            self.running -= 1
            if isinstance(answer, BaseException):
                self.failed += 1
            else:
                self.completed += 1
            done(answer)

        def work() -> None:
            try:
                answer: T | BaseException = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the loop, where its owner gets it
                answer = exc
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits for the answer
                loop.call_soon_threadsafe(finish, answer)

        self.running += 1
        try:
            self._pool.submit(work)
        except RuntimeError as exc:  # shut down
            loop.call_soon(finish, exc)

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """For a call that reports back by itself (a streamer callback); no counters."""
        return self._pool.submit(fn)

    def stats(self) -> dict[str, Any]:
        return {"running": self.running, "completed": self.completed, "failed": self.failed}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
