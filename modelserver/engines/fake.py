"""The built-in deterministic engine (``engine: fake``): fast process tests without a model.

It echoes the last user message (or the prompt) word by word, ``fake.token_delay_s``
apart, after a load of ``fake.load_s``; usage counts are words. ``options.context_length``
(words; none when unset) is checked as the real engine checks its context, and fake embeddings
and reranking refuse inputs above ``options.max_length`` words the same way. Markers in that text inject
faults, checked when a request starts:

- ``[[crash]]``  the process exits at once (``os._exit``), as a segfaulting driver would;
- ``[[hang]]``   the event loop thread blocks forever: the request and ``/health`` never answer;
- ``[[fatal]]``  an engine error containing ``CL_OUT_OF_RESOURCES`` (fatal by the default patterns);
- ``[[suspect]]`` an engine error containing ``CL_MEM_OBJECT_ALLOCATION_FAILURE`` (suspect by the
  default patterns: a 500; the second within a minute replaces the process);
- ``[[abort]]``  a fatal GPU plugin message on stderr, then the process exits with status 134
  (as an aborting driver would): the supervisor classifies the exit by those last lines;
- ``[[error]]``  an ordinary engine error: a 500, and the server keeps serving.

and, checked while a text answer streams:

- ``[[stall]]``  half the words, then silence while ``/health`` still answers (a stalled
  device) — unless the request continues a final assistant message (a resumed stream ends);
- ``[[crash-mid]]`` half the words, then the process exits (every time: a poison request).
- ``[[fatal-mid]]`` half the words, then a fatal engine error (the process answers it in the
  stream and exits) — unless the request continues a final assistant message.

A chat whose last message is an assistant message, sent with ``continue_final_message``,
continues it: the echo's text that the message already holds is skipped (character by
character: a message that ends mid-word, as text held back by a stop string leaves it, is
continued mid-word), so a stream resumed after its backend died ends with exactly the text
an unbroken one would have. A final message that is not the start of the echo is a 400.
A completion is continued the same way: a prompt whose last line is the start of the echo of the
lines before it (what a resumed stream sends for a prompt that ends with a newline: the prompt,
then the text so far) continues that echo.

Tools and structured output (what router and client tests build on):

- a forced ``tool_choice`` (``required`` or a named function) answers one call of the
  named (or first) function; so does ``tool_choice: auto`` when the last message is a user
  message containing ``[[tool]]``. The arguments are built from the function's JSON
  schema (:func:`example_of`: each listed property, the first enum value, the minimum,
  ``"fake"`` for strings); the text is the model's ``tool_parser``
  form (Hermes by default), which the server parses like a real model's;
- when the last message is a tool result (and no call is forced) the answer echoes it:
  ``tool result: <content>``;
- ``response_format`` ``json_schema`` / ``guided_json`` answer an example of the schema,
  ``json_object`` answers ``{"text": "<last user message>"}``, ``guided_choice`` the first
  choice; ``guided_regex`` is not honoured (the echo as usual).

Fake embeddings are a deterministic function of the text: a normalized sum of one
pseudo-random vector per lower-cased word, so texts sharing words are close.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np

from modelserver.engines.base import EmbeddingResult, FinishReason, GenerationRequest
from modelserver.engines.context import check_inputs, fit_context
from modelserver.engines.tokens import check_ids
from modelserver.errors import LoadError, RequestError
from modelserver.spec import ModelSpec
from modelserver.structured import Grammar, TagSpec, ToolGrammar, tool_call_grammar

__all__ = [
    "ABORT_EXIT_CODE",
    "CRASH_EXIT_CODE",
    "FakeEmbedder",
    "FakeTextGenerator",
    "example_of",
    "load_embedder",
    "load_text_generator",
]

log = logging.getLogger(__name__)

#: Exit status of a ``[[crash]]``, so a test can tell an injected crash from any other exit.
CRASH_EXIT_CODE = 86
#: Exit status of an ``[[abort]]`` (SIGABRT's 128 + 6, as a shell reports an aborted driver).
ABORT_EXIT_CODE = 134
ABORT_MESSAGE = "[GPU] clFinish, error code: -5 CL_OUT_OF_RESOURCES; GPU plugin can't finish correctly ([[abort]])"


def _exit_now(code: int) -> None:
    logging.shutdown()
    os._exit(code)


def inject_faults(text: str) -> None:
    """Act on the fault markers in ``text``; returns only when there is none."""
    if "[[crash]]" in text:
        log.warning("fake engine: [[crash]] marker, exiting with status %d", CRASH_EXIT_CODE)
        _exit_now(CRASH_EXIT_CODE)
    if "[[abort]]" in text:
        os.write(2, (ABORT_MESSAGE + "\n").encode())
        _exit_now(ABORT_EXIT_CODE)
    if "[[hang]]" in text:
        log.warning("fake engine: [[hang]] marker, blocking the event loop forever")
        while True:  # deliberately blocks the event loop thread: nothing, /health included, answers
            time.sleep(3600)
    if "[[fatal]]" in text:
        raise RuntimeError("fake engine: clEnqueueNDRangeKernel failed with CL_OUT_OF_RESOURCES ([[fatal]] marker)")
    if "[[suspect]]" in text:
        raise RuntimeError("fake engine: clEnqueueWriteBuffer: CL_MEM_OBJECT_ALLOCATION_FAILURE ([[suspect]])")
    if "[[error]]" in text:
        raise RuntimeError("fake engine: injected error ([[error]] marker)")


def _fake_load(spec: ModelSpec) -> None:
    time.sleep(spec.fake.load_s)
    if spec.fake.fail_load:
        raise LoadError(spec.fake.fail_load)


class _Counters:
    def __init__(self) -> None:
        self.running = 0
        self.completed = 0
        self.cancelled = 0
        self.advanced_at = time.monotonic()  # a generation started or sent a token (as a real pump's step)

    def advance(self) -> None:
        self.advanced_at = time.monotonic()

    def as_dict(self) -> dict[str, Any]:
        stuck_s = max(time.monotonic() - self.advanced_at, 0.0) if self.running else 0.0
        return {"running": self.running, "completed": self.completed, "cancelled": self.cancelled,
                "stuck_s": round(stuck_s, 1)}


class FakeStream:
    """``words`` (pieces of text, each a delta and a token), joined by spaces unless ``joined``."""

    def __init__(self, words: list[str], prompt_tokens: int, max_tokens: int, delay_s: float, counters: _Counters,
                 joined: bool = False, fault: str | None = None):
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.finish_reason: FinishReason | None = None
        self._words = words
        self._max_tokens = max_tokens
        self._delay_s = delay_s
        self._counters = counters
        self._closed = False
        self._joined = joined
        self._fault = fault  # "stall" or "crash-mid": after half the words
        counters.running += 1
        counters.advance()
        self._gen = self._deltas()

    def __aiter__(self) -> AsyncIterator[str]:
        return self._gen

    async def _deltas(self) -> AsyncIterator[str]:
        try:
            for index, word in enumerate(self._words[: self._max_tokens]):
                if index == len(self._words) // 2 and self._fault is not None:
                    await _mid_fault(self._fault)
                await asyncio.sleep(self._delay_s)
                self.completion_tokens += 1
                self._counters.advance()
                yield word if index == 0 or self._joined else " " + word
            self.finish_reason = "length" if len(self._words) > self._max_tokens else "stop"
        finally:
            self._settle()

    def _settle(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._counters.running -= 1
        if self.finish_reason is None:
            self._counters.cancelled += 1
            log.info("fake generation cancelled after %d tokens", self.completion_tokens)
        else:
            self._counters.completed += 1

    async def aclose(self) -> None:
        await self._gen.aclose()  # type: ignore[attr-defined]
        self._settle()

    def token_logprobs(self) -> list[tuple[str, float]]:
        """Every piece sent is certain: log probability 0."""
        sent = self._words[: self.completion_tokens]
        return [(w if i == 0 or self._joined else " " + w, 0.0) for i, w in enumerate(sent)]


async def _mid_fault(fault: str) -> None:
    if fault == "fatal-mid":
        raise RuntimeError("fake engine: clFinish failed with CL_OUT_OF_RESOURCES ([[fatal-mid]] marker)")
    if fault == "crash-mid":
        log.warning("fake engine: [[crash-mid]] marker, exiting with status %d", CRASH_EXIT_CODE)
        _exit_now(CRASH_EXIT_CODE)
    log.warning("fake engine: [[stall]] marker, this generation goes silent")
    await asyncio.Event().wait()  # silent until cancelled; /health keeps answering


def _mid_stream_fault(text: str, continued: bool) -> str | None:
    if "[[crash-mid]]" in text:
        return "crash-mid"
    if "[[stall]]" in text and not continued:
        return "stall"
    if "[[fatal-mid]]" in text and not continued:
        return "fatal-mid"
    return None


def _continue(words: list[str], request: GenerationRequest) -> list[str] | None:
    """The rest of the echo after the final assistant message (a continuation), in pieces that carry their
    own spacing (the first may end a word the message began); None when it is not a continuation.

    A final message that is not the start of the echo cannot be continued faithfully: a 400, never an
    answer restarted from its first word (what an unfaithful resume would look like)."""
    turns = request.messages or ()
    if not request.continue_final or not turns or turns[-1].role != "assistant":
        return None
    done, echo = turns[-1].content, " ".join(words)
    if not echo.startswith(done):
        raise RequestError("continue_final_message: the final assistant message is not the start of the fake "
                           "engine's answer, which cannot continue it", param="continue_final_message")
    return _pieces(echo[len(done):])


def _continue_prompt(prompt: str) -> list[str] | None:
    """The rest of the echo of a completion prompt's lines before its last, when that last line is the start of
    the echo (the prompt plus the text so far of a resumed stream); None: not a continuation (echo it all)."""
    head, newline, done = prompt.rpartition("\n")
    echo = " ".join(head.split())
    if not newline or not done or not echo.startswith(done):
        return None
    return _pieces(echo[len(done):])


#: The longest string or array, and the deepest nesting, an example has: a schema may ask for a billion items
#: (``minItems: 1e9`` hung the fake process until it was killed) or recurse without end through ``required``;
#: the real engine stops such an answer at ``max_tokens``.
_EXAMPLE_MAX_ITEMS = 4096
_EXAMPLE_MAX_DEPTH = 32


def example_of(schema: Any, root: Any = None, depth: int = 0) -> Any:
    """A small value valid for ``schema`` (first enum value, minimum, every listed property...), cut at
    :data:`_EXAMPLE_MAX_ITEMS` items and :data:`_EXAMPLE_MAX_DEPTH` levels."""
    root = schema if root is None else root
    if not isinstance(schema, dict) or not schema or depth > _EXAMPLE_MAX_DEPTH:
        return "fake"
    if "$ref" in schema:
        ref = str(schema["$ref"])
        for prefix, key in (("#/$defs/", "$defs"), ("#/definitions/", "definitions")):
            if ref.startswith(prefix):
                return example_of((root.get(key) or {}).get(ref[len(prefix) :], {}), root, depth + 1)
        return example_of(root, root, depth + 1) if ref == "#" else "fake"
    if "enum" in schema and schema["enum"]:
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            return example_of(schema[key][0], root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    example = _EXAMPLES.get(kind or ("object" if "properties" in schema else ""), lambda s, r, d: "fake")
    return example(schema, root, depth + 1)


def _example_string(schema: dict[str, Any], root: Any, depth: int) -> str:
    low, high = min(int(schema.get("minLength", 0)), _EXAMPLE_MAX_ITEMS), schema.get("maxLength")
    text = "fake".ljust(low, "e")
    return text[: int(high)] if high is not None else text


def _example_array(schema: dict[str, Any], root: Any, depth: int) -> list[Any]:
    count = min(int(schema.get("minItems", 1 if schema.get("maxItems", 1) else 0)), _EXAMPLE_MAX_ITEMS)
    return [example_of(schema.get("items", {}), root, depth) for _ in range(count)]


_EXAMPLES: dict[str, Any] = {
    "object": lambda s, r, d: {k: example_of(v, r, d) for k, v in (s.get("properties") or {}).items()},
    "array": _example_array,
    "string": _example_string,
    "integer": lambda s, r, d: int(s.get("minimum", 1)),
    "number": lambda s, r, d: float(s.get("minimum", 1.5)),
    "boolean": lambda s, r, d: True,
    "null": lambda s, r, d: None,
}


def _pieces(text: str) -> list[str]:
    """``text`` in word-sized pieces whose concatenation is exactly ``text``."""
    return re.findall(r"\s*\S+|\s+", text)


def _call_text(tag: TagSpec) -> str:
    arguments = example_of(tag.arguments.schema)
    return tag.begin + json.dumps(arguments if isinstance(arguments, dict) else {}) + tag.end


def structured_answer(request: GenerationRequest, parser: str) -> str | None:
    """The fake's answer to tools and output constraints; None: echo as usual."""
    constraint = request.constraint
    if isinstance(constraint, ToolGrammar) and constraint.forced:
        return _call_text(constraint.tags[0])
    turns = request.messages or ()
    if request.tools and turns and turns[-1].role == "user" and "[[tool]]" in turns[-1].content:
        return _call_text(tool_call_grammar(parser, [request.tools[0]["function"]], False).tags[0])
    if turns and turns[-1].role == "tool":
        return f"tool result: {turns[-1].content}"
    if isinstance(constraint, Grammar) and constraint.choices:
        return constraint.choices[0]
    if isinstance(constraint, Grammar) and isinstance(constraint.schema, dict):
        if constraint.schema.get("type") == "object" and not constraint.schema.get("properties"):
            return json.dumps({"text": request.last_user_text()})
        return json.dumps(example_of(constraint.schema))
    return None


