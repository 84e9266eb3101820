"""Task ``embeddings`` on OpenVINO: ``openvino_genai.TextEmbeddingPipeline``.

Concurrent requests are batched (:mod:`modelserver.engines.batching`): the inputs of the
requests that meet within ``batch_wait_ms`` (or while a batch runs) go to the pipeline in
one call on the model's :class:`~modelserver.engines.media_base.SerialWorker` (a batch of more
than ``max_batch`` inputs: in calls of at most ``max_batch`` x ``max_length`` padded tokens),
and each request gets its own rows back. ``usage.prompt_tokens`` counts the model's own tokens
(the tokenizer's attention mask, capped at ``max_length``); with ``max_length`` known and at
most ``max_batch`` inputs the count is taken while the pipeline computes (it cuts every input
to ``max_length`` itself, so a request refused for a long input only has its vectors dropped),
else before the calls.

``options`` (all optional): ``pooling`` (cls | mean | last_token), ``normalize`` (L2),
``max_length`` (default: what the folder declares, else ``config.json``
``max_position_embeddings``; an input above it is a 400 unless the request sends
``truncate: true``), ``pad_to_max_length``, ``padding_side``, ``batch_size``,
``query_instruction`` and ``embed_instruction`` (prefixes the model was trained with; the
OpenAI API has no query/document distinction, so inputs are embedded as documents),
``batch_wait_ms`` (default 2) and ``max_batch`` (inputs per pipeline call, default 32: a request with more
is embedded in calls of at most ``max_batch`` x ``max_length`` padded tokens, as one call's memory grows
with its tokens and stays),
``matryoshka`` (the model was trained so that a prefix of each vector is an embedding:
requests may then send ``dimensions``). ``pooling``, ``normalize``, ``max_length`` and
``matryoshka`` default to what the folder's sentence-transformers files declare
(:mod:`modelserver.engines.st_metadata`), else cls, true, none and false; an explicit option wins.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import openvino_genai as ov_genai

from modelserver.engines.base import EmbeddingResult
from modelserver.engines.batching import (
    DEFAULT_MAX_BATCH,
    DEFAULT_WAIT_MS,
    Abandoned,
    Batcher,
    BatchOptions,
    Inputs,
    calls,
    gone,
    split,
)
from modelserver.engines.context import check_inputs
from modelserver.engines.counting import TokenCounter, load_counter, near_limit
from modelserver.engines.media_base import SerialWorker
from modelserver.engines.ov_options import COUNTING_TOKENIZER, one_line, ov_properties
from modelserver.engines.st_metadata import declared_options
from modelserver.engines.task_options import ir_folder, task_options
from modelserver.errors import LoadError, RequestError
from modelserver.modelfiles import context_length
from modelserver.spec import ModelSpec

__all__ = ["OPTIONS", "UNLIMITED_TOKENS", "OpenVINOEmbedder", "batch_options", "load"]

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
    "batch_wait_ms": float,
    "max_batch": int,
    "matryoshka": bool,
}
BATCHING = ("batch_wait_ms", "max_batch")
#: Options this module reads itself: never set on the pipeline's config.
NOT_PIPELINE = (*BATCHING, "matryoshka")
POOLING = {"cls": "CLS", "mean": "MEAN", "last_token": "LAST_TOKEN"}

#: One input's answer inside a batch: its vector and its token count.
Row = tuple[list[float], int]
#: ``max_length`` for the size of a pipeline call where the model declares none.
UNLIMITED_TOKENS = 512

#: One request inside a batch: its texts, and whether an input above ``max_length`` is cut (else a 400).
Job = tuple[list[str], bool]


def batch_options(spec: ModelSpec, options: dict[str, Any]) -> BatchOptions:
    """``batch_wait_ms`` / ``max_batch`` from checked ``options`` (shared with rerank)."""
    wait_ms = float(options.get("batch_wait_ms", DEFAULT_WAIT_MS))
    max_batch = int(options.get("max_batch", DEFAULT_MAX_BATCH))
    if wait_ms < 0 or max_batch < 1:
        raise LoadError(f"models.{spec.name}.options: batch_wait_ms must be >= 0 and max_batch >= 1")
    return BatchOptions(wait_ms=wait_ms, max_batch=max_batch)


def pipeline_config(spec: ModelSpec, declared: dict[str, Any] | None = None) -> Any:
    """``options`` over ``declared`` as a ``TextEmbeddingPipeline.Config``; :class:`LoadError` naming a bad value."""
    options = {**(declared or {}), **task_options(spec, OPTIONS)}
    for key in NOT_PIPELINE:
        options.pop(key, None)
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

    def __init__(self, spec: ModelSpec, pipe: Any, counter: TokenCounter, config: Any, load_s: float,
                 batching: BatchOptions | None = None, matryoshka: bool = False) -> None:
        self._spec = spec
        self.matryoshka = matryoshka
        self.normalizes = bool(config.normalize)
        self._pipe = pipe
        self._counter = counter
        self._config = config
        self._load_s = load_s
        self._worker = SerialWorker(f"embed-{spec.name}")
        self._batching = batching or BatchOptions()
        self._batcher: Batcher[Job, list[Row]] = Batcher(self._worker, self._embed_all, self._batching)

    def describe(self) -> dict[str, Any]:
        return {
            "engine": "openvino TextEmbeddingPipeline",
            "device": self._spec.device,
            "pooling": self._config.pooling_type.name.lower(),
            "normalize": self._config.normalize,
            "max_length": self._config.max_length,
            "matryoshka": self.matryoshka,
            "batch_wait_ms": self._batching.wait_ms,
            "max_batch": self._batching.max_batch,
            "load_s": round(self._load_s, 2),
        }

    def stats(self) -> dict[str, Any]:
        return {**self._worker.stats(), **self._batcher.stats()}

    def close(self) -> None:
        self._worker.close()

    async def embed(self, texts: Sequence[str], truncate: bool = False) -> EmbeddingResult:
        inputs = Inputs(texts)
        try:
            rows = await self._batcher.submit((inputs, truncate), len(texts))
        except asyncio.CancelledError:  # its client left: the calls only it needs are skipped
            inputs.gone = True
            raise
        return EmbeddingResult(vectors=[vector for vector, _ in rows], prompt_tokens=sum(count for _, count in rows))

    def _embed_all(self, jobs: list[Job]) -> list[list[Row] | BaseException]:
        """On the worker: every job's token counts (:mod:`~modelserver.engines.counting`) and the pipeline calls.

        Up to ``max_batch`` inputs with ``max_length`` set (the pipeline cuts every input to it): one call,
        started at once with every job's texts, the counts taken while it computes (the vectors of a refused
        job are dropped). More inputs, or no ``max_length``: the count first, then only the jobs that fit, in
        calls of at most ``max_batch`` x ``max_length`` padded tokens (:func:`~modelserver.engines.batching.calls`).
        """
        sizes = [len(texts) for texts, _ in jobs]
        every = [text for texts, _ in jobs for text in texts]
        overlapped = bool(self._config.max_length) and len(every) <= self._batching.max_batch
        try:
            if overlapped:
                self._pipe.start_embed_documents_async(every)
                try:
                    counts, refusals = self._counted(jobs, every, sizes)
                finally:  # the call runs to its end whatever the count did: the pipeline takes one call at a time
                    computed = self._pipe.wait_embed_documents()
                vectors = iter(split(computed, sizes))
            else:
                counts, refusals = self._counted(jobs, every, sizes)
                fit = [i for i, refusal in enumerate(refusals) if refusal is None]
                flat = [text for i in fit for text in jobs[i][0]]
                vectors = iter(split(self._embedded(flat, [n for i in fit for n in counts[i]], jobs),
                                     [sizes[i] for i in fit]))
        except Abandoned as exc:
            return [exc] * len(jobs)
        answers: list[list[Row] | BaseException] = []
        for job_counts, refusal in zip(counts, refusals, strict=True):
            job_vectors = next(vectors) if refusal is None or overlapped else []
            answers.append(refusal or self._rows(job_vectors, job_counts))
        return answers

    def _embedded(self, texts: list[str], tokens: list[int], jobs: list[Job]) -> list[Any]:
        """The vectors of ``texts`` (of ``tokens`` each) in calls of at most ``max_batch`` x ``max_length`` padded
        tokens; :class:`Abandoned` once every job's client has left."""
        limit = self._config.max_length or UNLIMITED_TOKENS
        padded = [limit] * len(tokens) if getattr(self._config, "pad_to_max_length", False) else tokens
        vectors: list[Any] = []
        for piece in calls([min(n, limit) for n in padded], self._batching.max_batch * limit):
            if all(gone(job_texts) for job_texts, _ in jobs):
                raise Abandoned(f"every request's client left; {len(texts) - piece.start} inputs not embedded")
            vectors += self._pipe.embed_documents(texts[piece.start : piece.stop])
        return vectors

    def _counted(self, jobs: list[Job], every: list[str], sizes: list[int]) -> tuple[list[list[int]],
                                                                                     list[RequestError | None]]:
        """Each job's token counts and its 400 (None: it fits, or asked to be cut)."""
        found = self._counter.counts(every)
        found = self._counter.confirmed(every, found, [near_limit(n, self._config.max_length) for n in found])
        counts = split(found, sizes)
        return counts, [self._refusal(job_counts, truncate) for job_counts, (_, truncate) in zip(counts, jobs,
                                                                                                  strict=True)]

    def _rows(self, vectors: list[Any], counts: list[int]) -> list[Row]:
        """Each vector (as floats) with its token count (capped at ``max_length``: what the pipeline embedded)."""
        limit = self._config.max_length or None
        return [(v if v and type(v[0]) is float else list(map(float, v)), min(n, limit or n))
                for v, n in zip(vectors, counts, strict=True)]

    def _refusal(self, counts: list[int], truncate: bool) -> RequestError | None:
        """The 400 of a job with an input above ``max_length`` (unless it asked to ``truncate``)."""
        try:
            check_inputs(counts, self._config.max_length, "input", truncate)
        except RequestError as exc:
            return exc
        return None


def load(spec: ModelSpec) -> OpenVINOEmbedder:
    """Load ``spec`` onto its device; :class:`LoadError` with one readable line when it cannot."""
    started = time.monotonic()
    path = ir_folder(spec)
    declared = declared_options(path, spec.options)
    if declared:
        log.info("%s declares %s (sentence-transformers files; explicit options win)", path, declared)
    config = pipeline_config(spec, declared)
    if not config.max_length:  # the encoder's own limit: enforced per request (400, or cut with truncate: true)
        config.max_length = context_length(path)
    batching = batch_options(spec, spec.options)
    try:
        pipe = ov_genai.TextEmbeddingPipeline(str(path), spec.device, config, **ov_properties(spec))
        counter = load_counter(path, lambda: ov_genai.Tokenizer(str(path), **COUNTING_TOKENIZER))
    except Exception as exc:
        raise LoadError(one_line(exc)) from None
    matryoshka = bool({**declared, **spec.options}.get("matryoshka", False))
    return OpenVINOEmbedder(spec, pipe, counter, config, time.monotonic() - started, batching, matryoshka)
