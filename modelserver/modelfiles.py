"""What a model's files declare, read without OpenVINO: GGUF metadata, ``config.json``, the served context.

Pure data like :mod:`modelserver.spec` (standard library only), so the router may import it
to describe a model it has not loaded: clients read ``/v1/models`` once at set-up, before
anything loads, and size their prompts by its ``max_model_len``. The model server's engines
read the same functions at load, so the two numbers come from one place.

Where a text model's context comes from (:func:`context_length`):

- a ``.gguf``: its metadata ``<general.architecture>.context_length`` (:func:`gguf_metadata`,
  a minimal reader of the GGUF key/value header; arrays such as the token table are skipped);
- an OpenVINO IR folder: ``config.json`` ``max_position_embeddings`` (``text_config`` /
  ``llm_config`` for a VLM's language model; ``n_positions`` / ``max_seq_len`` / ``seq_length``
  where a model names it so).

:func:`served_context` is the number the model server enforces for an ``llm``/``vlm`` model:
that one, lowered by ``options.context_length`` and, for a GGUF, by openvino_genai's
tokenizer cut (:data:`GGUF_TOKENIZER_CAP`; the server measures that cut at load, see
``modelserver.engines.context.truncation_cap``, and a test compares the two). Files are
read once per path, size and modification time.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from modelserver.spec import ModelSpec

__all__ = [
    "ENCODER_TYPES",
    "GGUF_TOKENIZER_CAP",
    "AttentionShape",
    "attention_shape",
    "config_json",
    "context_length",
    "gguf_context_length",
    "gguf_metadata",
    "json_file",
    "a_kind",
    "likely_task",
    "served_context",
]

log = logging.getLogger(__name__)

#: openvino_genai's tokenizer built from a GGUF stops at this many tokens, whatever ``max_length`` says.
GGUF_TOKENIZER_CAP = 8192
#: ``config.json`` keys that hold the context length, most common first.
CONFIG_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
#: Sections of ``config.json`` searched in order: the model's own, then a VLM's language model.
CONFIG_SECTIONS = (None, "text_config", "llm_config")


Reader = Callable[[Path], dict[str, Any]]


def served_context(spec: ModelSpec) -> int | None:
    """The context (prompt + completion, in tokens) the model server enforces for ``spec``; None when unknown.

    Known for ``llm``/``vlm`` models the built-in server runs (OpenVINO from their files, the fake
    engine from ``options.context_length``); a ``command:``/``url:`` backend or another task has none.
    """
    if spec.task not in ("llm", "vlm") or not spec.launches_modelserver:
        return None
    option = spec.options.get("context_length")
    option = option if isinstance(option, int) and not isinstance(option, bool) and option >= 1 else None
    model = context_length(Path(spec.path)) if spec.engine == "openvino" and spec.path else None
    if model is not None and _is_gguf(Path(spec.path or "")):
        model = min(model, GGUF_TOKENIZER_CAP)
    return min((n for n in (model, option) if n is not None), default=None)


def context_length(path: Path) -> int | None:
    """The context length ``path`` (a ``.gguf`` or an IR folder) declares; None when it declares none."""
    if _is_gguf(path):
        return gguf_context_length(path)
    data = config_json(path if path.is_dir() else path.parent)
    for section in (data.get(name) if name else data for name in CONFIG_SECTIONS):
        for key in CONFIG_KEYS:
            value = section.get(key) if isinstance(section, dict) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


AttentionShape = tuple[int, int, int]
"""``(layers, kv_heads, head_dim)`` of a decoder: what one token's KV cache entry is made of."""


