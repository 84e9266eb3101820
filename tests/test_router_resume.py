"""Resuming a stream (router/path/resume.py): whole events only, progress read back, the continuation body,
and the splice — checked against the fake engine's real SSE output, in process."""

from __future__ import annotations

import json
from typing import Any

import httpx

from modelserver.app import build_app
from modelserver.engines.fake import FakeTextGenerator
from modelserver.spec import build_model_spec
from router.path.framing import ANTHROPIC, OPENAI, framing_of, resumed_framing
from router.path.resume import Splice, StreamLog, continuation, events, fatal_event, plan, progress

WORDS = "alpha beta gamma delta epsilon zeta eta theta"


def app() -> Any:
    spec = build_model_spec("fake", {"engine": "fake", "fake": {"token_delay_s": 0, "load_s": 0}})
    return build_app(spec, FakeTextGenerator(spec))


async def post(body: dict[str, Any], path: str = "/v1/chat/completions") -> bytes:
    transport = httpx.ASGITransport(app=app())
    async with httpx.AsyncClient(transport=transport, base_url="http://m") as client:
        return (await client.post(path, json=body)).content


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "fake", "stream": True, "messages": [{"role": "user", "content": WORDS}], **extra}


def chat_text(raw: bytes) -> str:
    return "".join(e["choices"][0]["delta"].get("content", "") for e in events(raw) if isinstance(e, dict)
                   and e.get("choices"))


def test_stream_log_lets_only_whole_events_through() -> None:
    log = StreamLog()
    assert log.cut(b'data: {"a":1}\n\ndata: {"b"') == b'data: {"a":1}\n\n'
    assert log.cut(b":2}\n") == b""
    assert log.cut(b"\n") == b'data: {"b":2}\n\n'
    assert log.rest() == b"" and events(b"".join(log.sent)) == [{"a": 1}, {"b": 2}]


def test_stream_log_takes_crlf_events_as_sse_starlette_writes_them() -> None:
    log = StreamLog()
    assert log.cut(b'data: {"a":1}\r\n\r\ndata: {"b":2}\r') == b'data: {"a":1}\n\n'  # a CR split from its LF
    assert log.cut(b"\n\r\n") == b'data: {"b":2}\n\n'
    assert events(b"".join(log.sent)) == [{"a": 1}, {"b": 2}]


def test_stream_log_holds_the_closing_done_until_the_stream_ends_cleanly() -> None:
    log = StreamLog()
    assert log.cut(b'data: {"a":1}\n\ndata: [DONE]\n\n') == b'data: {"a":1}\n\n'
    assert log.sent == [b'data: {"a":1}\n\n'] and log.rest() == b"data: [DONE]\n\n"
    odd = StreamLog()  # events after a [DONE]: it was not the end, it goes out in order
    assert odd.cut(b"data: [DONE]\n\n") == b"" and odd.cut(b'data: {"b":2}\n\n') == b'data: [DONE]\n\ndata: {"b":2}\n\n'


def test_only_single_unconstrained_streams_are_resumable() -> None:
    def resumable(path: str = "/v1/chat/completions", **extra: Any) -> bool:
        return plan(path, json.dumps(chat_body(**extra)).encode(), 512) is not None

    assert resumable() and resumable(response_format={"type": "text"}, n=1)
    assert not resumable(stream=False) and not resumable(n=2) and not resumable(logprobs=True)
    assert not resumable(tools=[{"type": "function", "function": {"name": "f"}}])
    assert not resumable(response_format={"type": "json_object"}) and not resumable(guided_choice=["a"])
    assert not resumable("/v1/embeddings")
    assert plan("/v1/chat/completions", json.dumps(chat_body()).encode(), 512, chat_ok=False) is None
    completion = {"model": "fake", "stream": True, "prompt": "x"}
    assert plan("/v1/completions", json.dumps(completion).encode(), 512) is not None


