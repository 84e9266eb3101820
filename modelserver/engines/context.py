"""A text model's context length, and how a request's prompt and ``max_tokens`` fit in it (no OpenVINO).

Where the number comes from, per model: what its files declare
(:func:`modelserver.modelfiles.context_length`, read without OpenVINO so the router can report it
too), lowered by ``options.context_length`` (:func:`configured_context`), which may only lower it:
a larger value is a load error naming both numbers (a model cannot attend past what it was trained on).

A tokenizer may also cut its output at a fixed length (openvino_genai's tokenizer of a GGUF
stops at 8192 tokens whatever ``max_length`` says): :func:`truncation_cap` finds that cap at
load, the effective context is the smaller of the two, and a prompt that reaches the cap is
counted again in pieces (:func:`chunks`) so the 400 names its real size and no prompt is
ever silently cut. The probe tokenizes ~150k tokens' worth of text (16-220 ms on the small
models here, on a cold start's critical path), so :func:`remembered_cap` keeps its answer in
the model's ``cache_dir`` (:data:`CAP_FILE`), per tokenizer file (path, size, modification
time) and openvino_genai version: a later start of the same model reads it back.

:func:`fit_context` is the check itself (pure): prompt + ``max_tokens`` must fit; without
``max_tokens`` the completion is capped at what the context leaves.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from modelserver.engines.base import SamplingParams
from modelserver.errors import ContextLengthExceeded, LoadError, RequestError

__all__ = [
    "CAP_FILE",
    "PromptCounter",
    "check_inputs",
    "token_counts",
    "chunks",
    "configured_context",
    "fit_context",
    "remembered_cap",
    "tokenizer_files",
    "truncation_cap",
]

log = logging.getLogger(__name__)

#: Where :func:`remembered_cap` keeps the probes' answers, in the model's ``cache_dir``.
CAP_FILE = "ovrouter-tokenizer-caps.json"

Count = Callable[[str], int]


def fit_context(prompt_tokens: int, sampling: SamplingParams, context: int | None, prompt_param: str) -> int:
    """``max_new_tokens`` for this request; :class:`ContextLengthExceeded` when it cannot fit.

    ``sampling.fit_to_context`` (no ``max_tokens`` in the request): the default limit shrinks to
    what the context leaves, and only a prompt that leaves no room at all is refused.
    """
    limit = sampling.max_tokens
    if context is not None:
        room = context - prompt_tokens
        if room < 1:  # the prompt alone fills the context: no token could be generated
            asked = 1 if sampling.fit_to_context else limit
            raise ContextLengthExceeded(context, prompt_tokens, asked, prompt_param, prompt_param)
        if sampling.fit_to_context:
            limit = min(limit, room)
        elif limit > room:
            raise ContextLengthExceeded(context, prompt_tokens, limit, "max_tokens", prompt_param)
    if sampling.min_tokens is not None and sampling.min_tokens > limit:
        raise RequestError(
            f"min_tokens: must be at most the completion's limit of {limit} tokens, got {sampling.min_tokens}",
            param="min_tokens",
        )
    return limit


#: A prompt longer than this many characters is not tokenized whole when its start alone overflows
#: the context: its count is extrapolated ("about N tokens"), so a 60 MB prompt costs what 4 MiB do.
EXACT_CHARS = 1 << 22


class PromptCounter:
    """A prompt's length in tokens, uncut: an openvino_genai ``Tokenizer`` and the context it serves.

    ``context_length`` is the smaller of the model's (``context``) and the tokenizer's cut
    (:func:`truncation_cap`); :meth:`fit` tokenizes once and returns the ids and ``max_new_tokens``.
    """

    def __init__(self, tokenizer: Any, context: int | None,
                 find_cap: Callable[[Count], int | None] | None = None) -> None:
        self._tokenizer = tokenizer
        self.cap = (find_cap or truncation_cap)(self.count)
        self._special_tokens = self.count("", special=True)
        self.context_length = min((n for n in (context, self.cap) if n is not None), default=None)

    def count(self, text: str, special: bool = False) -> int:
        return int(self._tokenizer.encode(text, add_special_tokens=special).input_ids.shape[1])

    def refuse_huge(self, text: str, sampling: SamplingParams, param: str) -> None:
        """Before the chat template: a 400 (with an extrapolated count) for a text whose first
        :data:`EXACT_CHARS` characters alone overflow the context; nothing for any other text."""
        if self.context_length is None or len(text) <= EXACT_CHARS:
            return
        head = self._full_count(text[:EXACT_CHARS], False)
        if head >= self.context_length:
            estimate = round(head * len(text) / EXACT_CHARS)
            asked = 1 if sampling.fit_to_context else sampling.max_tokens
            raise ContextLengthExceeded(self.context_length, estimate, asked, param, param, about=True)

    def fit(self, prompt: str, special: bool, sampling: SamplingParams, param: str) -> tuple[Any, int, int]:
        """``(input_ids, prompt_tokens, max_new_tokens)``; a 400 for an empty prompt or one that does not fit."""
        input_ids = self._tokenizer.encode(prompt, add_special_tokens=special).input_ids
        prompt_tokens = int(input_ids.shape[1])
        if prompt_tokens == 0:
            raise RequestError("the prompt is empty after tokenization", param=param)
        if self.cap is not None and prompt_tokens >= self.cap:  # cut by the tokenizer: count it whole
            prompt_tokens = self._full_count(prompt, special)
        return input_ids, prompt_tokens, fit_context(prompt_tokens, sampling, self.context_length, param)

    def total(self, prompt: str, special: bool) -> int:
        """The tokens of ``prompt`` however long (what :meth:`fit` charges, without its checks)."""
        count = self.count(prompt, special)
        return self._full_count(prompt, special) if self.cap is not None and count >= self.cap else count

    def _full_count(self, prompt: str, special: bool) -> int:
        """The tokens of ``prompt`` however long (in pieces below the tokenizer's cap, 256 pieces a call)."""
        pieces, total = list(chunks(prompt)), self._special_tokens if special else 0
        for start in range(0, len(pieces), 256):
            mask = self._tokenizer.encode(pieces[start : start + 256], add_special_tokens=False).attention_mask
            total += int(np.asarray(mask.data).sum())
        return total


def token_counts(tokenizer: Any, texts: Sequence[str], special: bool = True, budget_chars: int = 1 << 22) -> list[int]:
    """Each text's token count, encoded in groups of similar length whose padded size stays near
    ``budget_chars`` (one long input among many short ones must not pad them all to its length)."""
    counts = [0] * len(texts)
    group: list[int] = []

    def flush() -> None:
        mask = tokenizer.encode([texts[i] for i in group], add_special_tokens=special).attention_mask
        for i, count in zip(group, np.asarray(mask.data).sum(axis=1), strict=True):
            counts[i] = int(count)
        group.clear()

    for i in sorted(range(len(texts)), key=lambda i: -len(texts[i])):
        if group and (len(group) + 1) * max(len(texts[group[0]]), 1) > budget_chars:
            flush()
        group.append(i)
    if group:
        flush()
    return counts


def check_inputs(counts: list[int], maximum: int | None, param: str, truncate: bool) -> None:
    """400 ``context_length_exceeded`` for the first input longer than an encoder's ``maximum`` tokens,
    unless the request asked for ``truncate`` (then the pipeline embeds or scores the first ``maximum``)."""
    if truncate or maximum is None:
        return
    for index, count in enumerate(counts):
        if count > maximum:
            where = param if len(counts) == 1 and param == "input" else f"{param}[{index}]"
            raise RequestError(
                f"{where}: {count} tokens, above this model's maximum input of {maximum} tokens; shorten it, "
                f'or send "truncate": true to use its first {maximum} tokens',
                param=param,
                code="context_length_exceeded",
            )


# -- the model's own number ---------------------------------------------------------------------


def configured_context(name: str, model_context: int | None, option: Any) -> int | None:
    """The context to enforce: the model's, lowered by ``options.context_length``; a larger option fails the load."""
    if option is None:
        return model_context
    if isinstance(option, bool) or not isinstance(option, int) or option < 1:
        raise LoadError(f"models.{name}.options.context_length: expected an integer >= 1, got {option!r}")
    if model_context is not None and option > model_context:
        raise LoadError(
            f"models.{name}.options.context_length: {option} is above the model's own context length of "
            f"{model_context} tokens (the option may only lower it)"
        )
    return option


def truncation_cap(count: Callable[[str], int]) -> int | None:
    """The length at which the tokenizer behind ``count`` silently cuts its output; None when it does not."""
    unit = "The quick brown fox jumps over the lazy dog. "
    small = count(unit * 64)
    big = count(unit * 64 * 256)  # ~ 2.5 million tokens' worth of text would be slow; 256x is ~ 150k tokens
    return big if big < small * 200 else None


def tokenizer_files(path: Path) -> list[Path]:
    """The files a tokenizer is built from: a ``.gguf`` itself; an IR folder's ``openvino_tokenizer`` pair."""
    if path.is_file():
        return [path]
    return [found for name in ("openvino_tokenizer.xml", "openvino_tokenizer.bin") if (found := path / name).is_file()]


def remembered_cap(count: Count, cache_dir: str | None, files: Sequence[Path], version: str) -> int | None:
    """:func:`truncation_cap` of ``count``, kept in ``cache_dir``/:data:`CAP_FILE` per ``files`` (the tokenizer's:
    path, size, modification time) and ``version`` (openvino_genai's); probed as before without either."""
    if cache_dir is None or not files:
        return truncation_cap(count)
    try:
        key = "|".join([version, *(f"{f.resolve()}:{(st := f.stat()).st_size}:{st.st_mtime_ns}" for f in files)])
    except OSError:
        return truncation_cap(count)
    path = Path(cache_dir) / CAP_FILE
    known = _read_caps(path)
    value = known.get(key, "")
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    cap = truncation_cap(count)
    _write_caps(path, {**_read_caps(path), key: cap})  # read again: another model may have written meanwhile
    return cap


def _read_caps(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_caps(path: Path, caps: dict[str, Any]) -> None:
    """By rename (a reader never sees half a file); a folder that cannot be written only costs the next probe."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, part = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".part")
        try:
            with os.fdopen(fd, "w") as out:
                json.dump(caps, out)
            os.replace(part, path)
        except OSError:
            Path(part).unlink(missing_ok=True)
            raise
    except OSError as exc:
        log.debug("could not keep the tokenizer's cap in %s: %s", path, exc)


def chunks(text: str, size: int = 1024) -> Iterator[str]:
    """``text`` in pieces of at most ``size`` characters, cut before a space where one is near.

    A byte-level BPE pre-tokenizer splits before such a space anyway, so the pieces' token
    counts add up to the whole text's (other tokenizers: within a token per piece).
    """
    start = 0
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text) and (space := text.rfind(" ", start + 1, end)) > start:
            end = space
        yield text[start:end]
        start = end
