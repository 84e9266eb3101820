"""What a ModelSpec means to OpenVINO, shared by the OpenVINO engines of every task.

- :func:`ov_properties`: ``ov_config`` passed through, plus ``CACHE_DIR`` = ``cache_dir`` (created),
  over the JSON object in ``$OVROUTER_OV_CONFIG`` (properties for every model of this machine, e.g.
  ``{"INFERENCE_PRECISION_HINT": "f32"}``; a model's own ``ov_config`` wins); the inference precision
  in effect is logged at load;
- :func:`scheduler_config`: ``scheduler`` fields set on a ``SchedulerConfig`` (an unknown field fails the load);
- :func:`prepare_source`: the path to load, converting a ``.gguf`` to OpenVINO IR once under
  ``state_dir/converted/<name>/`` when ``save_ov_model`` is set (openvino_genai's
  ``enable_save_ov_model`` writes ``openvino_model.xml/.bin`` next to the ``.gguf`` it loads, so the
  conversion loads a link to the ``.gguf`` placed in that folder). The converting load builds the
  tokenizer from that link with the same property, which writes ``openvino_tokenizer.xml`` and
  ``openvino_detokenizer.xml`` beside the model; later starts load the folder with its own
  tokenizer (0.2 s instead of 3 s to rebuild it from the ``.gguf``). A folder that lacks any
  of these files, or whose stamp names another ``.gguf``, is converted again;
- :func:`one_line`: an OpenVINO exception as one readable line for the ``failed to load`` log;
- :data:`COUNTING_TOKENIZER`: the properties of a tokenizer that only counts a request's tokens.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelserver.engines.context import Count, remembered_cap, tokenizer_files
from modelserver.errors import LoadError
from modelserver.spec import DEFAULT_STATE_DIR, ModelSpec

__all__ = [
    "COUNTING_TOKENIZER",
    "ModelSource",
    "converted_dir",
    "finish_conversion",
    "one_line",
    "ov_properties",
    "prepare_source",
    "remembered",
    "scheduler_config",
]

log = logging.getLogger(__name__)

IR_XML = "openvino_model.xml"
TOKENIZER_XMLS = ("openvino_tokenizer.xml", "openvino_detokenizer.xml")
STAMP = "source.json"


OV_CONFIG_ENV = "OVROUTER_OV_CONFIG"

#: A tokenizer that counts a request's tokens (the context check and ``usage`` of embeddings and rerank) runs
#: its small graph on one thread: the CPU plugin's default thread pool costs more than the work for a request's
#: few texts (all-MiniLM-L6-v2, one short text: ~0.35 ms of CPU instead of ~0.85 ms, a quarter of the
#: embedding itself; 64 texts of 2 kB: the same CPU either way).
COUNTING_TOKENIZER: dict[str, Any] = {"INFERENCE_NUM_THREADS": 1}


def ov_properties(spec: ModelSpec) -> dict[str, Any]:
    properties = {**_machine_properties(), **spec.ov_config}
    if spec.cache_dir and "CACHE_DIR" not in properties and _cache_imports(spec):
        Path(spec.cache_dir).mkdir(parents=True, exist_ok=True)
        properties["CACHE_DIR"] = spec.cache_dir
    _log_precision(spec.device, properties)
    return properties


def _machine_properties() -> dict[str, Any]:
    raw = os.environ.get(OV_CONFIG_ENV, "").strip()
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise LoadError(f"${OV_CONFIG_ENV}: not a JSON object ({exc})") from None
    if not isinstance(value, dict):
        raise LoadError(f"${OV_CONFIG_ENV}: expected a JSON object of OpenVINO properties, got {raw!r}")
    return value


def _log_precision(device: str, properties: dict[str, Any]) -> None:
    """Which numerics this load runs with: the CPU plugin defaults to bf16 where the CPU has it."""
    if "INFERENCE_PRECISION_HINT" in properties:
        log.info("inference precision on %s: %s (configured)", device, properties["INFERENCE_PRECISION_HINT"])
        return
    try:
        import openvino as ov

        default = ov.Core().get_property(device, "INFERENCE_PRECISION_HINT")
    except Exception:  # noqa: BLE001 - a device without the property (NPU, AUTO:...) or none here: nothing to say
        return
    name = default.get_type_name() if hasattr(default, "get_type_name") else default
    log.info("inference precision on %s: %s (device default)", device, name)


#: Tasks whose pipeline on CPU writes a blob that openvino 2026.4's CPU plugin cannot import (see _cache_imports).
NO_CPU_CACHE = frozenset({"llm", "transcription"})


def _cache_imports(spec: ModelSpec) -> bool:
    """Whether a compiled-model cache can be imported again for this pipeline.

    Not on CPU for (an ``ov_config`` ``CACHE_DIR`` still wins):

    - ``llm``: its ContinuousBatchingPipeline compiles a PagedAttention model, and openvino
      2026.4's CPU plugin cannot import that blob (``Runtime info k_head_size and num_k_heads
      are required``), so each start recompiled anyway, after hashing the model, and rewrote a
      ~135 MB blob (~0.5 s of CPU per start for the demo model); its first answers' stateful
      pipeline (``engines/llm_first.py``) takes the cache folder itself;
    - ``transcription``: the WhisperPipeline's stateful decoder (its cross-attention state read
      from the encoder's output) fails to import (``Converting input model vector::_M_range_check``,
      plain ``Core.import_model`` of its exported blob too), so every start rewrote it (113 MiB
      for whisper tiny.en) while only the encoder's (32 MiB) was imported: measured per load,
      warm cache against none (medians of 5 fresh processes, ``tools/cache_kinds.py``), 5.5 s
      against 0.93 s of wall time and 0.57 s against 0.49 s of CPU at load 5, 0.47-0.57 s against
      0.36-0.53 s and 0.49 s against 0.43-0.45 s of CPU in a second run at load 4: never a gain.

    Where the other kinds stand (the same runs): embeddings and rerank import their one blob
    (0.25 against 0.32 s and 0.19 against 0.24 s of CPU); speech imports three of its four (the
    decoder's 0.9 MiB is rewritten; 0.28 against 0.36 s); vlm imports all three with the
    stateful language model it gets on CPU (``engines/vlm.py`` ``CPU_PROPERTIES``).
    """
    return not (spec.task in NO_CPU_CACHE and spec.device.upper().startswith("CPU"))


def scheduler_config(fields: dict[str, Any]) -> Any:
    import openvino_genai as ov_genai

    config = ov_genai.SchedulerConfig()
    known = sorted(name for name in dir(config) if not name.startswith("_") and not callable(getattr(config, name)))
    for key, value in fields.items():
        if key not in known:
            raise LoadError(f"scheduler.{key}: not a SchedulerConfig field (known: {', '.join(known)})")
        expected = type(getattr(config, key)).__name__
        try:
            setattr(config, key, value)
        except (TypeError, ValueError):
            raise LoadError(f"scheduler.{key}: expected {expected}, got {value!r}") from None
    return config


@dataclass(frozen=True, slots=True)
class ModelSource:
    """What to hand the pipeline: ``path``; ``tokenizer_path`` when the tokenizer is built apart."""

    path: Path
    tokenizer_path: Path | None = None
    convert_into: Path | None = None  # set when this load writes a fresh IR there
    original: Path | None = None  # the .gguf a converted IR came from

    @property
    def kind(self) -> str:
        if self.convert_into is not None:
            return "gguf (converting to IR)"
        if self.original is not None:
            return "converted IR"
        return "gguf" if self.path.suffix.lower() == ".gguf" else "IR"

    def extra_properties(self) -> dict[str, Any]:
        """For the pipeline and the tokenizer alike: a converting load saves what it builds."""
        return {"enable_save_ov_model": True} if self.convert_into is not None else {}


def converted_dir(spec: ModelSpec) -> Path:
    return Path(spec.state_dir or DEFAULT_STATE_DIR) / "converted" / spec.name


def _stamp(path: Path) -> dict[str, Any]:
    info = path.stat()
    return {"source": str(path.resolve()), "size": info.st_size, "mtime_ns": info.st_mtime_ns}


def prepare_source(spec: ModelSpec) -> ModelSource:
    """The model to load; :class:`LoadError` when the path does not exist."""
    if not spec.path:
        raise LoadError("no model path given (`path`: a .gguf file or an OpenVINO IR folder)")
    path = Path(spec.path)
    if not path.exists():
        raise LoadError(f"model path does not exist: {path}")
    if not (spec.save_ov_model and path.is_file() and path.suffix.lower() == ".gguf"):
        return ModelSource(path)
    folder = converted_dir(spec)
    if _complete(folder) and _read_stamp(folder) == _stamp(path):
        return ModelSource(folder, original=path)
    link = _link_for_conversion(path, folder)
    return ModelSource(link, tokenizer_path=link, convert_into=folder, original=path)


def _complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in (IR_XML, *TOKENIZER_XMLS))


def _read_stamp(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _link_for_conversion(gguf: Path, folder: Path) -> Path:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    link = folder / gguf.name
    try:
        os.symlink(gguf.resolve(), link)
    except OSError:
        shutil.copyfile(gguf, link)  # no symlinks (Windows without the privilege): a copy, removed after
    return link


def finish_conversion(source: ModelSource) -> None:
    """After a converting load: keep the IR and its stamp, drop the link to the ``.gguf``."""
    if source.convert_into is None or source.original is None:
        return
    source.path.unlink(missing_ok=True)
    if not _complete(source.convert_into):
        missing = [name for name in (IR_XML, *TOKENIZER_XMLS) if not (source.convert_into / name).is_file()]
        log.warning("conversion of %s wrote no %s; the next start converts again", source.original, ", ".join(missing))
        return
    (source.convert_into / STAMP).write_text(json.dumps(_stamp(source.original)), encoding="utf-8")
    log.info("converted %s to OpenVINO IR in %s", source.original, source.convert_into)


def one_line(exc: BaseException) -> str:
    """OpenVINO errors come as several lines of C++ locations; keep the lines that say what is wrong."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    useful = [line for line in lines if not line.startswith(("Exception from ", "Check '"))]
    return " ".join(useful or lines) or type(exc).__name__


def remembered(spec: ModelSpec, tokenizer: Path | None) -> Callable[[Count], int | None]:
    """How a :class:`~modelserver.engines.context.PromptCounter` finds its tokenizer's cap for ``spec``: the probe's
    answer kept in the model's ``cache_dir`` for the tokenizer built from ``tokenizer`` (a ``.gguf`` or an IR folder;
    None: probed every start)."""
    import openvino_genai as ov_genai

    files = tokenizer_files(tokenizer) if tokenizer is not None else []
    return functools.partial(remembered_cap, cache_dir=spec.cache_dir, files=files, version=ov_genai.__version__)
