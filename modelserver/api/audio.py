"""``/v1/audio/transcriptions`` and ``/v1/audio/translations`` (task transcription), ``/v1/audio/speech`` (task speech).

Transcription takes OpenAI's multipart form: ``file`` (WAV, FLAC, OGG or MP3, decoded to
16 kHz mono), ``model``, ``language``, ``prompt``, ``temperature``, ``response_format``
(json, text, verbose_json, srt, vtt), ``timestamp_granularities[]`` (segment, word;
with verbose_json) and ``stream`` (json or text: :mod:`modelserver.api.audio_stream`).
Speech takes OpenAI's JSON: ``input``, ``voice``, ``response_format`` (wav, flac, mp3, opus,
pcm; aac is not available) and ``speed``; the answer is the audio file itself. Decoding and
encoding run off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import math
import zlib
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from modelserver.api.audio_stream import streamed_transcription
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
from modelserver.audio import SPEECH_FORMATS, decode_audio, encode_audio
from modelserver.engines.media_base import (
    Segment,
    SpeechRequest,
    SpeechSynthesizer,
    Transcriber,
    TranscriptionRequest,
    TranscriptionResult,
    Word,
)
from modelserver.errors import RequestError, UnsupportedParameter
from modelserver.protocol import parse_request

__all__ = ["SpeechBody", "TranscriptionForm", "render_transcription", "routes", "subtitles", "within"]

ResponseFormat = Literal["json", "text", "verbose_json", "srt", "vtt"]


class TranscriptionForm(BaseModel):
    """The form's text fields (form values are strings: numbers are parsed, not strict)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    language: str | None = Field(None, min_length=2)
    prompt: str | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    response_format: ResponseFormat = "json"
    timestamp_granularities: list[Literal["segment", "word"]] = Field(default_factory=list)
    stream: bool = False


class SpeechBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    input: str = Field(..., min_length=1, max_length=4096)
    voice: str = Field("default", min_length=1)
    response_format: str = "mp3"
    speed: float = Field(1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: str | None = None

    @field_validator("voice", mode="before")
    @classmethod
    def _voice_id(cls, value: Any) -> Any:
        return value.get("id") if isinstance(value, dict) else value  # {"id": "..."} as in the newer API

    @field_validator("speed", mode="before")
    @classmethod
    def _number(cls, value: Any) -> Any:
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


# -- transcription ------------------------------------------------------------------------------


async def _upload(form: FormData) -> bytes:
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise RequestError("file: required field is missing; send the audio as a multipart file field named `file`",
                           param="file")
    return await upload.read()


def _form_fields(form: FormData) -> TranscriptionForm:
    fields: dict[str, Any] = {k: v for k, v in form.multi_items() if isinstance(v, str) and not k.endswith("[]")}
    fields["timestamp_granularities"] = [
        *form.getlist("timestamp_granularities[]"), *form.getlist("timestamp_granularities")]
    return parse_request(json.dumps(fields).encode(), TranscriptionForm)


def _check(fields: TranscriptionForm) -> None:
    if fields.stream and fields.response_format not in ("json", "text"):
        raise UnsupportedParameter("stream: a streamed transcription is text events; send response_format "
                                   "json or text with it, or stream=false", param="stream")
    if fields.timestamp_granularities and fields.response_format != "verbose_json":
        raise RequestError("timestamp_granularities: needs response_format=verbose_json",
                           param="timestamp_granularities")


Task = Literal["transcribe", "translate"]


def _request_of(fields: TranscriptionForm, samples: Any, task: Task) -> TranscriptionRequest:
    granularities = set(fields.timestamp_granularities or ["segment"])
    verbose = fields.response_format == "verbose_json"
    return TranscriptionRequest(
        samples=samples,
        language=fields.language,
        task=task,
        prompt=fields.prompt,
        temperature=fields.temperature,
        segment_timestamps=fields.response_format in ("srt", "vtt") or (verbose and "segment" in granularities),
        word_timestamps=verbose and "word" in granularities,
    )


def _stamp(seconds: float, separator: str) -> str:
    millis = int(round(max(seconds, 0.0) * 1000))
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    return f"{hours:02d}:{minutes:02d}:{rest // 1000:02d}{separator}{rest % 1000:03d}"


def subtitles(segments: list[Segment], kind: Literal["srt", "vtt"]) -> str:
    separator = "," if kind == "srt" else "."
    cues = []
    for number, seg in enumerate(segments, start=1):
        timing = f"{_stamp(seg.start_s, separator)} --> {_stamp(seg.end_s, separator)}"
        cues.append(f"{number}\n{timing}\n{seg.text.strip()}\n" if kind == "srt" else f"{timing}\n{seg.text.strip()}\n")
    return ("WEBVTT\n\n" if kind == "vtt" else "") + "\n".join(cues)


def within(result: TranscriptionResult, duration_s: float) -> TranscriptionResult:
    """``result`` with every segment and word inside the audio: Whisper stamps in 20 ms steps of a 30 s window, so
    the last segment may end past the audio's last sample (a subtitle shown after the file ends)."""

    def clamp(start_s: float, end_s: float) -> tuple[float, float]:
        end = min(max(end_s, 0.0), duration_s)
        return min(max(start_s, 0.0), end), end

    return replace(result, segments=[Segment(*clamp(s.start_s, s.end_s), s.text) for s in result.segments],
                   words=[Word(*clamp(w.start_s, w.end_s), w.word) for w in result.words])


def _segment(index: int, segment: Segment, temperature: float) -> dict[str, Any]:
    """One ``verbose_json`` segment with every field OpenAI's ``TranscriptionSegment`` requires: the
    pipeline reports no token ids, log probabilities or no-speech probability, so ``tokens`` is empty and
    ``avg_logprob`` / ``no_speech_prob`` are 0.0 (the values a client's quality filters pass);
    ``compression_ratio`` is Whisper's own measure of the text (bytes over zlib-compressed bytes)."""
    raw = segment.text.encode()
    ratio = len(raw) / len(zlib.compress(raw)) if raw else 0.0
    return {"id": index, "seek": 0, "start": segment.start_s, "end": segment.end_s, "text": segment.text,
            "tokens": [], "temperature": temperature, "avg_logprob": 0.0, "compression_ratio": round(ratio, 4),
            "no_speech_prob": 0.0}


def render_transcription(result: TranscriptionResult, fields: TranscriptionForm, task: str, duration_s: float,
                         ) -> Response:
    fmt = fields.response_format
    result = within(result, duration_s)
    if fmt == "text":
        return PlainTextResponse(result.text.strip() + "\n")
    if fmt in ("srt", "vtt"):
        media_type = "text/plain" if fmt == "srt" else "text/vtt"
        return PlainTextResponse(subtitles(result.segments, fmt), media_type=media_type)
    usage = {"type": "duration", "seconds": math.ceil(duration_s)}
    if fmt == "json":
        return JSONResponse({"text": result.text.strip(), "usage": usage})
    body: dict[str, Any] = {"task": task, "language": result.language, "duration": round(duration_s, 3),
                            "text": result.text.strip(), "usage": usage}
    if result.segments or "segment" in (fields.timestamp_granularities or ["segment"]):
        body["segments"] = [_segment(i, s, fields.temperature or 0.0) for i, s in enumerate(result.segments)]
    if "word" in fields.timestamp_granularities:
        body["words"] = [{"word": w.word.strip(), "start": w.start_s, "end": w.end_s} for w in result.words]
    return JSONResponse(body)


async def _transcription(request: Request, task: Task) -> Response:
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise RequestError("send multipart/form-data with the audio in a `file` field (as the OpenAI SDK does)")
    try:
        async with request.form(max_part_size=spec(request).max_request_bytes) as form:
            fields, data = _form_fields(form), await _upload(form)
    except HTTPException as exc:
        raise RequestError(f"the multipart body could not be read: {exc.detail}") from None
    _check(fields)
    transcriber = engine_as(request, Transcriber)
    audio = await asyncio.to_thread(decode_audio, data)
    note(request, audio_s=round(audio.duration_s, 2), format=audio.source_format)
    if fields.stream:
        return await streamed_transcription(request, transcriber, _request_of(fields, audio.samples, task))
    try:
        with engine_errors(runtime(request)):
            result = await until_disconnect(request, transcriber.transcribe(_request_of(fields, audio.samples, task)))
    except ClientGone:
        note(request, finish="cancelled")
        return Response(status_code=499)
    return render_transcription(result, fields, task, audio.duration_s)


async def transcriptions(request: Request) -> Response:
    return await _transcription(request, "transcribe")


async def translations(request: Request) -> Response:
    return await _transcription(request, "translate")


# -- speech -------------------------------------------------------------------------------------


async def speech(request: Request) -> Response:
    body = await read_body(request, SpeechBody)
    if body.stream_format == "sse":
        raise UnsupportedParameter("stream_format: sse is not supported; send stream_format=audio",
                                   param="stream_format")
    if body.response_format not in SPEECH_FORMATS:
        raise RequestError(f"response_format {body.response_format!r} is not supported "
                           f"(use one of: {', '.join(SPEECH_FORMATS)})", param="response_format")
    synthesizer = engine_as(request, SpeechSynthesizer)
    try:
        with engine_errors(runtime(request)):
            result = await until_disconnect(
                request, synthesizer.synthesize(SpeechRequest(body.input, body.voice, body.speed)))
    except ClientGone:
        note(request, finish="cancelled")
        return Response(status_code=499)
    audio, media_type = await asyncio.to_thread(encode_audio, result.samples, result.rate, body.response_format)
    note(request, audio_s=round(len(result.samples) / result.rate, 2), format=body.response_format)
    headers = {"X-Sample-Rate": str(result.rate)}
    return Response(audio, media_type=media_type, headers=headers)


transcription_routes = [
    Route("/v1/audio/transcriptions", transcriptions, methods=["POST"]),
    Route("/v1/audio/translations", translations, methods=["POST"]),
]
speech_routes = [Route("/v1/audio/speech", speech, methods=["POST"])]
routes = [*transcription_routes, *speech_routes]
