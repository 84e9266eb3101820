"""Prefix caching: the scheduler defaults that turn it on, and the count of a prompt's cached tokens (no OpenVINO).

``ContinuousBatchingPipeline`` keeps the KV blocks of finished sequences when
``SchedulerConfig.enable_prefix_caching`` is on, and a later prompt that starts with the same
tokens reuses them instead of prefilling them again (an agent session resends its whole,
growing conversation every turn). :func:`scheduler_defaults` turns it on for task ``llm``
unless the model's ``scheduler`` says ``enable_prefix_caching: false``, and on CPU gives the
cache a fixed size (committed as it fills) so the blocks of earlier turns are not
overwritten by the next prompt, as they are in the default cache that only grows to the
largest batch: ``num_kv_blocks`` for ``max_concurrency`` sequences of the served context by the
model's KV shape per token (:func:`scheduler_for`), at most :data:`CPU_CACHE_SIZE_GB`; the
whole ``cache_size`` :data:`CPU_CACHE_SIZE_GB` where the files do not say that shape.

The pipeline does not say how many of a request's prompt tokens it took from the cache, so
:class:`PrefixTracker` estimates it the way the pipeline decides it: whole KV blocks of
``block_size`` tokens, matched from the start by the hash of everything up to their end,
against the sequences (prompt and answer) of recent requests; the last prompt token is always
computed. The count is what ``usage`` reports as ``prompt_tokens_details.cached_tokens``
(chat), ``input_tokens_details.cached_tokens`` (Responses) and ``cache_read_input_tokens``
(Messages), and ``/health`` sums it (``prefix_cached_tokens`` of ``prefix_prompt_tokens``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from modelserver.modelfiles import attention_shape
from modelserver.spec import ModelSpec

__all__ = ["CPU_CACHE_SIZE_GB", "PrefixTracker", "block_size_for", "kv_blocks", "kv_token_bytes",
           "scheduler_defaults", "scheduler_for"]

#: ``scheduler.cache_size`` (GB) of an ``llm`` on CPU with prefix caching and no size of its own: the most that
#: :func:`kv_blocks` gives it, and what it gets when its files do not say the shape of its KV cache.
CPU_CACHE_SIZE_GB = 1
#: Bytes of one KV cache element by ``KV_CACHE_PRECISION`` (the CPU's default is u8).
KV_ELEMENT_BYTES = {"u8": 1.0, "i8": 1.0, "u4": 0.5, "f16": 2.0, "bf16": 2.0, "f32": 4.0}
#: What a quantized (u8/u4) cache adds per head and token: its scale and zero point (measured on openvino_genai
#: 2026.4: SmolLM2-135M's 30 layers x K,V x 3 heads x 64 take 437,760 bytes a 32-token block = 76 bytes a head-token).
KV_QUANT_EXTRA_BYTES = 12
#: Distinct KV blocks the tracker remembers (about 2M tokens at 32 a block): older ones are forgotten first.
MAX_BLOCKS = 1 << 16


def scheduler_defaults(task: str, device: str, scheduler: dict[str, Any], blocks: int | None = None) -> dict[str, Any]:
    """The ``SchedulerConfig`` fields to apply: the model's own over the prefix-caching defaults.

    ``blocks``: the KV cache a CPU model needs (:func:`kv_blocks`), given as ``num_kv_blocks``;
    without it, ``cache_size`` :data:`CPU_CACHE_SIZE_GB`."""
    if task != "llm" or scheduler.get("enable_prefix_caching") is False:
        return dict(scheduler)
    fields: dict[str, Any] = {"enable_prefix_caching": True}
    sized = any(scheduler.get(key) for key in ("cache_size", "num_kv_blocks"))
    if device.upper().startswith("CPU") and not sized:
        fields.update({"num_kv_blocks": blocks} if blocks else {"cache_size": CPU_CACHE_SIZE_GB})
    return {**fields, **scheduler}


def scheduler_for(spec: ModelSpec, files: Path, context: int | None) -> dict[str, Any]:
    """:func:`scheduler_defaults` with a CPU KV cache sized for ``spec``: ``max_concurrency`` (or the scheduler's
    ``max_num_seqs``, if lower) sequences of ``context`` tokens, by the KV shape ``files`` declare."""
    shape = attention_shape(files)
    precision = str(spec.ov_config.get("KV_CACHE_PRECISION", "u8"))
    token_bytes = kv_token_bytes(*shape, precision) if shape else None
    seqs = spec.scheduler.get("max_num_seqs")
    seqs = min(spec.max_concurrency, seqs) if isinstance(seqs, int) and seqs > 0 else spec.max_concurrency
    blocks = kv_blocks(seqs, context, token_bytes, block_size_for(spec.device))
    return scheduler_defaults(spec.task, spec.device, spec.scheduler, blocks)


def kv_token_bytes(layers: int, kv_heads: int, head_dim: int, precision: str = "u8") -> float:
    """Bytes of one token's entry in the KV cache: K and V of every layer and KV head."""
    element = KV_ELEMENT_BYTES.get(precision.lower(), 1.0)
    extra = KV_QUANT_EXTRA_BYTES if precision.lower() in ("u8", "i8", "u4") else 0
    return layers * 2 * kv_heads * (head_dim * element + extra)


