"""What Ollama's model endpoints say about a configured model: names, ``details``, ``/api/tags``,
``/api/show`` and ``/api/ps`` entries, and ``keep_alive`` as seconds.

The facts come from the model's files (:mod:`modelserver.modelinfo`: GGUF metadata or ``config.json``),
its configuration, the router's size figures and procman's idle timer; nothing here starts a model.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelserver.modelfiles import served_context
from modelserver.modelinfo import ModelInfo, model_info
from modelserver.spec import ModelSpec
from procman import State
from router.edge.errors import BadRequest

if TYPE_CHECKING:
    from router.state.registry import Model, Registry

__all__ = ["OLLAMA_TASKS", "keep_alive_s", "ollama_names", "ps_entry", "served", "show", "tags_entry"]

#: The tasks Ollama's API serves: chat and generate (llm, vlm), embed (embeddings).
OLLAMA_TASKS = ("llm", "vlm", "embeddings")
#: ``expires_at`` of a model kept loaded until the next change (Ollama shows a date centuries away).
FOREVER = "2318-01-01T00:00:00Z"
_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def served(spec: ModelSpec) -> bool:
    """Whether Ollama's API serves this model: a model server of task llm, vlm or embeddings."""
    return spec.launches_modelserver and spec.task in OLLAMA_TASKS


def ollama_names(spec: ModelSpec) -> list[str]:
    """The model's names as Ollama lists them: each name and alias, with ``:latest`` when it has no tag."""
    return [name if ":" in name else f"{name}:latest" for name in (spec.name, *spec.aliases)]


def keep_alive_s(value: Any) -> float | None:
    """Ollama's ``keep_alive`` as seconds: a number (seconds) or a Go duration (``"5m"``, ``"-1.0s"``,
    ``"1h30m"``); negative means forever (``inf``); None when absent. 400 naming the value otherwise."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise BadRequest(f"keep_alive: expected a duration like \"5m\" or a number of seconds, got {value}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _duration_s(value.strip())
    else:
        raise BadRequest(f"keep_alive: expected a duration like \"5m\" or a number of seconds, got {value!r}"[:200])
    if math.isnan(seconds):
        raise BadRequest("keep_alive: not a number")
    return math.inf if seconds < 0 else seconds


def _duration_s(text: str) -> float:
    sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.removeprefix("+"))
    try:
        return sign * float(body)  # a plain number is seconds
    except ValueError:
        pass
    parts = _DURATION.findall(body)
    if not parts or "".join(number + unit for number, unit in parts) != body:
        raise BadRequest(f'time: invalid duration "{text[:100]}" (keep_alive: use "5m", "1h", "-1" or seconds)')
    return sign * sum(float(number) * _UNIT_S[unit] for number, unit in parts)


def _iso(epoch_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(epoch_s)) + f".{int(epoch_s % 1 * 1e6):06d}Z"


def _modified(spec: ModelSpec, started_at: float) -> float:
    try:
        return Path(spec.path).stat().st_mtime if spec.path else started_at
    except OSError:
        return started_at


def _digest(spec: ModelSpec, modified: float) -> str:
    return hashlib.sha256(f"{spec.name}\0{spec.path}\0{modified}".encode()).hexdigest()


def details(spec: ModelSpec, info: ModelInfo) -> dict[str, Any]:
    family = info.architecture or ""
    return {"parent_model": "", "format": info.format, "family": family, "families": [family] if family else None,
            "parameter_size": info.parameter_size or "", "quantization_level": info.quantization or ""}


def tags_entry(model: Model, name: str, registry: Registry, started_at: float) -> dict[str, Any]:
    """One ``/api/tags`` entry: ``name`` and ``model`` alike, the size the router counts for it."""
    spec = model.spec
    info, modified = model_info(spec.path), _modified(spec, started_at)
    return {"name": name, "model": name, "modified_at": _iso(modified), "size": registry.residency.store
            .size_of(spec).bytes, "digest": _digest(spec, modified), "details": details(spec, info)}


def capabilities(spec: ModelSpec, info: ModelInfo) -> list[str]:
    if spec.task == "embeddings":
        return ["embedding"]
    found = ["completion"]
    if spec.tool_parser not in (None, "none") or (spec.tool_parser is None and info.template_takes_tools):
        found.append("tools")
    if spec.task == "vlm":
        found.append("vision")
    return found


def show(model: Model, started_at: float) -> dict[str, Any]:
    """``/api/show``: capabilities, ``model_info`` with the context length, the template, details."""
    spec = model.spec
    info = model_info(spec.path)
    arch = info.architecture or spec.task
    model_info_: dict[str, Any] = {"general.architecture": arch, "general.basename": info.basename or spec.name}
    if (context := served_context(spec)) is not None:
        model_info_[f"{arch}.context_length"] = context
    if info.embedding_length is not None:
        model_info_[f"{arch}.embedding_length"] = info.embedding_length
    parameters = f"num_ctx {context}" if context else ""
    return {"license": "", "modelfile": f"# served by ovrouter as model {spec.name!r}\nFROM {spec.path or spec.name}\n",
            "parameters": parameters, "template": info.template, "details": details(spec, info),
            "model_info": model_info_, "capabilities": capabilities(spec, info),
            "modified_at": _iso(_modified(spec, started_at))}


def ps_entry(model: Model, registry: Registry, started_at: float) -> dict[str, Any] | None:
    """A loaded model as ``/api/ps`` lists it; None when it is not loaded. ``expires_at``: the idle stop."""
    backend = model.backend
    if backend.state is not State.READY:
        return None
    entry = tags_entry(model, ollama_names(model.spec)[0], registry, started_at)
    in_s = backend.idle_stop_in_s()
    entry["expires_at"] = FOREVER if in_s is None else _iso(time.time() + in_s)
    entry["size_vram"] = 0 if model.spec.device.upper().startswith("CPU") else entry["size"]
    entry["context_length"] = served_context(model.spec)
    return entry
