"""A folder loaded under a text-generation task (``llm``, ``vlm``) that its ``config.json`` says is no such model.

Configs get copied between models (llama-swap, Ollama), so an embeddings or rerank folder often lands under
``task: llm``; it then loads, and every completion fails with an OpenVINO message that names no cause. This
check fails the load instead, naming the task to set. It reads only ``config.json`` and speaks only when the
file is certain: a ``*ForSequenceClassification`` head (rerank), an encoder-only family (embeddings), Whisper
(transcription), a text-to-speech model (speech). A folder without ``config.json`` (a GGUF, or the IR converted
from one) passes: the file layout alone is not reliable (encoders ship a detokenizer too, and many LLM folders
have no ``generation_config.json``).
"""

from __future__ import annotations

from pathlib import Path

from modelserver.errors import LoadError
from modelserver.modelfiles import ENCODER_TYPES, a_kind, config_json, likely_task
from modelserver.spec import ModelSpec

__all__ = ["ENCODER_TYPES", "check_generative", "likely_task"]  # the first and last: modelserver.modelfiles

def check_generative(spec: ModelSpec, path: Path) -> None:
    """:class:`LoadError` naming the right task when ``path``'s ``config.json`` is not a text-generation model's."""
    if not path.is_dir():
        return
    found = likely_task(config_json(path))
    if found is None:
        return
    task, evidence = found
    raise LoadError(f"models.{spec.name}: {spec.path} looks like {a_kind(task, evidence)}, not one for task: "
                    f"{spec.task}; set task: {task}")
