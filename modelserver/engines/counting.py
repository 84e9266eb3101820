"""Counting an encoder's input tokens (the context check and ``usage`` of embeddings and rerank), cheaply.

A request's count is a tokenization the bare pipeline does not pay: ``TextEmbeddingPipeline`` and
``TextRerankPipeline`` take strings and tokenize them again. openvino_genai's ``Tokenizer`` runs
its graph through the CPU plugin (~0.3-0.45 ms for one short text, a sixth of the embedding
itself); the folder's ``tokenizer.json`` through Hugging Face ``tokenizers`` (the Rust
tokenizer the OpenVINO one was converted from) counts the same text in ~16 us.

:class:`TokenCounter` counts with ``tokenizer.json`` when the folder has one, else with the
OpenVINO tokenizer. A count near the model's limit (within :data:`CONFIRM_MARGIN` tokens of it)
is taken again with the OpenVINO tokenizer, the one the pipeline cuts with, so a 400
``context_length_exceeded`` is decided by the model's own tokenization.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from modelserver.engines.context import token_counts

__all__ = ["CONFIRM_MARGIN", "TokenCounter", "load_counter", "near_limit"]

log = logging.getLogger(__name__)

#: Counts at most this far below the limit (or above it) are confirmed by the OpenVINO tokenizer.
CONFIRM_MARGIN = 16


class TokenCounter:
    """Each text's token count: with ``fast`` (a ``tokenizers.Tokenizer``) when there is one, else with ``exact()``
    (an openvino_genai ``Tokenizer``; built on first use when a fast one serves the common case)."""

    def __init__(self, exact: Callable[[], Any], fast: Any = None) -> None:
        self._make_exact = exact
        self._exact: Any = None
        self._fast = fast

    @property
    def fast(self) -> bool:
        return self._fast is not None

    @property
    def exact(self) -> Any:
        if self._exact is None:
            self._exact = self._make_exact()
        return self._exact

    def counts(self, texts: Sequence[str], special: bool = True) -> list[int]:
        if self._fast is None:
            return token_counts(self.exact, texts, special)
        # one text at a time on this thread: encode_batch's thread pool spins on a machine with few cores
        return [len(self._fast.encode(text, add_special_tokens=special).ids) for text in texts]

    def confirmed(self, texts: Sequence[str], counts: list[int], near: Sequence[bool],
                  special: bool = True) -> list[int]:
        """``counts`` with those marked ``near`` a limit taken again by the OpenVINO tokenizer (the pipeline's own)."""
        which = [i for i, flag in enumerate(near) if flag]
        if self._fast is None or not which:
            return counts
        counts = list(counts)
        for i, count in zip(which, token_counts(self.exact, [texts[i] for i in which], special), strict=True):
            counts[i] = count
        return counts


def near_limit(total: int, limit: int | None) -> bool:
    """Whether a count this close to ``limit`` (or above it) is confirmed before it decides a 400."""
    return limit is not None and total >= limit - CONFIRM_MARGIN


def load_counter(folder: Path, exact: Callable[[], Any]) -> TokenCounter:
    """A counter for the model in ``folder`` (``exact`` builds its OpenVINO tokenizer: at once when there is no
    usable ``tokenizer.json``)."""
    fast = _fast_tokenizer(folder / "tokenizer.json")
    counter = TokenCounter(exact, fast)
    if fast is None:
        counter.exact  # noqa: B018 - built now: every request needs it
    return counter


def _fast_tokenizer(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - a runtime dependency; a broken install counts the slow way
        return None
    try:
        fast = Tokenizer.from_file(str(path))
    except Exception as exc:  # a tokenizer.json this version cannot read: the OpenVINO tokenizer counts
        log.info("%s: not used for counting tokens (%s)", path, str(exc).splitlines()[0] if str(exc) else exc)
        return None
    fast.no_truncation()
    fast.no_padding()
    return fast
