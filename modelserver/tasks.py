"""THE one place that maps a task to its HTTP routes (``/health`` and ``/v1/models`` are always served).

Adding a task: write ``modelserver/api/<task>.py`` with a module-level ``routes`` list and
add one line here (and one in ``modelserver/engines/__init__.py`` for its engine).
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.routing import BaseRoute

from modelserver.api import audio, chat, embeddings, messages, ollama, rerank, responses, tokenize, vlm

__all__ = ["TASK_ROUTES", "routes_for"]

TASK_ROUTES: dict[str, Sequence[BaseRoute]] = {
    "llm": [*chat.routes, *tokenize.routes, *responses.routes, *messages.routes, *ollama.chat_routes],
    "embeddings": [*embeddings.routes, *ollama.embedding_routes],
    "rerank": rerank.routes,
    "transcription": audio.transcription_routes,
    "speech": audio.speech_routes,
    "vlm": [*vlm.routes, *tokenize.routes, *responses.routes, *messages.routes, *ollama.chat_routes],
}


def routes_for(task: str) -> list[BaseRoute]:
    return list(TASK_ROUTES.get(task, ()))
