"""Audio in and out of the model server: uploads decoded to 16 kHz mono, speech encoded to a format.

Decoding and encoding go through libsndfile (``soundfile``), which reads and writes WAV,
FLAC, OGG (Vorbis and Opus) and MP3; resampling goes through ``soxr``. A file libsndfile
cannot read is a :class:`~modelserver.errors.RequestError` that says so, never a 500.

An upload is decoded block by block, down-mixed and resampled as it goes, and refused once it passes
:data:`MAX_AUDIO_S`: compressed silence is tiny (a 917 KB FLAC held ten hours and took the model
server to 5.6 GB while it was decoded whole), so the body limit alone bounds nothing.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from modelserver.errors import RequestError

__all__ = [
    "MAX_AUDIO_S",
    "MAX_SOURCE_RATE",
    "MIN_AUDIO_S",
    "SPEECH_FORMATS",
    "WHISPER_RATE",
    "DecodedAudio",
    "SpeechFormat",
    "decode_audio",
    "encode_audio",
]

log = logging.getLogger(__name__)

#: The sample rate Whisper-family models expect.
WHISPER_RATE = 16_000
#: The longest upload decoded (an hour: 230 MB of samples at 16 kHz); longer audio is a 400.
MAX_AUDIO_S = 3600
#: The shortest upload transcribed, as OpenAI (Whisper's feature extractor failed below 12.5 ms with a 500).
MIN_AUDIO_S = 0.1
#: The highest sample rate taken as audio (a header may claim any rate; 384 kHz is the highest studio rate).
MAX_SOURCE_RATE = 384_000
#: Samples (frames x channels) decoded at a time.
_BLOCK_SAMPLES = 1 << 18

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
    """``data`` (any format libsndfile reads) as float32 mono samples at ``rate``, at most :data:`MAX_AUDIO_S`."""
    if not data:
        raise RequestError("the uploaded audio file is empty", param="file")
    import soundfile  # imported at the first audio file (libsndfile, soxr: ~1 MiB a text model never needs)

    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            source_rate, source_format = f.samplerate, f.format
            mono = _read_mono(f, rate)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        detail = getattr(exc, "error_string", None) or str(exc)
        raise RequestError(
            f"could not decode the uploaded audio file ({detail}); send WAV, FLAC, OGG (Vorbis/Opus) or MP3",
            param="file",
        ) from None
    if mono.shape[0] == 0:
        raise RequestError("the uploaded audio file holds no samples", param="file")
    if mono.shape[0] < MIN_AUDIO_S * rate:
        raise RequestError(f"the uploaded audio is too short ({mono.shape[0] / rate:.3f} s); the shortest this server "
                           f"transcribes is {MIN_AUDIO_S} s", param="file")
    mono = np.clip(mono, -1.0, 1.0).astype(np.float32, copy=False)
    return DecodedAudio(samples=mono, rate=rate, source_rate=source_rate, source_format=source_format)


def _read_mono(f: Any, rate: int) -> np.ndarray:
    """The samples of the open SoundFile ``f``, down-mixed and resampled to ``rate`` block by block; a
    :class:`RequestError` as soon as they pass :data:`MAX_AUDIO_S` (or the header claims no audio rate)."""
    import soxr

    if not 1 <= f.samplerate <= MAX_SOURCE_RATE:
        raise RequestError(f"the uploaded audio file's sample rate ({f.samplerate} Hz) is not one of audio; "
                           f"at most {MAX_SOURCE_RATE} Hz", param="file")
    too_long = RequestError(f"the uploaded audio is longer than {MAX_AUDIO_S} s, the longest this server "
                            "transcribes in one request; send it in parts", param="file")
    if f.frames > MAX_AUDIO_S * f.samplerate:  # the header says so: nothing decoded
        raise too_long
    stream = soxr.ResampleStream(f.samplerate, rate, 1, dtype="float32", quality="HQ") if f.samplerate != rate else None
    pieces, read = [], 0
    for block in f.blocks(blocksize=max(1, _BLOCK_SAMPLES // f.channels), dtype="float32", always_2d=True):
        read += block.shape[0]
        if read > MAX_AUDIO_S * f.samplerate:
            raise too_long
        mono = block.mean(axis=1, dtype=np.float32) if block.shape[1] > 1 else block[:, 0]
        pieces.append(stream.resample_chunk(mono) if stream is not None else mono.copy())
    if stream is not None:
        pieces.append(stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)


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
