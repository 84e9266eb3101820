"""A streamed transcription (``stream=true``): OpenAI's ``transcript.text.delta`` events as the model
decodes, then one ``transcript.text.done`` with the whole text.

The engine calls ``on_text`` on its own thread with each piece of text; the pieces reach the event
loop through a queue, in order, followed by the end of the transcription. The response starts
once the first piece (or the end) is there, so a request the engine refuses at its start (an
unknown ``language``) is still an ordinary error answer; an engine error later is one ``error``
event. A client that goes away stops the decoding at its next piece.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import replace

from starlette.requests import Request
from starlette.responses import Response

from modelserver.api.common import SSEResponse, engine_errors, note, runtime, sse
from modelserver.engines.media_base import Transcriber, TranscriptionRequest, TranscriptionResult
from modelserver.errors import ModelServerError, error_body

__all__ = ["streamed_transcription"]


class _Pieces:
    """What the engine's thread hands over: text pieces, then None once the transcription has ended."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[str | None] = asyncio.Queue()
        self.gone = threading.Event()
        self._loop = asyncio.get_running_loop()

    def on_text(self, text: str) -> bool:
        self._loop.call_soon_threadsafe(self.queue.put_nowait, text)
        return self.gone.is_set()

    def ended(self, _: object) -> None:
        self._loop.call_soon_threadsafe(self.queue.put_nowait, None)  # after every piece already scheduled


async def streamed_transcription(request: Request, transcriber: Transcriber, job: TranscriptionRequest) -> Response:
    pieces = _Pieces()
    task = asyncio.ensure_future(transcriber.transcribe(replace(job, on_text=pieces.on_text)))
    task.add_done_callback(pieces.ended)
    first = await pieces.queue.get()
    if first is None:
        with engine_errors(runtime(request)):
            task.result()  # a refusal at the start is an error answer, not a stream

    async def close() -> None:
        pieces.gone.set()
        if not task.done():
            note(request, finish="cancelled")
        await asyncio.gather(task, return_exceptions=True)

    return SSEResponse(_events(request, first, pieces, task), close)


async def _events(request: Request, first: str | None, pieces: _Pieces,
                  task: asyncio.Future[TranscriptionResult]) -> AsyncIterator[bytes]:
    piece = first
    while piece is not None:
        yield sse({"type": "transcript.text.delta", "delta": piece})
        piece = await pieces.queue.get()
    try:
        with engine_errors(runtime(request)):
            result = task.result()
    except ModelServerError as exc:
        note(request, error=exc.code)
        yield sse(error_body(exc))
        return
    yield sse({"type": "transcript.text.done", "text": result.text.strip()})
