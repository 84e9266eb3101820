"""Task ``embeddings`` on OpenVINO: ``openvino_genai.TextEmbeddingPipeline``.

All the inputs of one request go to the pipeline in one ``embed_documents`` call (one
batched inference, not a loop); requests run one after another on the model's
:class:`~modelserver.engines.media_base.SerialWorker`. ``usage.prompt_tokens`` counts
the model's own tokens (the tokenizer's attention mask, capped at ``max_length``).

``options`` (all optional): ``pooling`` (cls | mean | last_token; sentence-transformers
models such as all-MiniLM-L6-v2 want ``mean``), ``normalize`` (L2, default true),
``max_length``, ``pad_to_max_length``, ``padding_side``, ``batch_size``,
``query_instruction`` and ``embed_instruction`` (prefixes the model was trained with; the
OpenAI API has no query/document distinction, so inputs are embedded as documents).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import openvino_genai as ov_genai

from modelserver.engines.base import EmbeddingResult
from modelserver.engines.media_base import SerialWorker
from modelserver.engines.ov_options import one_line, ov_properties
from modelserver.engines.task_options import ir_folder, task_options
from modelserver.errors import LoadError
from modelserver.spec import ModelSpec

__all__ = ["OPTIONS", "OpenVINOEmbedder", "load"]

log = logging.getLogger(__name__)

OPTIONS: dict[str, type | tuple[type, ...]] = {
    "pooling": str,
    "normalize": bool,
    "max_length": int,
    "pad_to_max_length": bool,
    "padding_side": str,
    "batch_size": int,
    "query_instruction": str,
    "embed_instruction": str,
}
POOLING = {"cls": "CLS", "mean": "MEAN", "last_token": "LAST_TOKEN"}


def pipeline_config(spec: ModelSpec) -> Any:
    """``options`` as a ``TextEmbeddingPipeline.Config``; :class:`LoadError` naming a bad value."""
    options = task_options(spec, OPTIONS)
    pooling = str(options.pop("pooling", "cls")).lower()
    if pooling not in POOLING:
        raise LoadError(f"models.{spec.name}.options.pooling: expected one of {', '.join(POOLING)}, got {pooling!r}")
    config = ov_genai.TextEmbeddingPipeline.Config()
    config.pooling_type = getattr(ov_genai.TextEmbeddingPipeline.PoolingType, POOLING[pooling])
    for key, value in options.items():
        setattr(config, key, value)
    try:
        config.validate()
    except Exception as exc:
        raise LoadError(f"models.{spec.name}.options: {one_line(exc)}") from None
    return config


class OpenVINOEmbedder:
    """A loaded TextEmbeddingPipeline behind the :class:`~modelserver.engines.base.Embedder` protocol."""

    def __init__(self, spec: ModelSpec, pipe: Any, tokenizer: Any, config: Any, load_s: float) -> None:
        self._spec = spec
        self._pipe = pipe
        self._tokenizer = tokenizer
        self._config = config
        self._load_s = load_s
        self._worker = SerialWorker(f"embed-{spec.name}")

    def describe(self) -> dict[str, Any]:
        return {
            "engine": "openvino TextEmbeddingPipeline",
            "device": self._spec.device,
            "pooling": self._config.pooling_type.name.lower(),
            "normalize": self._config.normalize,
            "max_length": self._config.max_length,
            "load_s": round(self._load_s, 2),
        }

    def stats(self) -> dict[str, Any]:
        return self._worker.stats()

    def close(self) -> None:
        self._worker.close()

    async def embed(self, texts: Sequence[str]) -> EmbeddingResult:
        return await self._worker.run(self._embed, list(texts))

    def _embed(self, texts: list[str]) -> EmbeddingResult:
        vectors = self._pipe.embed_documents(texts)
        return EmbeddingResult(vectors=[list(map(float, v)) for v in vectors], prompt_tokens=self._count(texts))

    def _count(self, texts: list[str]) -> int:
        mask = np.asarray(self._tokenizer.encode(texts).attention_mask.data)
        counts = mask.sum(axis=1)
        if self._config.max_length:
            counts = np.minimum(counts, self._config.max_length)
        return int(counts.sum())


def load(spec: ModelSpec) -> OpenVINOEmbedder:
    """Load ``spec`` onto its device; :class:`LoadError` with one readable line when it cannot."""
    started = time.monotonic()
    path = ir_folder(spec)
    config = pipeline_config(spec)
    try:
        pipe = ov_genai.TextEmbeddingPipeline(str(path), spec.device, config, **ov_properties(spec))
        tokenizer = ov_genai.Tokenizer(str(path))
    except Exception as exc:
        raise LoadError(one_line(exc)) from None
    return OpenVINOEmbedder(spec, pipe, tokenizer, config, time.monotonic() - started)