def attention_shape(path: Path) -> AttentionShape | None:
    """The KV cache's shape per token that ``path`` (a ``.gguf`` or an IR folder) declares; None when unknown.

    GGUF: ``<arch>.block_count``, ``.attention.head_count_kv`` (else ``head_count``) and
    ``.attention.key_length`` (else ``embedding_length / head_count``); ``config.json``:
    ``num_hidden_layers``, ``num_key_value_heads`` (else ``num_attention_heads``) and ``head_dim``
    (else ``hidden_size / num_attention_heads``).
    """
    if _is_gguf(path):
        meta = gguf_metadata(path)
        arch = meta.get("general.architecture")
        values = {key: meta.get(f"{arch}.{name}") for key, name in (
            ("layers", "block_count"), ("kv_heads", "attention.head_count_kv"), ("heads", "attention.head_count"),
            ("head_dim", "attention.key_length"), ("hidden", "embedding_length"))}
    else:
        data = config_json(path if path.is_dir() else path.parent)
        values = {key: data.get(name) for key, name in (
            ("layers", "num_hidden_layers"), ("kv_heads", "num_key_value_heads"), ("heads", "num_attention_heads"),
            ("head_dim", "head_dim"), ("hidden", "hidden_size"))}
    number = {key: value for key, value in values.items()
              if isinstance(value, int) and not isinstance(value, bool) and value > 0}
    heads = number.get("heads")
    kv_heads = number.get("kv_heads", heads)
    head_dim = number.get("head_dim") or (number["hidden"] // heads if heads and "hidden" in number else None)
    layers = number.get("layers")
    return (layers, kv_heads, head_dim) if layers and kv_heads and head_dim else None


def gguf_context_length(path: Path) -> int | None:
    """``<arch>.context_length`` from a GGUF file's header; None when absent or unreadable."""
    metadata = gguf_metadata(path)
    found = metadata.get(f"{metadata.get('general.architecture')}.context_length")
    return found if isinstance(found, int) and not isinstance(found, bool) and found > 0 else None


def gguf_metadata(path: Path) -> dict[str, Any]:
    """A GGUF file's scalar and string metadata (``general.architecture``, ``<arch>.context_length``, ...);
    arrays are skipped (``None``). ``{}`` for a file that is not a readable GGUF (logged once)."""
    return dict(_by_stamp(_read_gguf, path))


def config_json(folder: Path) -> dict[str, Any]:
    """``folder/config.json`` as a mapping; ``{}`` when it is missing or not a JSON object."""
    return json_file(folder / "config.json")


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


def a_kind(task: str, evidence: str) -> str:
    """How a load failure and ``ovrouter check`` say what a folder is: "an embeddings model (config.json ...)"."""
    return f"{'an' if task[0] in 'aeiou' else 'a'} {task} model ({evidence})"


def json_file(path: Path) -> dict[str, Any]:
    """A JSON object file (``config.json``, ``tokenizer_config.json``) as a mapping; ``{}`` when it is missing or
    not a JSON object."""
    return dict(_by_stamp(_read_config, path))


def _is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf" and path.is_file()


def _by_stamp(reader: Reader, path: Path) -> dict[str, Any]:
    try:
        info = os.stat(path)
    except OSError:
        return {}
    result: dict[str, Any] = _cached(reader, str(path), info.st_size, info.st_mtime_ns)
    return result


@functools.lru_cache(maxsize=256)
def _cached(reader: Reader, path: str, size: int, mtime_ns: int) -> dict[str, Any]:
    result: dict[str, Any] = reader(Path(path))
    return result


def _read_config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# -- GGUF metadata --------------------------------------------------------------------------------

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _read_gguf(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return _read_header(f)
    except (OSError, ValueError, struct.error) as exc:
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
        values[key] = _value(f, kind)
    return values


def _string(f: IO[bytes], keep: bool = True) -> str:
    (size,) = struct.unpack("<Q", f.read(8))
    if size > 1 << 24:
        raise ValueError("implausible string length in the GGUF header")
    if not keep:
        f.seek(size, 1)
        return ""
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
        elif item == _STRING:
            for _ in range(size):
                _string(f, keep=False)
        else:
            for _ in range(size):
                _value(f, item)
        return None
    raise ValueError(f"unknown GGUF value type {kind}")
