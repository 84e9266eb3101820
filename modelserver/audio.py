"""Audio in and out of the model server: uploads decoded to 16 kHz mono, speech encoded to a format.

Decoding and encoding go through libsndfile (``soundfile``), which reads and writes WAV,
FLAC, OGG (Vorbis and Opus) and MP3; resampling goes through ``soxr``. A file libsndfile
cannot read is a :class:`~modelserver.errors.RequestError` that says so, never a 500.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from typing import Literal

import numpy as np

from modelserver.errors import RequestError

__all__ = ["SPEECH_FORMATS", "WHISPER_RATE", "DecodedAudio", "SpeechFormat", "decode_audio", "encode_audio"]

log = logging.getLogger(__name__)

#: The sample rate Whisper-family models expect.
WHISPER_RATE = 16_000

SpeechFormat = Literal["wav", "flac", "mp3", "opus", "pcm"]

#: response_format -> (libsndfile format, subtype, media type); ``pcm`` is raw 16-bit little-endian samples.
SPEECH_FORMATS: dict[str, tuple[str, str, str]] = {
    "wav": ("WAV", "PCM_16", "audio/wav"),
    "flac": ("FLAC", "PCM_16", "audio/flac"),
    "mp3": ("MP3", "MPEG_LAYER_III", "audio/mpeg"),
    "opus": ("OGG", "OPUS", "audio/ogg"),
    "pcm": ("RAW", "PCM_16", "audio/pcm"),
}

#: Rates libopus encodes; other rates are resampled to the next one up.
_OPUS_RATES = (8_000, 12_000, 16_000, 24_000, 48_000)


@dataclass(frozen=True, slots=True)
class DecodedAudio:
    samples: np.ndarray  # float32, mono, in [-1, 1]
    rate: int
    source_rate: int
    source_format: str

    @property
    def duration_s(self) -> float:
        return len(self.samples) / self.rate


def decode_audio(data: bytes, rate: int = WHISPER_RATE) -> DecodedAudio:
    """``data`` (any format libsndfile reads) as float32 mono samples at ``rate``."""
    if not data:
        raise RequestError("the uploaded audio file is empty", param="file")
    import soundfile  # imported at the first audio file (libsndfile, soxr: ~1 MiB a text model never needs)
    import soxr

    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            samples = f.read(dtype="float32", always_2d=True)
            source_rate, source_format = f.samplerate, f.format
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        detail = getattr(exc, "error_string", None) or str(exc)
        raise RequestError(
            f"could not decode the uploaded audio file ({detail}); send WAV, FLAC, OGG (Vorbis/Opus) or MP3",
            param="file",
        ) from None
    if samples.shape[0] == 0:
        raise RequestError("the uploaded audio file holds no samples", param="file")
    mono = samples.mean(axis=1) if samples.shape[1] > 1 else samples[:, 0]
    if source_rate != rate:
        mono = soxr.resample(mono, source_rate, rate, quality="HQ")
    mono = np.clip(mono, -1.0, 1.0).astype(np.float32, copy=False)
    return DecodedAudio(samples=mono, rate=rate, source_rate=source_rate, source_format=source_format)


def encode_audio(samples: np.ndarray, rate: int, response_format: str) -> tuple[bytes, str]:
    """Mono float samples as ``response_format`` bytes; returns ``(body, media_type)``."""
    if response_format not in SPEECH_FORMATS:
        known = ", ".join(SPEECH_FORMATS)
        raise RequestError(
            f"response_format {response_format!r} is not supported (use one of: {known})", param="response_format"
        )
    import soundfile
    import soxr

    container, subtype, media_type = SPEECH_FORMATS[response_format]
    samples = np.clip(np.asarray(samples, dtype=np.float32).reshape(-1), -1.0, 1.0)
    if response_format == "opus" and rate not in _OPUS_RATES:
        target = next((r for r in _OPUS_RATES if r >= rate), _OPUS_RATES[-1])
        samples, rate = soxr.resample(samples, rate, target).astype(np.float32), target
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=container, subtype=subtype, **_endian(container))
    return buffer.getvalue(), media_type


def _endian(container: str) -> dict[str, str]:
    return {"endian": "LITTLE"} if container == "RAW" else {}