async def test_a_chat_stream_cut_after_three_words_resumes_into_the_same_answer() -> None:
    whole = await post(chat_body(max_tokens=6, stream_options={"include_usage": True}))
    log = StreamLog()
    for event in whole.split(b"\n\n")[:4]:  # the opening chunk and three words reached the client
        log.cut(event + b"\n\n")
    seen = progress(log)
    assert seen.text == "alpha beta gamma" and seen.tokens == 3 and seen.role_sent and not seen.done
    plan_ = plan("/v1/chat/completions", json.dumps(chat_body(max_tokens=6, stream_options={"include_usage": True}))
                 .encode(), 512)
    assert plan_ is not None
    body = continuation(plan_, seen)
    assert body is not None and body["max_tokens"] == 3 and body["continue_final_message"] is True
    assert body["messages"][-1] == {"role": "assistant", "content": "alpha beta gamma"}
    splice = Splice(seen)
    rest = splice.feed(await post(body)) + splice.rest()
    client_saw = b"".join(log.sent) + rest
    assert chat_text(client_saw) == chat_text(whole) == "alpha beta gamma delta epsilon zeta"
    parsed = [e for e in events(client_saw) if isinstance(e, dict)]
    assert {e["id"] for e in parsed} == {seen.id} and {e["created"] for e in parsed} == {seen.created}
    assert sum("role" in c.get("delta", {}) for e in parsed for c in e["choices"]) == 1
    assert events(client_saw).count("[DONE]") == 1
    usage = [e["usage"] for e in parsed if e.get("usage")]
    assert usage == [e["usage"] for e in events(whole) if isinstance(e, dict) and e.get("usage")]  # summed back


async def test_a_completion_resumes_with_prompt_plus_text() -> None:
    original = {"model": "fake", "stream": True, "prompt": WORDS, "max_tokens": 5}
    whole = await post(original, "/v1/completions")
    log = StreamLog()
    for event in whole.split(b"\n\n")[:2]:
        log.cut(event + b"\n\n")
    seen = progress(log)
    plan_ = plan("/v1/completions", json.dumps(original).encode(), 512)
    assert plan_ is not None
    body = continuation(plan_, seen)
    assert body is not None and body["prompt"] == WORDS + seen.text and body["max_tokens"] == 3
    assert seen.text == "alpha beta"
    unlimited = plan("/v1/completions", json.dumps({**original, "max_tokens": None}).encode(), 512)
    assert unlimited is not None  # no limit asked: none sent, the server caps at what its context leaves
    body = continuation(unlimited, seen)
    assert body is not None and body.get("max_tokens") is None and body["prompt"] == WORDS + seen.text


def test_nothing_left_to_generate_gives_no_continuation() -> None:
    plan_ = plan("/v1/chat/completions", json.dumps(chat_body(max_tokens=2)).encode(), 512)
    assert plan_ is not None
    log = StreamLog()
    log.cut(b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
            b'data: {"id":"x","choices":[{"index":0,"delta":{"content":" b"}}]}\n\n')
    assert continuation(plan_, progress(log)) is None


def test_a_fatal_error_event_is_recognised() -> None:
    fatal = b'data: {"error":{"message":"engine failed beyond repair","code":"engine_fatal"}}\n\n'
    assert fatal_event(fatal) and not fatal_event(fatal.replace(b"engine_fatal", b"engine_error"))


SEAM_TEXT = "naïve über 日本語 😀 alpha beta gamma delta"  # several UTF-8 bytes per character in the first words


def completion_text(raw: bytes) -> str:
    return "".join(e["choices"][0].get("text") or "" for e in events(raw) if isinstance(e, dict) and e.get("choices"))


async def stitched_at_every_cut(body: dict[str, Any], path: str = "/v1/chat/completions") -> tuple[bytes, set[str]]:
    """Cut the unbroken stream of ``body`` at every byte, resume each cut on a fresh fake, and return the
    unbroken stream and the distinct stitched texts (one, when every seam is exact)."""
    text_of = chat_text if path == "/v1/chat/completions" else completion_text
    whole = await post(body, path)
    plan_ = plan(path, json.dumps(body).encode(), 512)
    assert plan_ is not None
    stitched: dict[int, str] = {}
    for cut in range(len(whole)):  # before the first token, mid-word, mid-character, at the last token
        log = StreamLog()
        log.cut(whole[:cut])
        sent = b"".join(log.sent)
        if len(sent) in stitched:
            continue  # a cut inside the same event: the client holds the same whole events
        seen = progress(log)
        rest = continuation(plan_, seen)
        if rest is None or seen.done or seen.finish is not None:
            stitched[len(sent)] = text_of(sent + log.rest())
            continue
        splice = Splice(seen)
        stitched[len(sent)] = text_of(sent + splice.feed(await post(rest, path)) + splice.rest())
    return whole, set(stitched.values())


