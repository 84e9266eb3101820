"""Task ``rerank`` on OpenVINO: ``openvino_genai.TextRerankPipeline`` (cross-encoders, Qwen3 rerankers).

The pipeline scores every document in one call and returns them best first; ``top_n``
is applied per request by the api layer, so the pipeline is built to return all of them.
``usage.prompt_tokens`` counts the query once per document plus each document, in the
model's tokens (special tokens excluded).

Concurrent requests are gathered as for embeddings (:mod:`modelserver.engines.batching`)
and run in one hop to the model's worker, one pipeline call each: the pipeline scores one
query per call, and the documents of requests with the same query are not merged into one
call: openvino_genai 2026.4's pipeline over the test model's tokenizer aborts the process
(a CombineSegments check, then heap corruption) once a call's query and documents pass some
size ("cat on a mat" with five short documents does; "x" with six does not), so a merged
call could crash on requests that each pass alone.

A query + document longer than ``max_length`` (default: ``config.json``
``max_position_embeddings``) is a 400 unless the request sends ``truncate: true`` (counted as
query + document + the pair's special tokens).

``options`` (all optional): ``max_length``, ``pad_to_max_length``, ``padding_side``,
``batch_wait_ms`` (default 2) and ``max_batch`` (requests per batch, default 32; a request's documents go in
pipeline calls of at most ``max_batch`` x ``max_length`` padded query-document tokens, as one call's memory
grows with its tokens and stays, and the rankings are merged).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import openvino_genai as ov_genai

from modelserver.engines.batching import Abandoned, Batcher, BatchOptions, Inputs, calls, gone, split
from modelserver.engines.context import check_inputs
from modelserver.engines.counting import TokenCounter, load_counter, near_limit
from modelserver.engines.embeddings import BATCHING, UNLIMITED_TOKENS, batch_options
from modelserver.engines.media_base import RerankResult, SerialWorker
from modelserver.engines.ov_options import COUNTING_TOKENIZER, one_line, ov_properties
from modelserver.engines.task_options import ir_folder, task_options
from modelserver.errors import LoadError, RequestError
from modelserver.modelfiles import context_length
from modelserver.spec import ModelSpec

__all__ = ["OPTIONS", "OpenVINOReranker", "load"]

OPTIONS: dict[str, type | tuple[type, ...]] = {
    "max_length": int,
    "pad_to_max_length": bool,
    "padding_side": str,
    "batch_wait_ms": float,
    "max_batch": int,
}

#: One request: the query, its documents, and whether a pair above ``max_length`` is cut (else a 400).
Job = tuple[str, list[str], bool]

#: ``top_n`` of the pipeline itself: large enough to return every document of any request.
ALL_DOCUMENTS = 1 << 30


class OpenVINOReranker:
    def __init__(self, spec: ModelSpec, pipe: Any, counter: TokenCounter, load_s: float,
                 batching: BatchOptions | None = None, max_length: int | None = None) -> None:
        self._spec = spec
        self._pipe = pipe
        self._counter = counter
        self._max_length = max_length
        #: the special tokens of a query-document pair ([CLS] q [SEP] d [SEP]): one input's, plus a separator
        self._pair_tokens = counter.counts([""])[0] + 1
        self._load_s = load_s
        self._worker = SerialWorker(f"rerank-{spec.name}")
        self._batching = batching or BatchOptions()
        self._batcher: Batcher[Job, RerankResult] = Batcher(self._worker, self._rerank_all, self._batching)

    def describe(self) -> dict[str, Any]:
        return {"engine": "openvino TextRerankPipeline", "device": self._spec.device, "load_s": round(self._load_s, 2),
                "batch_wait_ms": self._batching.wait_ms, "max_batch": self._batching.max_batch}

    def stats(self) -> dict[str, Any]:
        return {**self._worker.stats(), **self._batcher.stats()}

    def close(self) -> None:
        self._worker.close()

    async def rerank(self, query: str, documents: Sequence[str], truncate: bool = False) -> RerankResult:
        inputs = Inputs(documents)
        try:
            return await self._batcher.submit((query, inputs, truncate))
        except asyncio.CancelledError:  # its client left: the calls only it needs are skipped
            inputs.gone = True
            raise

    def _rerank_all(self, jobs: list[Job]) -> list[RerankResult | BaseException]:
        """On the worker: every job's token counts in one encode, then each job that fits ranked (one call each).

        The counts are taken here rather than per request on the event loop: the tokenizer holds
        the GIL, and one encode of the whole batch costs about what one of a single request does.
        """
        texts = [text for query, documents, _ in jobs for text in (query, *documents)]
        sizes = [1 + len(docs) for _, docs, _ in jobs]
        flat = self._counter.counts(texts, special=False)
        near = [self._near(job_counts) for job_counts in split(flat, sizes) for _ in job_counts]
        counts = split(self._counter.confirmed(texts, flat, near, special=False), sizes)
        return [self._refusal(job_counts, truncate) or self._ranked(query, documents, job_counts)
                for (query, documents, truncate), job_counts in zip(jobs, counts, strict=True)]

    def _ranked(self, query: str, documents: list[str], counts: list[int]) -> RerankResult | Abandoned:
        """``counts``: the query's tokens, then each document's (special tokens excluded); :class:`Abandoned` once
        the request's client has left."""
        query_tokens, *document_tokens = counts
        limit = self._max_length or UNLIMITED_TOKENS  # one call's memory grows with its padded pairs (and stays)
        pairs = [min(query_tokens + n + self._pair_tokens, limit) for n in document_tokens]
        ranking: list[tuple[int, float]] = []
        for piece in calls(pairs, self._batching.max_batch * limit):
            if gone(documents):
                return Abandoned(f"the client left; {len(documents) - piece.start} documents not scored")
            ranking += [(piece.start + int(i), float(score))
                        for i, score in self._pipe.rerank(query, documents[piece.start : piece.stop])]
        ranking.sort(key=lambda pair: -pair[1])
        return RerankResult(ranking=ranking, prompt_tokens=query_tokens * len(documents) + sum(document_tokens))

    def _near(self, counts: list[int]) -> bool:
        """Whether a query + document of this job comes near ``max_length`` (its counts are then confirmed)."""
        query_tokens, *document_tokens = counts
        return any(near_limit(query_tokens + count + self._pair_tokens, self._max_length) for count in document_tokens)

    def _refusal(self, counts: list[int], truncate: bool) -> RequestError | None:
        """The 400 of a job with a query + document above ``max_length`` (unless it asked to ``truncate``)."""
        query_tokens, *document_tokens = counts
        pairs = [query_tokens + count + self._pair_tokens for count in document_tokens]
        try:
            check_inputs(pairs, self._max_length, "documents", truncate)
        except RequestError as exc:
            return exc
        return None


def load(spec: ModelSpec) -> OpenVINOReranker:
    started = time.monotonic()
    path = ir_folder(spec, ("openvino_model.xml", "openvino_tokenizer.xml"))
    config = ov_genai.TextRerankPipeline.Config()
    options = task_options(spec, OPTIONS)
    batching = batch_options(spec, options)
    for key, value in options.items():
        if key not in BATCHING:
            setattr(config, key, value)
    config.top_n = ALL_DOCUMENTS
    max_length = options.get("max_length") or context_length(path)
    if max_length:
        config.max_length = max_length  # the pipeline's cut, for requests that ask for it (truncate: true)
    try:
        pipe = ov_genai.TextRerankPipeline(str(path), spec.device, config, **ov_properties(spec))
        counter = load_counter(path, lambda: ov_genai.Tokenizer(str(path), **COUNTING_TOKENIZER))
    except Exception as exc:
        raise LoadError(one_line(exc)) from None
    return OpenVINOReranker(spec, pipe, counter, time.monotonic() - started, batching, max_length)
