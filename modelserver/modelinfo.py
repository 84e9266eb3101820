"""How a model describes itself to Ollama's clients, read without loading it: architecture, size label,
quantization, embedding length and chat template (stdlib only, like :mod:`modelserver.spec`: the router
imports it). The context length is :func:`modelserver.modelfiles.served_context`'s.

From a ``.gguf``: its metadata header (:func:`~modelserver.modelfiles.gguf_metadata`: ``general.*``,
``<arch>.*``, ``tokenizer.chat_template``). From an OpenVINO IR folder: ``config.json``
(``model_type``, ``hidden_size``) and the chat template in ``chat_template.jinja`` or
``tokenizer_config.json``. Results are cached by path and mtime.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelserver.modelfiles import config_json, gguf_metadata, json_file
from modelserver.tools import template_takes_tools

__all__ = ["ModelInfo", "model_info"]

#: GGUF ``general.file_type`` (llama.cpp's ``llama_ftype``) as Ollama shows it in ``quantization_level``.
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
              12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
              19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
              26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16"}


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What Ollama's ``details`` and ``model_info`` report; every field may be unknown."""

    format: str  # gguf | openvino
    architecture: str | None = None
    basename: str | None = None
    parameter_size: str | None = None  # "135M"
    quantization: str | None = None  # "Q4_1"
    embedding_length: int | None = None
    template: str = ""

    @property
    def template_takes_tools(self) -> bool:
        return template_takes_tools(self.template)


def model_info(path: str | None) -> ModelInfo:
    """The info of the model at ``path`` (a ``.gguf`` file or an IR folder); empty when unreadable."""
    if not path:
        return ModelInfo("openvino")
    target = Path(path)
    try:
        mtime = target.stat().st_mtime_ns
    except OSError:
        return ModelInfo("gguf" if target.suffix.lower() == ".gguf" else "openvino")
    return _cached(str(target), mtime)


@functools.lru_cache(maxsize=64)
def _cached(path: str, mtime_ns: int) -> ModelInfo:
    target = Path(path)
    if target.is_file() and target.suffix.lower() == ".gguf":
        return _from_gguf(target)
    return _from_folder(target if target.is_dir() else target.parent)


def _from_gguf(path: Path) -> ModelInfo:
    meta = gguf_metadata(path)
    arch = meta.get("general.architecture")
    arch = arch if isinstance(arch, str) else None
    file_type = meta.get("general.file_type")
    return ModelInfo(
        "gguf", arch, _text(meta.get("general.basename")) or _text(meta.get("general.name")),
        _text(meta.get("general.size_label")), FILE_TYPES.get(file_type) if isinstance(file_type, int) else None,
        _positive(meta.get(f"{arch}.embedding_length")),
        _text(meta.get("tokenizer.chat_template")) or "",
    )


def _from_folder(folder: Path) -> ModelInfo:
    config = config_json(folder)
    sections = [config, config.get("text_config") or {}, config.get("llm_config") or {}]
    hidden = next((_positive(s.get("hidden_size")) for s in sections if isinstance(s, dict)
                   if _positive(s.get("hidden_size"))), None)
    template = ""
    if (jinja := folder / "chat_template.jinja").is_file():
        template = jinja.read_text(encoding="utf-8", errors="replace")
    elif isinstance(found := json_file(folder / "tokenizer_config.json").get("chat_template"), str):
        template = found
    quant = "INT4" if "int4" in folder.name.lower() else "INT8" if "int8" in folder.name.lower() else None
    return ModelInfo("openvino", _text(config.get("model_type")), folder.name, None, quant, hidden, template)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
