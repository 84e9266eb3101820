"""Inputs and checks shared by the tests of the non-LLM tasks: audio files, images, error bodies."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import soundfile
from PIL import Image

__all__ = ["SPEECH_TEXT", "assert_error", "audio_file", "image_data_url", "speech_file", "sse_events", "tone"]

SPEECH = Path(__file__).resolve().parent / "data" / "espeak_john.flac"
SPEECH_TEXT = "Hello, my name is John. I like to eat apples and bananas."
FORMATS = {
    "wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16"), "ogg": ("OGG", "VORBIS"), "mp3": ("MP3", "MPEG_LAYER_III"),
}


def tone(seconds: float, rate: int, channels: int = 1, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    wave = (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32)
    return np.stack([wave] * channels, axis=1) if channels > 1 else wave


def encode(samples: np.ndarray, rate: int, fmt: str) -> bytes:
    """Samples as a WAV / FLAC / OGG / MP3 file (libsndfile writes all of them)."""
    container, subtype = FORMATS[fmt]
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=container, subtype=subtype)
    return buffer.getvalue()


def audio_file(fmt: str, seconds: float = 3.0, rate: int = 44_100, channels: int = 2) -> bytes:
    """A tone as a file of ``fmt``."""
    return encode(tone(seconds, rate, channels), rate, fmt)


def speech_file(fmt: str, repeat: int = 1, gap_s: float = 1.0) -> bytes:
    """:data:`SPEECH_TEXT` spoken (espeak-ng), ``repeat`` times with ``gap_s`` of silence between, as ``fmt``."""
    samples, rate = soundfile.read(SPEECH, dtype="float32")
    gap = np.zeros(int(gap_s * rate), np.float32)
    return encode(np.concatenate([part for _ in range(repeat) for part in (samples, gap)]), rate, fmt)


def image_data_url(width: int = 60, height: int = 40, fmt: str = "PNG", seed: int = 0) -> str:
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def sse_events(text: str) -> list[Any]:
    lines = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def assert_error(response: httpx.Response, status: int, *needles: str) -> dict[str, Any]:
    """A JSON error body of ``status`` whose message holds every needle."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    for needle in needles:
        assert needle in error["message"], error["message"]
    return dict(error)
