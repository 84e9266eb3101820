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
from typing import Any

from modelserver.errors import LoadError
from modelserver.modelfiles import config_json
from modelserver.spec import ModelSpec

__all__ = ["ENCODER_TYPES", "check_generative", "likely_task"]

#: ``config.json`` ``model_type`` of encoder-only families: they embed text, they cannot generate it.
ENCODER_TYPES = frozenset({
    "albert", "bert", "camembert", "deberta", "deberta-v2", "distilbert", "electra", "jina_bert", "mpnet",
    "modernbert", "nomic_bert", "roberta", "xlm-roberta",
})


def likely_task(config: dict[str, Any]) -> tuple[str, str] | None:
    """(the task a ``config.json`` says its model is for, the evidence) when that is not text generation."""
    raw = config.get("architectures")
    archs = [a for a in raw if isinstance(a, str)] if isinstance(raw, list) else []
    model_type = config.get("model_type")
    evidence = (f"config.json architectures: {', '.join(archs)}" if archs
                else f"config.json model_type: {model_type}")
    if any(a.endswith("ForSequenceClassification") for a in archs):
        return "rerank", evidence
    if model_type == "whisper" or any(a.startswith("Whisper") for a in archs):
        return "transcription", evidence
    if model_type in ("speecht5", "kokoro") or any(a.endswith("ForTextToSpeech") for a in archs):
        return "speech", evidence
    if model_type in ENCODER_TYPES and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return "embeddings", evidence
    return None


def check_generative(spec: ModelSpec, path: Path) -> None:
    """:class:`LoadError` naming the right task when ``path``'s ``config.json`` is not a text-generation model's."""
    if not path.is_dir():
        return
    found = likely_task(config_json(path))
    if found is None:
        return
    task, evidence = found
    raise LoadError(f"models.{spec.name}: {spec.path} looks like {'an' if task[0] in 'aeiou' else 'a'} {task} model "
                    f"({evidence}), not one for task: {spec.task}; set task: {task}")
