"""A text model's token ids, for ``/tokenize`` and ``/detokenize`` (tasks llm and vlm).

:class:`TokenizerIds` wraps the openvino_genai ``Tokenizer`` the engine already holds:

- :meth:`~TokenizerIds.encode` counts whatever the length: openvino_genai's tokenizer of a
  GGUF stops at 8192 tokens (``cap``, measured at load by
  :class:`~modelserver.engines.context.PromptCounter`), so a text that reaches the cap is
  encoded again in pieces cut before spaces (:func:`~modelserver.engines.context.chunks`),
  whose ids add up to the whole text's;
- :meth:`~TokenizerIds.decode` keeps special tokens (as llama.cpp's and vLLM's do) and
  refuses an id outside the vocabulary (the tokenizer would silently answer nothing);
- :meth:`~TokenizerIds.pieces` is each id's own text.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from modelserver.engines.context import chunks
from modelserver.errors import RequestError

__all__ = ["TokenIds", "TokenizerIds", "check_ids"]


class TokenIds(Protocol):
    """What ``/tokenize`` and ``/detokenize`` ask of an engine's tokenizer."""

    def encode(self, text: str, add_special: bool) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def pieces(self, ids: Sequence[int]) -> list[str]: ...


def check_ids(ids: Sequence[int], vocab_size: int | None) -> None:
    """400 naming the first id outside ``0 .. vocab_size - 1``."""
    for index, token in enumerate(ids):
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            top = f"0 to {vocab_size - 1}" if vocab_size is not None else "0 or more"
            raise RequestError(f"tokens[{index}]: {token} is not a token id of this model ({top})", param="tokens")


class TokenizerIds:
    def __init__(self, tokenizer: Any, cap: int | None) -> None:
        self._tokenizer = tokenizer
        self._cap = cap

    def encode(self, text: str, add_special: bool) -> list[int]:
        ids = self._ids([text], add_special)[0]
        if self._cap is None or len(ids) < self._cap:
            return ids
        head = self._ids([""], True)[0] if add_special else []  # BOS and the like, once
        return head + [i for piece in self._ids(list(chunks(text)), False) for i in piece]

    def decode(self, ids: Sequence[int]) -> str:
        check_ids(ids, self._vocab_size)
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=False))

    def pieces(self, ids: Sequence[int]) -> list[str]:
        return [str(self._tokenizer.decode([token], skip_special_tokens=False)) for token in ids]

    def _ids(self, texts: list[str], add_special: bool) -> list[list[int]]:
        encoded = self._tokenizer.encode(texts, add_special_tokens=add_special)
        ids, mask = np.asarray(encoded.input_ids.data), np.asarray(encoded.attention_mask.data)
        return [[int(i) for i, kept in zip(row, row_mask, strict=True) if kept] for row, row_mask in zip(ids, mask,
                                                                                                     strict=True)]

    @functools.cached_property
    def _vocab_size(self) -> int | None:
        try:
            return len(self._tokenizer.get_vocab())
        except Exception:  # a vocabulary it cannot list (bytes that are not UTF-8): ids are not range-checked
            return None
