"""``spec.options`` checked against what a task's engine understands: a typo fails the load, naming the key."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from modelserver.errors import LoadError
from modelserver.spec import ModelSpec

__all__ = ["ir_folder", "task_options"]

_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a mapping"}


def task_options(spec: ModelSpec, known: Mapping[str, type | tuple[type, ...]]) -> dict[str, Any]:
    """``spec.options`` after checking every key is in ``known`` and every value has that type."""
    options = dict(spec.options)
    for key, value in options.items():
        if key not in known:
            names = ", ".join(sorted(known)) or "none"
            raise LoadError(f"models.{spec.name}.options.{key}: unknown option for task {spec.task} (known: {names})")
        kind = known[key]
        expected: tuple[type, ...] = kind if isinstance(kind, tuple) else (kind,)
        if not _matches(value, expected):
            wanted = " or ".join(_NAMES.get(t, t.__name__) for t in expected)
            raise LoadError(f"models.{spec.name}.options.{key}: expected {wanted}, got {value!r}")
    return options


def _matches(value: Any, expected: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in expected
    if isinstance(value, int) and float in expected:
        return True
    return isinstance(value, expected)


def ir_folder(spec: ModelSpec, required: tuple[str, ...] = ("openvino_tokenizer.xml",)) -> Path:
    """The model's OpenVINO IR folder (the non-LLM tasks load exported folders only), with ``required`` files."""
    if not spec.path:
        raise LoadError("no model path given (`path`: an OpenVINO IR folder)")
    path = Path(spec.path)
    if not path.exists():
        raise LoadError(f"model path does not exist: {path}")
    if not path.is_dir():
        raise LoadError(f"model path is not a folder: {path} (task {spec.task} needs an exported OpenVINO IR folder)")
    missing = [name for name in required if not (path / name).is_file()]
    if missing:
        raise LoadError(f"{path} has no {', '.join(missing)}: export the model with optimum-cli export openvino")
    return path
