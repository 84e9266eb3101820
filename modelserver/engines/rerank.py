"""Task ``rerank`` on OpenVINO: ``openvino_genai.TextRerankPipeline`` (cross-encoders, Qwen3 rerankers).

The pipeline scores every document in one call and returns them best first; ``top_n``
is applied per request by the api layer, so the pipeline is built to return all of them.
``usage.prompt_tokens`` counts the query once per document plus each document, in the
model's tokens (special tokens excluded).

``options`` (all optional): ``max_length``, ``pad_to_max_length``, ``padding_side``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import openvino_genai as ov_genai

from modelserver.engines.media_base import RerankResult, SerialWorker
from modelserver.engines.ov_options import one_line, ov_properties
from modelserver.engines.task_options import ir_folder, task_options
from modelserver.errors import LoadError
from modelserver.spec import ModelSpec

__all__ = ["OPTIONS", "OpenVINOReranker", "load"]

OPTIONS: dict[str, type | tuple[type, ...]] = {"max_length": int, "pad_to_max_length": bool, "padding_side": str}

#: ``top_n`` of the pipeline itself: large enough to return every document of any request.
ALL_DOCUMENTS = 1 << 30


class OpenVINOReranker:
    def __init__(self, spec: ModelSpec, pipe: Any, tokenizer: Any, load_s: float) -> None:
        self._spec = spec
        self._pipe = pipe
        self._tokenizer = tokenizer
        self._load_s = load_s
        self._worker = SerialWorker(f"rerank-{spec.name}")

    def describe(self) -> dict[str, Any]:
        return {"engine": "openvino TextRerankPipeline", "device": self._spec.device, "load_s": round(self._load_s, 2)}

    def stats(self) -> dict[str, Any]:
        return self._worker.stats()

    def close(self) -> None:
        self._worker.close()

    async def rerank(self, query: str, documents: Sequence[str]) -> RerankResult:
        return await self._worker.run(self._rerank, query, list(documents))

    def _rerank(self, query: str, documents: list[str]) -> RerankResult:
        ranking = [(int(index), float(score)) for index, score in self._pipe.rerank(query, documents)]
        return RerankResult(ranking=ranking, prompt_tokens=self._count(query, documents))

    def _count(self, query: str, documents: list[str]) -> int:
        mask = np.asarray(self._tokenizer.encode([query, *documents], add_special_tokens=False).attention_mask.data)
        counts = mask.sum(axis=1)
        return int(counts[0]) * len(documents) + int(counts[1:].sum())


def load(spec: ModelSpec) -> OpenVINOReranker:
    started = time.monotonic()
    path = ir_folder(spec, ("openvino_model.xml", "openvino_tokenizer.xml"))
    config = ov_genai.TextRerankPipeline.Config()
    for key, value in task_options(spec, OPTIONS).items():
        setattr(config, key, value)
    config.top_n = ALL_DOCUMENTS
    try:
        pipe = ov_genai.TextRerankPipeline(str(path), spec.device, config, **ov_properties(spec))
        tokenizer = ov_genai.Tokenizer(str(path))
    except Exception as exc:
        raise LoadError(one_line(exc)) from None
    return OpenVINOReranker(spec, pipe, tokenizer, time.monotonic() - started)
