"""Fake engines (``engine: fake``) for rerank, transcription, speech and vlm: the real wire shapes, no model.

They load in ``fake.load_s``, answer deterministically and honour the fault markers of
:func:`modelserver.engines.fake.inject_faults` (``[[crash]]``, ``[[hang]]``, ``[[fatal]]``,
``[[error]]``), found in the rerank query, the transcription prompt, the speech input or
the last user message:

- rerank: relevance = (1 + cosine) / 2 of the fake embeddings, so documents sharing the
  query's words rank first;
- transcription: ``"fake transcription of N.NN seconds of audio"``, one segment per
  started 5 seconds and evenly spaced word timings;
- speech: a 440 Hz tone of 60 ms per character at 16 kHz, divided by ``speed``; voices
  are ``options.voices`` keys when given (any name otherwise);
- vlm: the echo of the LLM fake with each image tag replaced by ``[image WxH]``.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from modelserver.engines.base import GenerationRequest
from modelserver.engines.context import check_inputs
from modelserver.engines.fake import (
    FakeStream,
    FakeTextGenerator,
    _Counters,
    _fake_load,
    fake_vector,
    inject_faults,
)
from modelserver.engines.media_base import (
    IMAGE_TAG,
    RerankResult,
    Segment,
    SpeechRequest,
    SpeechResult,
    TranscriptionRequest,
    TranscriptionResult,
    VisionRequest,
    Word,
)
from modelserver.errors import RequestError
from modelserver.spec import ModelSpec

__all__ = [
    "FakeReranker",
    "FakeSpeechSynthesizer",
    "FakeTranscriber",
    "FakeVisionGenerator",
    "load_reranker",
    "load_speech",
    "load_transcriber",
    "load_vlm",
]

SPEECH_RATE = 16_000
SECONDS_PER_CHAR = 0.06
SEGMENT_S = 5.0


class _FakeBase:
    def __init__(self, spec: ModelSpec) -> None:
        self._spec = spec
        self._counters = _Counters()

    def describe(self) -> dict[str, Any]:
        return {"engine": "fake", "task": self._spec.task}

    def stats(self) -> dict[str, Any]:
        return self._counters.as_dict()

    def close(self) -> None:
        pass

    async def _pause(self) -> None:
        await asyncio.sleep(self._spec.fake.token_delay_s)
        self._counters.completed += 1


class FakeReranker(_FakeBase):
    async def rerank(self, query: str, documents: Sequence[str], truncate: bool = False) -> RerankResult:
        inject_faults(query)
        pairs = [len(query.split()) + len(doc.split()) for doc in documents]
        check_inputs(pairs, self._spec.options.get("max_length"), "documents", truncate)
        await self._pause()
        dims = self._spec.fake.dims
        anchor = np.asarray(fake_vector(query, dims))
        scores = [(1.0 + float(anchor @ np.asarray(fake_vector(doc, dims)))) / 2.0 for doc in documents]
        ranking = sorted(enumerate(scores), key=lambda item: -item[1])
        tokens = len(query.split()) * len(documents) + sum(len(doc.split()) for doc in documents)
        return RerankResult(ranking=ranking, prompt_tokens=tokens)


class FakeTranscriber(_FakeBase):
    async def transcribe(self, request: TranscriptionRequest) -> TranscriptionResult:
        inject_faults(request.prompt or "")
        await self._pause()
        duration_s = len(request.samples) / 16_000
        text = f"fake transcription of {duration_s:.2f} seconds of audio"
        if request.on_text is not None:  # a streamed transcription hears it word by word
            for word in text.split():
                if request.on_text(" " + word):
                    break
                await asyncio.sleep(self._spec.fake.token_delay_s)
        count = max(1, math.ceil(duration_s / SEGMENT_S))
        segments = [
            Segment(i * SEGMENT_S, min((i + 1) * SEGMENT_S, duration_s), f" segment {i + 1}") for i in range(count)
        ] if request.segment_timestamps else []
        words = _even_words(text, duration_s) if request.word_timestamps else []
        return TranscriptionResult(text=text, language=request.language or "en", segments=segments, words=words)


def _even_words(text: str, duration_s: float) -> list[Word]:
    words = text.split()
    step = duration_s / len(words)
    return [Word(i * step, (i + 1) * step, word) for i, word in enumerate(words)]


class FakeSpeechSynthesizer(_FakeBase):
    def voices(self) -> list[str]:
        return sorted(str(name) for name in self._spec.options.get("voices", {}))

    async def synthesize(self, request: SpeechRequest) -> SpeechResult:
        inject_faults(request.text)
        known = self.voices()
        if known and request.voice not in known:
            raise RequestError(f"voice {request.voice!r} is not configured for this model (known: {', '.join(known)})",
                               param="voice")
        await self._pause()
        count = max(1, int(len(request.text) * SECONDS_PER_CHAR * SPEECH_RATE / request.speed))
        tone = 0.3 * np.sin(2 * np.pi * 440.0 * np.arange(count) / SPEECH_RATE)
        return SpeechResult(samples=tone.astype(np.float32), rate=SPEECH_RATE)


class FakeVisionGenerator(FakeTextGenerator):
    def prompt_tokens(self, request: VisionRequest | GenerationRequest) -> int:
        """The words of every turn (an image's tag is one)."""
        if isinstance(request, GenerationRequest):
            return super().prompt_tokens(request)
        return sum(len(turn.content.split()) for turn in request.messages)

    def generate(self, request: VisionRequest | GenerationRequest) -> FakeStream:
        if isinstance(request, GenerationRequest):
            return super().generate(request)
        images = request.images

        def describe(match: re.Match[str]) -> str:
            height, width = images[int(match.group(1))].shape[:2]
            return f" [image {width}x{height}] "

        text = IMAGE_TAG.sub(describe, request.last_user_text())
        inject_faults(text)
        return FakeStream(
            text.split(), self.prompt_tokens(request), request.sampling.max_tokens, self._spec.fake.token_delay_s,
            self._counters,
        )


def load_reranker(spec: ModelSpec) -> FakeReranker:
    _fake_load(spec)
    return FakeReranker(spec)


def load_transcriber(spec: ModelSpec) -> FakeTranscriber:
    _fake_load(spec)
    return FakeTranscriber(spec)


def load_speech(spec: ModelSpec) -> FakeSpeechSynthesizer:
    _fake_load(spec)
    return FakeSpeechSynthesizer(spec)


def load_vlm(spec: ModelSpec) -> FakeVisionGenerator:
    _fake_load(spec)
    return FakeVisionGenerator(spec)
