"""Task ``transcription`` on OpenVINO: ``openvino_genai.WhisperPipeline``.

Audio arrives decoded (16 kHz mono float32, :mod:`modelserver.audio`); long audio is
handled by the pipeline's own 30-second windows. ``language`` is checked against the
model's ``lang_to_id`` (an English-only model accepts only ``en``), so a typo is a 400
rather than an engine error.

``options`` (all optional): ``word_timestamps`` (build the pipeline able to return word
timings, needed for ``timestamp_granularities=["word"]``; unset, the pipeline is built with them
and, if openvino_genai refuses that for the model or device, without: ``false`` never asks),
``max_new_tokens``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import openvino_genai as ov_genai
import soundfile  # noqa: F401 - modelserver.audio decodes with them at the first upload: imported with the engine
import soxr  # noqa: F401

from modelserver.engines.media_base import (
    Segment,
    SerialWorker,
    TranscriptionRequest,
    TranscriptionResult,
    Word,
)
from modelserver.engines.ov_options import one_line, ov_properties
from modelserver.engines.task_options import ir_folder, task_options
from modelserver.errors import LoadError, RequestError, UnsupportedParameter
from modelserver.spec import ModelSpec

__all__ = ["OPTIONS", "OpenVINOTranscriber", "load"]

OPTIONS: dict[str, type | tuple[type, ...]] = {"word_timestamps": bool, "max_new_tokens": int}

log = logging.getLogger(__name__)


class Languages:
    """What ``generation_config.json`` says the model can be asked for."""

    def __init__(self, generation_config: dict[str, Any]) -> None:
        self.multilingual = bool(generation_config.get("is_multilingual", False))
        self.codes = sorted(token.strip("<|>") for token in generation_config.get("lang_to_id", {}))

    def token(self, language: str | None, task: str) -> str | None:
        """The ``<|xx|>`` token for ``language``; :class:`RequestError` for one the model does not know."""
        if not self.multilingual:
            if task == "translate":
                raise UnsupportedParameter("this model is English-only: it cannot translate", param="model")
            if language not in (None, "en"):
                raise RequestError(f"language {language!r}: this model is English-only (send en or no language)",
                                   param="language")
            return None
        if language is None:
            return None
        code = language.strip("<|>").lower()
        if code not in self.codes:
            raise RequestError(f"language {language!r} is not one this model knows (ISO-639-1 codes such as "
                               f"{', '.join(self.codes[:8])}...)", param="language")
        return f"<|{code}|>"


class OpenVINOTranscriber:
    def __init__(self, spec: ModelSpec, pipe: Any, languages: Languages, options: dict[str, Any], load_s: float):
        self._spec = spec
        self._pipe = pipe
        self._languages = languages
        self._options = options
        self._load_s = load_s
        self._worker = SerialWorker(f"whisper-{spec.name}")

    def describe(self) -> dict[str, Any]:
        return {
            "engine": "openvino WhisperPipeline",
            "device": self._spec.device,
            "multilingual": self._languages.multilingual,
            "word_timestamps": bool(self._options.get("word_timestamps")),
            "load_s": round(self._load_s, 2),
        }

    def stats(self) -> dict[str, Any]:
        return self._worker.stats()

    def close(self) -> None:
        self._worker.close()

    async def transcribe(self, request: TranscriptionRequest) -> TranscriptionResult:
        kwargs = self._generation_kwargs(request)
        return await self._worker.run(self._transcribe, request, kwargs)

    def _generation_kwargs(self, request: TranscriptionRequest) -> dict[str, Any]:
        if request.word_timestamps and not self._options.get("word_timestamps"):
            raise UnsupportedParameter(
                "timestamp_granularities: word timings are off for this model (options.word_timestamps: false "
                "in its config, or its pipeline could not give them: see the model's log)",
                param="timestamp_granularities")
        kwargs: dict[str, Any] = {"return_timestamps": request.segment_timestamps}
        language = self._languages.token(request.language, request.task)
        if language is not None:
            kwargs["language"] = language
        if self._languages.multilingual:  # an English-only model refuses any task, even "transcribe"
            kwargs["task"] = request.task
        if request.prompt:
            kwargs["initial_prompt"] = request.prompt
        if request.word_timestamps:
            kwargs["word_timestamps"] = True
        if request.temperature:
            kwargs.update(do_sample=True, temperature=request.temperature)
        if "max_new_tokens" in self._options:
            kwargs["max_new_tokens"] = self._options["max_new_tokens"]
        if (on_text := request.on_text) is not None:
            kwargs["streamer"] = lambda text: (ov_genai.StreamingStatus.CANCEL if on_text(text)
                                               else ov_genai.StreamingStatus.RUNNING)
        return kwargs

    def _transcribe(self, request: TranscriptionRequest, kwargs: dict[str, Any]) -> TranscriptionResult:
        result = self._pipe.generate(request.samples, **kwargs)
        segments = [Segment(float(c.start_ts), float(c.end_ts), str(c.text)) for c in (result.chunks or [])]
        words = [Word(float(w.start_ts), float(w.end_ts), str(w.word)) for w in (result.words or [])]
        language = str(result.language).strip("<|>") or None
        return TranscriptionResult(text=str(result.texts[0]), language=language, segments=segments, words=words)


def load(spec: ModelSpec) -> OpenVINOTranscriber:
    started = time.monotonic()
    path = ir_folder(spec, ("openvino_encoder_model.xml", "openvino_decoder_model.xml", "openvino_tokenizer.xml"))
    options = task_options(spec, OPTIONS)
    pipe, words = _pipeline(path, spec, ov_properties(spec), options.get("word_timestamps"))
    languages = Languages(_generation_config(path))
    return OpenVINOTranscriber(spec, pipe, languages, {**options, "word_timestamps": words},
                               time.monotonic() - started)


def _pipeline(path: Path, spec: ModelSpec, properties: dict[str, Any], words: bool | None) -> tuple[Any, bool]:
    """The pipeline, and whether it gives word timings: asked for unless ``words`` is False (OpenAI's
    whisper-1 always can); unset, a pipeline that cannot be built with them is built without."""
    if words is not False:
        try:
            return ov_genai.WhisperPipeline(str(path), spec.device, **properties, word_timestamps=True), True
        except Exception as exc:
            if words:
                raise LoadError(one_line(exc)) from None
            log.warning("%s: no word timings (openvino_genai refused word_timestamps: %s); loading without",
                        spec.name, one_line(exc))
    try:
        return ov_genai.WhisperPipeline(str(path), spec.device, **properties), False
    except Exception as exc:
        raise LoadError(one_line(exc)) from None


def _generation_config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads((path / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise LoadError(f"{path}/generation_config.json is missing or unreadable: {exc}") from None
    return data if isinstance(data, dict) else {}
