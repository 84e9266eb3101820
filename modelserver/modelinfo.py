"""What a model's files say about it, read without loading it: architecture, size label, quantization,
context length and chat template (stdlib only, like :mod:`modelserver.spec`: the router imports it).

From a ``.gguf``: the scalar keys of its metadata header (``general.*``, ``<arch>.*``,
``tokenizer.chat_template``; arrays such as the token table are skipped). From an OpenVINO IR
folder: ``config.json`` (``model_type``, ``max_position_embeddings`` ...) and the chat template in
``chat_template.jinja`` or ``tokenizer_config.json``. Results are cached by path and mtime.
"""

from __future__ import annotations

import functools
import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from modelserver.tools import template_takes_tools

__all__ = ["ModelInfo", "gguf_metadata", "model_info"]

log = logging.getLogger(__name__)

#: GGUF ``general.file_type`` (llama.cpp's ``llama_ftype``) as Ollama shows it in ``quantization_level``.
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
              12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
              19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
              26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16"}
_CONFIG_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What Ollama's ``details`` and ``model_info`` report; every field may be unknown."""

    format: str  # gguf | openvino
    architecture: str | None = None
    basename: str | None = None
    parameter_size: str | None = None  # "135M"
    quantization: str | None = None  # "Q4_1"
    context_length: int | None = None  # the model's own (options.context_length may lower what is served)
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
        _positive(meta.get(f"{arch}.context_length")), _positive(meta.get(f"{arch}.embedding_length")),
        _text(meta.get("tokenizer.chat_template")) or "",
    )


def _from_folder(folder: Path) -> ModelInfo:
    config = _json(folder / "config.json")
    sections = [config, config.get("text_config") or {}, config.get("llm_config") or {}]
    context = next((_positive(s.get(k)) for s in sections if isinstance(s, dict) for k in _CONFIG_CONTEXT_KEYS
                    if _positive(s.get(k))), None)
    hidden = next((_positive(s.get("hidden_size")) for s in sections if isinstance(s, dict)
                   if _positive(s.get("hidden_size"))), None)
    template = ""
    if (jinja := folder / "chat_template.jinja").is_file():
        template = jinja.read_text(encoding="utf-8", errors="replace")
    elif isinstance(found := _json(folder / "tokenizer_config.json").get("chat_template"), str):
        template = found
    quant = "INT4" if "int4" in folder.name.lower() else "INT8" if "int8" in folder.name.lower() else None
    return ModelInfo("openvino", _text(config.get("model_type")), folder.name, None, quant, context, hidden, template)


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


# -- the GGUF header ----------------------------------------------------------------------------

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def gguf_metadata(path: Path) -> dict[str, Any]:
    """The scalar and string values of a GGUF file's key/value header (arrays skipped); {} when unreadable."""
    try:
        with path.open("rb") as f:
            return _read_header(f)
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
        log.warning("cannot read the GGUF metadata of %s: %s", path, exc)
        return {}


def _read_header(f: IO[bytes]) -> dict[str, Any]:
    if f.read(4) != b"GGUF":
        raise ValueError("not a GGUF file")
    (version,) = struct.unpack("<I", f.read(4))
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported")
    _tensors, count = struct.unpack("<QQ", f.read(16))
    values: dict[str, Any] = {}
    for _ in range(count):
        key = _string(f)
        (kind,) = struct.unpack("<I", f.read(4))
        value = _value(f, kind)
        if value is not None:
            values[key] = value
    return values


def _string(f: IO[bytes]) -> str:
    (size,) = struct.unpack("<Q", f.read(8))
    if size > 1 << 24:
        raise ValueError("implausible string length in the GGUF header")
    return f.read(size).decode("utf-8", errors="replace")


def _value(f: IO[bytes], kind: int) -> Any:
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        item, size = struct.unpack("<IQ", f.read(12))
        if item in _SCALARS:  # skipped, not read: token tables are large
            f.seek(struct.calcsize(_SCALARS[item]) * size, 1)
        else:
            for _ in range(size):
                _value(f, item)
        return None
    raise ValueError(f"unknown GGUF value type {kind}")