class FakeTokens:
    """Words as tokens: id 0 is ``<s>`` (``add_special``), the others are given in order of first sight."""

    def __init__(self) -> None:
        self._words = ["<s>"]
        self._ids = {"<s>": 0}

    def encode(self, text: str, add_special: bool) -> list[int]:
        return [0] * add_special + [self._id(word) for word in text.split()]

    def _id(self, word: str) -> int:
        if word not in self._ids:
            self._ids[word] = len(self._words)
            self._words.append(word)
        return self._ids[word]

    def decode(self, ids: Sequence[int]) -> str:
        check_ids(ids, len(self._words))
        return " ".join(self._words[i] for i in ids)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        return [self._words[i] for i in ids]


class FakeTextGenerator:
    def __init__(self, spec: ModelSpec) -> None:
        self._spec = spec
        self._counters = _Counters()
        self.tokens = FakeTokens()
        self.tool_parser = spec.tool_parser or "hermes"
        self.reports_logprobs = True
        self.context_length: int | None = spec.options.get("context_length")

    def describe(self) -> dict[str, Any]:
        return {"engine": "fake", "task": self._spec.task, "token_delay_s": self._spec.fake.token_delay_s}

    def stats(self) -> dict[str, Any]:
        return self._counters.as_dict()

    def close(self) -> None:
        pass

    def prompt_tokens(self, request: GenerationRequest) -> int:
        """The fake's prompt size: the words of every message (or of the prompt)."""
        text = request.last_user_text()
        return sum(len(turn.content.split()) for turn in request.messages or ()) or len(text.split())

    def chat_prompt(self, request: GenerationRequest, add_generation_prompt: bool = True) -> str:
        turns = [f"{turn.role}: {turn.content}" for turn in request.messages or ()]
        return "\n".join(turns + ["assistant:"] * add_generation_prompt)

    def generate(self, request: GenerationRequest) -> FakeStream:
        text = request.last_user_text()
        inject_faults(text)
        prompt_words = self.prompt_tokens(request)
        param = "messages" if request.messages is not None else "prompt"
        max_tokens = fit_context(prompt_words, request.sampling, self.context_length, param)
        answer = structured_answer(request, self.tool_parser)
        rest = (_continue(text.split(), request) if request.messages is not None else _continue_prompt(text)) \
            if answer is None else None
        words = _pieces(answer) if answer is not None else rest if rest is not None else text.split()
        return FakeStream(
            words, prompt_words, max_tokens, self._spec.fake.token_delay_s, self._counters,
            joined=answer is not None or rest is not None, fault=_mid_stream_fault(text, request.continue_final),
        )


