"""Pooling, normalization and length a sentence-transformers model declares in its folder.

sentence-transformers saves its pipeline beside the weights: ``modules.json`` lists the
modules in order (``...models.Pooling`` with its ``path``, e.g. ``1_Pooling``, whose
``config.json`` sets one ``pooling_mode_*`` flag; ``...models.Normalize`` when vectors are
L2-normalized), and ``sentence_bert_config.json`` holds ``max_seq_length``. The model card
it writes (``README.md``) tags the losses a model was trained with; a ``loss:Matryoshka...``
tag (MatryoshkaLoss, Matryoshka2dLoss) declares ``matryoshka: true`` (a prefix of each vector
is itself an embedding, so ``dimensions`` may shorten it). An exported OpenVINO folder keeps
these files when the export copies them (``make test-models`` does).

:func:`declared_options` turns them into embeddings ``options``; the model's own options
win key by key. A pooling mode the pipeline cannot do (max, mean_sqrt_len, weightedmean) is
a :class:`LoadError` unless ``pooling`` is set explicitly: serving such a model with another
pooling would answer silently wrong vectors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from modelserver.errors import LoadError

__all__ = ["declared_options"]

#: ``1_Pooling/config.json`` flag -> the embeddings ``pooling`` option.
POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last_token",
}
UNSUPPORTED_FLAGS = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
POOLING = "sentence_transformers.models.Pooling"
NORMALIZE = "sentence_transformers.models.Normalize"


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise LoadError(f"{path}: not readable JSON ({exc})") from None


def declared_options(folder: Path, explicit: dict[str, Any]) -> dict[str, Any]:
    """Options the folder's sentence-transformers files declare (``{}`` without ``modules.json``)."""
    modules = _read(folder / "modules.json")
    if not isinstance(modules, list):
        return {}
    types = {str(m.get("type", "")): m for m in modules if isinstance(m, dict)}
    declared: dict[str, Any] = {"normalize": NORMALIZE in types}
    if POOLING in types and "pooling" not in explicit:
        declared["pooling"] = _pooling(folder / str(types[POOLING].get("path", "")) / "config.json")
    bert = _read(folder / "sentence_bert_config.json")
    if isinstance(bert, dict) and isinstance(bert.get("max_seq_length"), int):
        declared["max_length"] = bert["max_seq_length"]
    if _trained_matryoshka(folder / "README.md"):
        declared["matryoshka"] = True
    return declared


def _trained_matryoshka(card: Path) -> bool:
    """Whether the model card's front matter tags a Matryoshka loss (``loss:MatryoshkaLoss``)."""
    try:
        text = card.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    if not text.startswith("---"):
        return False
    try:
        front = yaml.safe_load(text[3:].split("\n---", 1)[0])
    except yaml.YAMLError:
        return False
    tags = front.get("tags") if isinstance(front, dict) else None
    return isinstance(tags, list) and any(str(tag).lower().startswith("loss:matryoshka") for tag in tags)


def _pooling(config_path: Path) -> str:
    config = _read(config_path)
    if not isinstance(config, dict):
        raise LoadError(f"{config_path} is missing; set options.pooling (cls | mean | last_token)")
    for flag in UNSUPPORTED_FLAGS:
        if config.get(flag):
            raise LoadError(f"{config_path} asks for {flag}, which the pipeline cannot do; "
                            "set options.pooling (cls | mean | last_token) to serve it anyway")
    chosen = [name for flag, name in POOLING_FLAGS.items() if config.get(flag)]
    if len(chosen) != 1:
        raise LoadError(f"{config_path}: expected one pooling mode, found {chosen or 'none'}; set options.pooling")
    return chosen[0]
