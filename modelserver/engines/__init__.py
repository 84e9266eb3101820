"""Engines by (engine, task), chosen in one place; OpenVINO modules are imported only when used.

To add a task, add one line to :data:`ENGINES` naming ``module:function``; the function
takes the :class:`~modelserver.spec.ModelSpec` and returns a loaded engine (blocking is
fine: it runs in the loader thread) or raises :class:`~modelserver.errors.LoadError`.
"""

from __future__ import annotations

import importlib
from typing import Any

from modelserver.errors import LoadError
from modelserver.spec import ModelSpec

__all__ = ["ENGINES", "make_engine"]

ENGINES: dict[tuple[str, str], str] = {
    ("openvino", "llm"): "modelserver.engines.llm:load",
    ("fake", "llm"): "modelserver.engines.fake:load_text_generator",
    ("fake", "embeddings"): "modelserver.engines.fake:load_embedder",
    ("openvino", "embeddings"): "modelserver.engines.embeddings:load",
    ("openvino", "rerank"): "modelserver.engines.rerank:load",
    ("openvino", "transcription"): "modelserver.engines.transcription:load",
    ("openvino", "speech"): "modelserver.engines.speech:load",
    ("openvino", "vlm"): "modelserver.engines.vlm:load",
    ("fake", "rerank"): "modelserver.engines.fake_media:load_reranker",
    ("fake", "transcription"): "modelserver.engines.fake_media:load_transcriber",
    ("fake", "speech"): "modelserver.engines.fake_media:load_speech",
    ("fake", "vlm"): "modelserver.engines.fake_media:load_vlm",
}


def make_engine(spec: ModelSpec) -> Any:
    """Load the engine that serves ``spec``; :class:`LoadError` when none does or it cannot load."""
    target = ENGINES.get((spec.engine, spec.task))
    if target is None:
        tasks = sorted(task for engine, task in ENGINES if engine == spec.engine)
        raise LoadError(f"engine {spec.engine!r} does not serve task {spec.task!r} (it serves: {', '.join(tasks)})")
    module_name, _, function = target.partition(":")
    loader = getattr(importlib.import_module(module_name), function)
    return loader(spec)