def kv_blocks(concurrency: int, context: int | None, token_bytes: float | None, block_size: int,
              cap_bytes: int = CPU_CACHE_SIZE_GB * 1024**3) -> int | None:
    """KV blocks for ``concurrency`` sequences of ``context`` tokens each, at most ``cap_bytes`` of them
    (a prefix cache keeps finished sequences' blocks until the cache is full, so it fills whatever it is given);
    None when the context or the per-token size is unknown."""
    if not context or not token_bytes:
        return None
    wanted = -(-concurrency * context // block_size)
    return max(1, min(wanted, int(cap_bytes // (block_size * token_bytes))))


def block_size_for(device: str) -> int:
    """Tokens per KV block of the device's paged attention (openvino_genai: 16 on GPU, 32 elsewhere)."""
    return 16 if device.upper().startswith("GPU") else 32


class PrefixTracker:
    """Which leading blocks of a prompt the prefix cache probably holds, and the running totals.

    ``count`` is called once per prompt (it also adds to the totals); ``remember`` records a
    sequence whose KV blocks the cache keeps (prompt and generated tokens of a request). The
    newest ``max_blocks`` block hashes are kept; the pipeline's own eviction may drop blocks
    sooner under memory pressure, so the figure is an upper estimate.
    """

    def __init__(self, block_size: int, enabled: bool = True, max_blocks: int = MAX_BLOCKS) -> None:
        self.block_size = block_size
        self.enabled = enabled
        self._max_blocks = max_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.hits = 0

    def _chain(self, ids: Sequence[int]) -> list[int]:
        """The hash of every whole block, each over all the tokens up to its end."""
        chain, running, size = [], 0, self.block_size
        for end in range(size, len(ids) + 1, size):
            running = hash((running, tuple(ids[end - size : end])))
            chain.append(running)
        return chain

    def count(self, prompt_ids: Sequence[int]) -> int:
        """Tokens of ``prompt_ids`` the cache would serve (0 when prefix caching is off)."""
        cached = 0
        if self.enabled:
            for key in self._chain(prompt_ids):
                if key not in self._blocks:
                    break
                self._blocks.move_to_end(key)
                cached += self.block_size
            cached = min(cached, max(len(prompt_ids) - 1, 0))
        self.prompt_tokens += len(prompt_ids)
        self.cached_tokens += cached
        self.hits += cached > 0
        return cached

    def remember(self, ids: Sequence[int]) -> None:
        if not self.enabled:
            return
        for key in self._chain(ids):
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self._max_blocks:
            self._blocks.popitem(last=False)

    def stats(self) -> dict[str, Any]:
        """What ``/health`` reports (the router turns the counts into metrics)."""
        return {"prefix_caching": self.enabled, "prefix_prompt_tokens": self.prompt_tokens,
                "prefix_cached_tokens": self.cached_tokens, "prefix_cache_hits": self.hits}