def fake_vector(text: str, dims: int) -> list[float]:
    """A unit vector that depends only on the words of ``text`` (case-insensitive)."""
    total = np.zeros(dims)
    for word in text.lower().split() or [""]:
        seed = int.from_bytes(hashlib.sha256(word.encode("utf-8")).digest()[:8], "little")
        total += np.random.default_rng(seed).standard_normal(dims)
    return [float(x) for x in total / np.linalg.norm(total)]


class FakeEmbedder:
    def __init__(self, spec: ModelSpec) -> None:
        self._spec = spec
        self._counters = _Counters()
        self.matryoshka = bool(spec.options.get("matryoshka", False))
        self.normalizes = True  # fake vectors are unit vectors

    def describe(self) -> dict[str, Any]:
        return {"engine": "fake", "task": self._spec.task, "dims": self._spec.fake.dims}

    def stats(self) -> dict[str, Any]:
        return self._counters.as_dict()

    def close(self) -> None:
        pass

    async def embed(self, texts: Sequence[str], truncate: bool = False) -> EmbeddingResult:
        for text in texts:
            inject_faults(text)
        check_inputs([len(text.split()) for text in texts], self._spec.options.get("max_length"), "input", truncate)
        await asyncio.sleep(self._spec.fake.token_delay_s)
        self._counters.completed += 1
        vectors = [fake_vector(text, self._spec.fake.dims) for text in texts]
        return EmbeddingResult(vectors=vectors, prompt_tokens=sum(len(text.split()) for text in texts))


def load_text_generator(spec: ModelSpec) -> FakeTextGenerator:
    _fake_load(spec)
    return FakeTextGenerator(spec)


def load_embedder(spec: ModelSpec) -> FakeEmbedder:
    _fake_load(spec)
    return FakeEmbedder(spec)