async def test_the_seam_is_exact_at_every_cut_point_of_a_chat_stream() -> None:
    body = {**chat_body(stream_options={"include_usage": True}), "messages": [{"role": "user", "content": SEAM_TEXT}]}
    whole, texts = await stitched_at_every_cut(body)
    assert texts == {chat_text(whole)} == {SEAM_TEXT}


async def test_the_seam_is_exact_at_every_cut_point_under_max_tokens() -> None:
    body = {**chat_body(max_tokens=5), "messages": [{"role": "user", "content": SEAM_TEXT}]}
    whole, texts = await stitched_at_every_cut(body)
    assert texts == {chat_text(whole)} == {"naïve über 日本語 😀 alpha"}


async def test_the_seam_is_exact_right_after_a_stop_string_begins() -> None:
    # "alpha" may begin the stop string: the server holds it back until "gamma" shows it does not match;
    # a cut while it is held resumes before it, and the fresh stop matcher sees the rest whole
    body = {**chat_body(stop=["alpha beta zeta"]), "messages": [{"role": "user", "content": SEAM_TEXT}]}
    whole, texts = await stitched_at_every_cut(body)
    assert texts == {chat_text(whole)} == {SEAM_TEXT}
    body = {**chat_body(stop=["beta gamma"]), "messages": [{"role": "user", "content": SEAM_TEXT}]}
    whole, texts = await stitched_at_every_cut(body)
    assert texts == {chat_text(whole)} == {"naïve über 日本語 😀 alpha "}


async def test_the_seam_is_exact_mid_word_where_a_stop_string_begins_inside_a_word() -> None:
    # "ta gamma" begins inside "beta": the server sends " be" and holds "ta" back; a cut there resumes mid-word
    body = {**chat_body(stop=["ta gamma"]), "messages": [{"role": "user", "content": SEAM_TEXT}]}
    whole, texts = await stitched_at_every_cut(body)
    assert texts == {chat_text(whole)} == {"naïve über 日本語 😀 alpha be"}
    body = {**chat_body(stop=["本語 😀 alpha zeta"]), "messages": [{"role": "user", "content": SEAM_TEXT}]}
    whole, texts = await stitched_at_every_cut(body)  # held from inside a CJK word: cut between its characters
    assert texts == {chat_text(whole)} == {SEAM_TEXT}


COMPLETION = {"model": "fake", "stream": True, "prompt": SEAM_TEXT + "\n"}


async def test_the_seam_is_exact_at_every_cut_point_of_a_completion_stream() -> None:
    whole, texts = await stitched_at_every_cut({**COMPLETION, "stream_options": {"include_usage": True}},
                                               "/v1/completions")
    assert texts == {completion_text(whole)} == {SEAM_TEXT}
    whole, texts = await stitched_at_every_cut({**COMPLETION, "max_tokens": 5}, "/v1/completions")
    assert texts == {completion_text(whole)} == {"naïve über 日本語 😀 alpha"}  # up to the last token


async def test_the_seam_of_a_completion_is_exact_where_a_stop_string_begins() -> None:
    for stop, expected in ((["alpha beta zeta"], SEAM_TEXT), (["beta gamma"], "naïve über 日本語 😀 alpha "),
                           (["ta gamma"], "naïve über 日本語 😀 alpha be")):
        whole, texts = await stitched_at_every_cut({**COMPLETION, "stop": stop}, "/v1/completions")
        assert texts == {completion_text(whole)} == {expected}, stop


def test_a_resumed_stream_is_framed_by_its_protocol_and_a_responses_error_is_its_own() -> None:
    assert resumed_framing("/v1/chat/completions?x=1") is OPENAI and resumed_framing("/v1/messages") is ANTHROPIC
    responses = resumed_framing("/v1/responses")
    assert framing_of("/v1/responses") is None  # relayed plainly, its bytes pass through
    failed = b'event: response.failed\ndata: {"type":"response.failed","response":{"error":{"code":"engine_fatal"}}}'
    chunk = b'event: response.output_text.delta\ndata: {"delta":"a"}\n\n' + failed
    assert fatal_event(chunk) and chunk.find(responses.error_starts) == chunk.index(b"event: response.failed")
    assert responses.error("cut", "backend_error") == OPENAI.error("cut", "backend_error")  # the router's own
