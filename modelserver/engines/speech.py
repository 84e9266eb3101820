"""Task ``speech`` on OpenVINO: ``openvino_genai.Text2SpeechPipeline`` (SpeechT5 + HiFi-GAN, Kokoro).

Long input is split into sentence-sized chunks that go to the pipeline in one batched
call, and the waveforms are joined, so text longer than the model's positions still
speaks. ``speed`` is honoured by Kokoro; SpeechT5 has no such control, so a speed other
than 1.0 is refused with a 400 rather than silently ignored.

``options`` (all optional): ``voices`` (voice name -> speaker-embedding file, float32
``.npy`` or raw ``.bin`` of the model's speaker-embedding shape; SpeechT5 has a built-in
default voice, Kokoro needs at least one), ``minlenratio``, ``maxlenratio``,
``threshold`` (SpeechT5 decoding), ``language`` (Kokoro G2P).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import openvino_genai as ov_genai
import soundfile  # noqa: F401 - modelserver.audio encodes with them at the first answer: imported with the engine
import soxr  # noqa: F401

from modelserver.engines.media_base import SerialWorker, SpeechRequest, SpeechResult
from modelserver.engines.ov_options import one_line, ov_properties
from modelserver.engines.task_options import ir_folder, task_options
from modelserver.errors import LoadError, RequestError, UnsupportedParameter
from modelserver.spec import ModelSpec

__all__ = ["OPTIONS", "OpenVINOSpeechSynthesizer", "load", "split_sentences"]

OPTIONS: dict[str, type | tuple[type, ...]] = {
    "voices": dict,
    "minlenratio": float,
    "maxlenratio": float,
    "threshold": float,
    "language": str,
}
GENERATION_OPTIONS = ("minlenratio", "maxlenratio", "threshold", "language")
MAX_CHUNK_CHARS = 300
_SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+")


def split_sentences(text: str, limit: int = MAX_CHUNK_CHARS) -> list[str]:
    """``text`` as chunks of whole sentences of at most ``limit`` characters (a longer sentence is cut at spaces)."""
    chunks: list[str] = []
    for sentence in _SENTENCE_END.split(" ".join(text.split())):
        while len(sentence) > limit:
            cut = sentence.rfind(" ", 0, limit)
            cut = cut if cut > 0 else limit
            chunks.append(sentence[:cut])
            sentence = sentence[cut:].strip()
        if chunks and len(chunks[-1]) + 1 + len(sentence) <= limit:
            chunks[-1] += " " + sentence
        elif sentence:
            chunks.append(sentence)
    return chunks


def load_voice(path: Path, shape: tuple[int, ...]) -> np.ndarray:
    data = np.load(path) if path.suffix == ".npy" else np.fromfile(path, dtype=np.float32)
    data = np.asarray(data, dtype=np.float32)
    if data.size != int(np.prod(shape)):
        raise LoadError(f"voice file {path} holds {data.size} values; this model's speaker embedding is {list(shape)}")
    return data.reshape(shape)


class OpenVINOSpeechSynthesizer:
    def __init__(
        self, spec: ModelSpec, pipe: Any, voices: dict[str, np.ndarray], options: dict[str, Any], load_s: float
    ) -> None:
        self._spec = spec
        self._pipe = pipe
        self._voices = voices
        self._kokoro = len(pipe.get_speaker_embedding_shape()) == 3
        self._generation = {key: options[key] for key in GENERATION_OPTIONS if key in options}
        self._load_s = load_s
        self._worker = SerialWorker(f"tts-{spec.name}")

    def describe(self) -> dict[str, Any]:
        return {
            "engine": "openvino Text2SpeechPipeline",
            "device": self._spec.device,
            "layout": "kokoro" if self._kokoro else "speecht5",
            "voices": ",".join(self.voices()),
            "load_s": round(self._load_s, 2),
        }

    def stats(self) -> dict[str, Any]:
        return self._worker.stats()

    def close(self) -> None:
        self._worker.close()

    def voices(self) -> list[str]:
        """Configured voices; none configured means every voice name speaks with the model's default."""
        return sorted(self._voices)

    async def synthesize(self, request: SpeechRequest) -> SpeechResult:
        embedding = self._voice(request.voice)
        kwargs = dict(self._generation)
        if request.speed != 1.0:
            if not self._kokoro:
                raise UnsupportedParameter("speed: this SpeechT5 model speaks at one speed; send speed 1.0",
                                           param="speed")
            kwargs["speed"] = request.speed
        return await self._worker.run(self._synthesize, split_sentences(request.text), embedding, kwargs)

    def _voice(self, name: str) -> np.ndarray | None:
        if not self._voices:
            return None
        if name not in self._voices:
            raise RequestError(f"voice {name!r} is not configured for this model (known: {', '.join(self.voices())})",
                               param="voice")
        return self._voices[name]

    def _synthesize(self, chunks: list[str], embedding: np.ndarray | None, kwargs: dict[str, Any]) -> SpeechResult:
        speaker = ov.Tensor(embedding) if embedding is not None else None
        result = self._pipe.generate(chunks, speaker, **kwargs)
        samples = np.concatenate([np.asarray(s.data, dtype=np.float32).reshape(-1) for s in result.speeches])
        return SpeechResult(samples=samples, rate=int(result.output_sample_rate))


def load(spec: ModelSpec) -> OpenVINOSpeechSynthesizer:
    started = time.monotonic()
    path = ir_folder(spec)
    options = task_options(spec, OPTIONS)
    try:
        pipe = ov_genai.Text2SpeechPipeline(str(path), spec.device, **ov_properties(spec))
    except Exception as exc:
        raise LoadError(one_line(exc)) from None
    shape = tuple(int(d) for d in pipe.get_speaker_embedding_shape())
    voices = {str(name): load_voice(_voice_path(spec, file), shape) for name, file in options.get("voices", {}).items()}
    if len(shape) == 3 and not voices:
        raise LoadError(f"models.{spec.name}.options.voices: a Kokoro model needs at least one voice file")
    return OpenVINOSpeechSynthesizer(spec, pipe, voices, options, time.monotonic() - started)


def _voice_path(spec: ModelSpec, file: Any) -> Path:
    path = Path(str(file)).expanduser()
    if not path.is_absolute() and spec.path:
        path = Path(spec.path) / path
    if not path.is_file():
        raise LoadError(f"models.{spec.name}.options.voices: no such voice file {path}")
    return path
