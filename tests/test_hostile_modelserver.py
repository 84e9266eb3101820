"""Hostile and oversized input to the model server: a 400 naming what to fix, never a 500, and it keeps serving.

Three layers: the pure parts (the GGUF reader, the context check, the JSON depth scan); the
fake engine in process for body shapes and the encoders' truncation policy; and the real
SmolLM2 pipeline behind ``python -m modelserver`` (one server for the module, its context
lowered to 512 tokens with ``options.context_length`` so that filling it takes a second) for
the parameter sweep and the context checks. Only invariants are asserted: status, the error
shape, the numbers the message must name, usage within the context.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from modelserver_helpers import ModelServerProcess, modelserver

from modelserver.app import build_app
from modelserver.engines.base import SamplingParams
from modelserver.engines.context import chunks, configured_context, fit_context
from modelserver.engines.fake import FakeEmbedder, FakeTextGenerator
from modelserver.engines.fake_media import FakeReranker, FakeTranscriber, FakeVisionGenerator
from modelserver.errors import ContextLengthExceeded, LoadError, RequestError
from modelserver.modelfiles import context_length, gguf_context_length
from modelserver.protocol import check_depth
from modelserver.spec import build_model_spec

MODELS = Path(__file__).resolve().parent.parent / "models"
ERROR_KEYS = {"message", "type", "param", "code"}


def assert_400(response: httpx.Response, param: str | None, *needles: str, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape, ``param`` naming the field (or a path inside it), the message holding ``needles``."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS
    assert error["type"] == "invalid_request_error"
    if param is None:
        assert error["param"] is None
    else:
        assert isinstance(error["param"], str) and error["param"].startswith(param), error
    for needle in needles:
        assert needle in error["message"], error["message"]
    if code is not None:
        assert error["code"] == code
    return dict(error)


# -- pure parts -------------------------------------------------------------------------------------


def test_the_demo_gguf_declares_a_context_of_8192(demo_gguf: Path) -> None:
    assert gguf_context_length(demo_gguf) == 8192
    assert context_length(demo_gguf) == 8192


def test_ir_folders_give_max_position_embeddings_or_their_language_models(tmp_path: Path) -> None:
    assert context_length(MODELS / "qwen2-tools-tiny-ov") == 4096
    assert context_length(MODELS / "llava-tiny-ov") == 2048  # text_config.max_position_embeddings
    (tmp_path / "config.json").write_text(json.dumps({"n_positions": 1024}))
    assert context_length(tmp_path) == 1024
    (tmp_path / "empty").mkdir()
    assert context_length(tmp_path / "empty") is None


def test_a_file_that_is_not_gguf_has_no_context(tmp_path: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"NOPE" + b"\0" * 64)
    assert gguf_context_length(fake) is None


def test_context_length_option_may_only_lower_the_models() -> None:
    assert configured_context("m", 8192, None) == 8192
    assert configured_context("m", 8192, 512) == 512
    assert configured_context("m", None, 512) == 512
    with pytest.raises(LoadError, match=r"options.context_length: 9000 is above the model's own .* 8192"):
        configured_context("m", 8192, 9000)
    with pytest.raises(LoadError, match="expected an integer >= 1"):
        configured_context("m", 8192, 0)


def sampling(max_tokens: int, given: bool = True, min_tokens: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, fit_to_context=not given, min_tokens=min_tokens)


def test_fit_context_keeps_a_request_that_fits_and_caps_one_without_max_tokens() -> None:
    assert fit_context(100, sampling(400), 512, "messages") == 400
    assert fit_context(100, sampling(412), 512, "messages") == 412  # exactly full
    assert fit_context(500, sampling(64, given=False), 512, "messages") == 12  # capped at what is left
    assert fit_context(10, sampling(64, given=False), 512, "messages") == 64
    assert fit_context(10**6, sampling(64), None, "messages") == 64  # no known context: nothing to check


@pytest.mark.parametrize(("prompt", "params", "param", "numbers"), [
    (100, sampling(413), "max_tokens", ["512", "513 tokens", "100 in the messages", "413 in the completion"]),
    (512, sampling(64, given=False), "messages", ["512", "513 tokens", "512 in the messages"]),
    (600, sampling(1), "messages", ["600 in the messages"]),
])
def test_fit_context_refuses_naming_both_numbers(prompt: int, params: SamplingParams, param: str,
                                                 numbers: list[str]) -> None:
    with pytest.raises(ContextLengthExceeded) as caught:
        fit_context(prompt, params, 512, "messages")
    assert caught.value.param == param
    assert caught.value.code == "context_length_exceeded"
    for number in numbers:
        assert number in caught.value.message


def test_min_tokens_above_the_completions_limit_is_refused() -> None:
    with pytest.raises(RequestError, match="min_tokens: must be at most .* 12 tokens, got 20"):
        fit_context(500, sampling(64, given=False, min_tokens=20), 512, "prompt")


def test_chunks_cut_before_spaces_and_reassemble_the_text() -> None:
    text = "word " * 1000 + "x" * 3000
    pieces = list(chunks(text, 100))
    assert "".join(pieces) == text
    assert all(len(piece) <= 100 for piece in pieces)
    assert all(piece.startswith(" ") for piece in pieces[1:10])


@pytest.mark.parametrize(("body", "refused"), [
    (b'{"a":' + b"[" * 63 + b"]" * 63 + b"}", False),  # 64 levels with the object
    (b'{"a":' + b"[" * 64 + b"]" * 64 + b"}", True),
    (b'{"a":"' + b"[" * 500 + b'"}', False),  # brackets inside a string are text
    (b'{"a":"\\"' + b"{" * 500 + b'"}', False),  # an escaped quote does not end the string
    (b'{"a":[' + b"[]," * 100_000 + b"[]]}", False),  # many, but shallow
])
def test_check_depth(body: bytes, refused: bool) -> None:
    json.loads(body)  # each case is valid JSON
    if refused:
        with pytest.raises(RequestError, match="nested too deeply: more than 64 levels"):
            check_depth(body)
    else:
        check_depth(body)


# -- fake engine, in process ------------------------------------------------------------------------


def fake_client(task: str, engine: Any, **options: Any) -> httpx.AsyncClient:
    spec = build_model_spec("fake", {"engine": "fake", "task": task, "fake": {"token_delay_s": 0, "load_s": 0},
                                     "options": options})
    app = build_app(spec, engine(spec))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://modelserver")


@pytest.fixture
async def fake_llm() -> AsyncIterator[httpx.AsyncClient]:
    async with fake_client("llm", FakeTextGenerator, context_length=20) as client:
        yield client


USER = [{"role": "user", "content": "hello there"}]


@pytest.mark.parametrize(("body", "needle"), [
    (b'{"messages": [{"role": "user", "content": "hi \xff\xfe"}]}', "not valid JSON"),  # invalid UTF-8
    (b'{"messages": [{"role": "user", "content": "hi\x00"}]}', "not valid JSON"),  # a raw NUL in a string
    (b"\x00" * 32, "not valid JSON"),
    (b"[1, 2]", "must be a JSON object, got list"),
    (b'"a string"', "must be a JSON object, got str"),
    (b"null", "must be a JSON object, got NoneType"),
    (b"", "empty"),
    (b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"{\"a\":" * 65 + b"1" + b"}" * 65 + b"}",
     "nested too deeply"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": Infinity}', "finite"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "seed": ' + b"9" * 5000 + b"}", "number too long"),
    (b'{"messages": [{"role": "user", "content": "a \\ud800 b"}]}', "lone UTF-16 surrogate"),
    (b'{"messages": [{"role": "user", "content": "a \xed\xa0\x80 b"}]}', "lone UTF-16 surrogate"),
    ('{"messages": [{"role": "user", "content": "a \ud800 b"}]}'.encode("utf-16", "surrogatepass"),
     "lone UTF-16 surrogate"),
])
async def test_bad_bodies_are_400_and_the_server_keeps_serving(fake_llm: httpx.AsyncClient, body: bytes,
                                                                needle: str) -> None:
    response = await fake_llm.post("/v1/chat/completions", content=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and needle in error["message"]
    assert (await fake_llm.post("/v1/chat/completions", json={"messages": USER})).status_code == 200


async def test_a_surrogate_pair_and_a_utf16_body_are_text(fake_llm: httpx.AsyncClient) -> None:
    pair = b'{"messages": [{"role": "user", "content": "smile \\ud83d\\ude00"}]}'
    assert (await fake_llm.post("/v1/chat/completions", content=pair)).json()["choices"][0]["message"]["content"]
    utf16 = json.dumps({"messages": USER}).encode("utf-16")
    assert (await fake_llm.post("/v1/chat/completions", content=utf16)).status_code == 200


async def test_a_nul_escaped_in_json_is_text(fake_llm: httpx.AsyncClient) -> None:
    response = await fake_llm.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a\0b"}]})
    assert response.status_code == 200


async def test_only_an_assistant_message_may_go_without_content(fake_llm: httpx.AsyncClient) -> None:
    # as OpenAI: a user message without content was answered as if it were empty
    for role in ("user", "system", "tool"):
        answer = await fake_llm.post("/v1/chat/completions", json={"messages": [{"role": role}]})
        assert_400(answer, "messages[0]", f'a {role} message needs "content"')
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": calls},
               {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    assert (await fake_llm.post("/v1/chat/completions", json={"messages": history})).status_code == 200


async def test_fake_context_is_checked_like_the_real_one(fake_llm: httpx.AsyncClient) -> None:
    long = [{"role": "user", "content": "w " * 30}]
    assert_400(await fake_llm.post("/v1/chat/completions", json={"messages": long}), "messages",
               "maximum context length is 20 tokens", "30 in the messages", code="context_length_exceeded")
    assert_400(await fake_llm.post("/v1/completions", json={"prompt": "w " * 30}), "prompt", "30 in the prompt")
    over = await fake_llm.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 19})
    assert_400(over, "max_tokens", "21 tokens (2 in the messages, 19 in the completion)")
    capped = await fake_llm.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w " * 15}]})
    assert capped.json()["usage"]["completion_tokens"] <= 5


async def test_a_continued_final_message_is_capped_at_what_is_left_not_refused(fake_llm: httpx.AsyncClient) -> None:
    # a stream the router resumes: the answer so far sits in the prompt, max_tokens still counts the whole answer
    history = [{"role": "user", "content": "w " * 10}, {"role": "assistant", "content": "w " * 5}]
    body = {"messages": history, "max_tokens": 10, "continue_final_message": True}
    answer = await fake_llm.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] <= 20 - 15


async def test_fake_embeddings_refuse_an_input_above_max_length_unless_truncate() -> None:
    async with fake_client("embeddings", FakeEmbedder, max_length=8) as client:
        texts = ["short one", "w " * 9]
        refused = await client.post("/v1/embeddings", json={"input": texts})
        assert_400(refused, "input", "input[1]: 9 tokens", "maximum input of 8", "truncate",
                   code="context_length_exceeded")
        assert (await client.post("/v1/embeddings", json={"input": texts, "truncate": True})).status_code == 200
        assert_400(await client.post("/v1/embeddings", json={"input": "x", "truncate": "yes"}), "truncate")


async def test_embeddings_take_at_most_max_inputs_a_request_on_every_route() -> None:
    # each input answers ~8 KB of JSON whatever its length: 100000 one-letter inputs made an 810 MB answer
    from modelserver.api.embeddings import MAX_INPUTS

    async with fake_client("embeddings", FakeEmbedder) as client:
        assert (await client.post("/v1/embeddings", json={"input": ["a"] * MAX_INPUTS})).status_code == 200
        too_many = ["a"] * (MAX_INPUTS + 1)
        assert_400(await client.post("/v1/embeddings", json={"input": too_many}), "input",
                   f"at most {MAX_INPUTS} inputs a request, got {MAX_INPUTS + 1}", "several requests")
        ollama = await client.post("/ollama/api/embed", json={"input": too_many})
        assert ollama.status_code == 400 and f"at most {MAX_INPUTS} inputs" in ollama.json()["error"]
        assert (await client.post("/v1/embeddings", json={"input": "still serving"})).status_code == 200


async def test_rerank_takes_at_most_max_documents_a_request() -> None:
    # 100000 one-word documents kept the fake engine busy until the router killed it as hung, and the real
    # rerank-tiny for more than the router's 600 s request_timeout_s
    from modelserver.api.rerank import MAX_DOCUMENTS

    async with fake_client("rerank", FakeReranker) as client:
        many = {"query": "q", "documents": ["a"] * MAX_DOCUMENTS}
        assert (await client.post("/v1/rerank", json=many)).status_code == 200
        too_many = {"query": "q", "documents": ["a"] * 100_000}
        for path in ("/v1/rerank", "/v2/rerank"):
            assert_400(await client.post(path, json=too_many), "documents",
                       f"at most {MAX_DOCUMENTS} documents a request, got 100000", "several requests")
        assert (await client.post("/v1/rerank", json={"query": "q", "documents": ["still serving"]})).status_code == 200


def silent_flac(minutes: int, rate: int = 8000) -> bytes:
    """``minutes`` of silence: about 1.5 KB a minute, whatever it decodes to."""
    import numpy as np
    import soundfile

    buffer = io.BytesIO()
    with soundfile.SoundFile(buffer, "w", samplerate=rate, channels=1, format="FLAC", subtype="PCM_16") as f:
        for _ in range(minutes):
            f.write(np.zeros(rate * 60, dtype=np.int16))
    return buffer.getvalue()


async def test_audio_longer_than_max_audio_s_is_refused_before_it_is_decoded() -> None:
    # a 917 KB FLAC of ten hours' silence took the model server to 5.6 GB while it was decoded whole
    from modelserver.audio import MAX_AUDIO_S

    def upload(data: bytes) -> dict[str, Any]:
        return {"files": {"file": ("a.flac", data, "audio/flac")}, "data": {"model": "fake"}}

    async with fake_client("transcription", FakeTranscriber) as client:
        hours = silent_flac(MAX_AUDIO_S // 60 + 1)
        assert len(hours) < 200_000
        for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
            refused = await client.post(path, **upload(hours))
            assert_400(refused, "file", f"longer than {MAX_AUDIO_S} s", "send it in parts")
        fine = await client.post("/v1/audio/transcriptions", **upload(silent_flac(2)))
        assert fine.status_code == 200 and fine.json()["usage"]["seconds"] == 120


def test_audio_is_decoded_in_blocks_and_refused_once_past_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np
    import soundfile

    from modelserver import audio

    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros((44_100 * 3, 2), dtype=np.float32), 44_100, format="WAV")
    decoded = audio.decode_audio(buffer.getvalue())  # stereo 44.1 kHz, resampled block by block
    assert decoded.rate == 16_000 and abs(len(decoded.samples) - 48_000) <= 16
    monkeypatch.setattr(audio, "MAX_AUDIO_S", 2)
    with pytest.raises(RequestError, match="longer than 2 s"):
        audio.decode_audio(buffer.getvalue())
    monkeypatch.setattr(audio, "MAX_AUDIO_S", 3600)
    odd = io.BytesIO()
    soundfile.write(odd, np.zeros(1000, dtype=np.float32), 1_000_000, format="WAV")  # a header, not audio
    with pytest.raises(RequestError, match="sample rate .1000000 Hz. is not one of audio"):
        audio.decode_audio(odd.getvalue())
    short = io.BytesIO()  # 100 samples: the real Whisper's feature extractor failed with a 500 naming its source
    soundfile.write(short, np.zeros(100, dtype=np.float32), 16_000, format="WAV")
    with pytest.raises(RequestError, match=r"too short \(0.006 s\); the shortest .* is 0.1 s"):
        audio.decode_audio(short.getvalue())


async def test_a_requests_images_are_bounded_together_not_only_each(monkeypatch: pytest.MonkeyPatch) -> None:
    # a blank 8000x8000 PNG is 62 KB: eight of them (663 KB of JSON) took the model server to 2 GB
    from PIL import Image

    from modelserver import images

    assert images.MAX_REQUEST_PIXELS >= images.MAX_IMAGE_PIXELS
    monkeypatch.setattr(images, "MAX_REQUEST_PIXELS", 3 * 64 * 64)  # three 64x64 images, not four
    buffer = io.BytesIO()
    Image.new("L", (64, 64)).save(buffer, "PNG")
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(
        buffer.getvalue()).decode()}}

    def ask(count: int) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}] + [part] * count}]}

    async with fake_client("vlm", FakeVisionGenerator) as client:
        assert (await client.post("/v1/chat/completions", json=ask(3))).status_code == 200
        assert_400(await client.post("/v1/chat/completions", json=ask(4)), "messages[0].content[4].image_url.url",
                   f"above {3 * 64 * 64} pixels together", "fewer or smaller images")
        anthropic = {"max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": part["image_url"]["url"].partition(",")[2]}}] * 4}]}
        refused = await client.post("/v1/messages", json=anthropic)
        assert refused.status_code == 400 and "pixels together" in refused.json()["error"]["message"]
        assert (await client.post("/v1/chat/completions", json=ask(1))).status_code == 200


def _schema_chat(schema: Any) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


@pytest.mark.parametrize(("schema", "says"), [
    ({"$ref": "#"}, "schema.$ref: # leads back to itself"),  # the grammar builder recursed to Python's limit: a 500
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "leads back to itself"),
])
async def test_a_schema_of_references_alone_that_loop_is_a_400(fake_llm: httpx.AsyncClient, schema: Any,
                                                                  says: str) -> None:
    assert_400(await fake_llm.post("/v1/chat/completions", json=_schema_chat(schema)), "response_format", says)


@pytest.mark.parametrize("schema", [
    {"type": "array", "minItems": 10**9, "items": {"type": "integer"}},  # the fake built 1e9 items: killed as hung
    {"type": "string", "minLength": 10**9},
    {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
     "$ref": "#/$defs/n"},  # no finite answer: the fake's example recursed to Python's limit, a 500
    {"anyOf": [{"$ref": "#"}, {"type": "string"}]},  # left to XGrammar's own schema support
])
async def test_a_schema_asking_for_endless_output_is_answered_within_max_tokens(fake_llm: httpx.AsyncClient,
                                                                                  schema: Any) -> None:
    answer = await fake_llm.post("/v1/chat/completions", json=_schema_chat(schema))
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] <= 8


async def test_fake_rerank_refuses_a_pair_above_max_length_unless_truncate() -> None:
    async with fake_client("rerank", FakeReranker, max_length=8) as client:
        body = {"query": "a b c", "documents": ["d e", "f " * 6]}
        assert_400(await client.post("/v1/rerank", json=body), "documents", "documents[1]: 9 tokens",
                   code="context_length_exceeded")
        assert (await client.post("/v1/rerank", json={**body, "truncate": True})).status_code == 200
        assert_400(await client.post("/v1/rerank", json={**body, "top_n": 0}), "top_n")


# -- the real pipeline ----------------------------------------------------------------------------

CONTEXT = 512


@pytest.fixture(scope="module")
def server(demo_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelServerProcess]:
    cache = tmp_path_factory.mktemp("ov-cache")
    raw = {"path": str(demo_gguf), "cache_dir": str(cache), "default_max_tokens": 64,
           "options": {"context_length": CONTEXT}}
    with modelserver(spec=build_model_spec("smollm2", raw), ready_timeout_s=180) as running:
        yield running


@pytest.fixture(scope="module")
def http(server: ModelServerProcess) -> Iterator[httpx.Client]:
    with server.client(timeout_s=120) as client:
        yield client


def still_serving(server: ModelServerProcess, http: httpx.Client) -> None:
    """The same process answers a normal request (nothing was restarted or wedged)."""
    pid = server.pid
    ok = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1})
    assert ok.status_code == 200, ok.text
    assert server.proc.poll() is None and server.pid == pid


CHAT_SWEEP: list[tuple[str, Any, str]] = [
    # (field, bad value, a needle of the message: the range or the reason)
    ("max_tokens", 0, "greater than or equal to 1"),
    ("max_tokens", -1, "greater than or equal to 1"),
    ("max_tokens", 10**20, "less than or equal to 2147483647"),
    ("max_tokens", 1.5, "valid integer"),
    ("max_tokens", "10", "valid integer"),
    ("max_tokens", CONTEXT + 1, f"maximum context length is {CONTEXT} tokens"),
    ("max_completion_tokens", 0, "greater than or equal to 1"),
    ("max_completion_tokens", 2**64, "less than or equal to"),
    ("temperature", -0.1, "greater than or equal to 0"),
    ("temperature", 2.5, "less than or equal to 2"),
    ("temperature", "hot", "valid number"),
    ("top_p", 0, "greater than 0"),
    ("top_p", 1.5, "less than or equal to 1"),
    ("top_k", 0, "greater than or equal to 1"),
    ("top_k", -1, "greater than or equal to 1"),
    ("top_k", 2**40, "less than or equal to"),
    ("seed", -(2**63) - 1, "greater than or equal to -9223372036854775808"),  # -1 is a random seed
    ("seed", 2**64, "less than or equal to 18446744073709551615"),
    ("seed", 2**70, "less than or equal to 18446744073709551615"),
    ("seed", 1.5, "valid integer"),
    ("seed", "7", "valid integer"),
    ("presence_penalty", -2.5, "greater than or equal to -2"),
    ("presence_penalty", 3, "less than or equal to 2"),
    ("frequency_penalty", -3, "greater than or equal to -2"),
    ("frequency_penalty", 2.5, "less than or equal to 2"),
    ("repetition_penalty", 0, "greater than 0"),
    ("repetition_penalty", 11, "less than or equal to 10"),
    ("min_tokens", -1, "greater than or equal to 0"),
    ("min_tokens", 10**20, "less than or equal to"),
    ("min_tokens", 100, "at most the completion's limit"),  # with max_tokens 5 below
    ("n", 0, "greater than or equal to 1"),
    ("n", 129, "less than or equal to 128"),
    ("n", 9, "max_n"),
    ("top_logprobs", -1, "greater than or equal to 0"),
    ("top_logprobs", 21, "less than or equal to 20"),
    ("top_logprobs", 5, "only the chosen token"),
    ("logprobs", "yes", "valid boolean"),
    ("stop", [""], "non-empty"),
    ("stop", ["a"] * 17, "at most 16"),
    ("stop", "x" * 1025, "at most 1024 characters"),
    ("stop", 5, "non-empty string"),
    ("logit_bias", {"50256": -100}, "not supported"),
    ("logit_bias", "none", "valid dictionary"),
    ("stream", "yes", "valid boolean"),
    ("stream_options", {"include_usage": "yes"}, "valid boolean"),
    ("ignore_eos", 1, "valid boolean"),
    ("messages", [], "at least 1"),
    ("messages", "hi", "valid list"),
    ("messages", [{"role": "wizard", "content": "hi"}], "'system'"),
    ("messages", [{"role": "user", "content": 5}], "must be a string or a list of content parts"),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "not supported by a text model"),
    ("tools", "x", "valid list"),
    ("tool_choice", "sometimes", "none"),
    ("response_format", {"type": "xml"}, "json_object"),
    ("guided_choice", [], "at least 1"),
    ("guided_grammar", "root ::= x", "grammars are not accepted"),
    ("functions", [{"name": "f"}], "send them as `tools`"),
    ("user", 5, "valid string"),
    ("continue_final_message", True, "must be the assistant's answer"),
]


@pytest.mark.real_model
@pytest.mark.parametrize(("field", "value", "needle"), CHAT_SWEEP, ids=[f"{f}={str(v)[:12]}" for f, v, _ in CHAT_SWEEP])
def test_chat_parameter_out_of_range_is_400_naming_it(server: ModelServerProcess, http: httpx.Client, field: str,
                                                      value: Any, needle: str) -> None:
    body: dict[str, Any] = {"messages": USER, "max_tokens": 5, field: value}
    if field in ("max_tokens", "max_completion_tokens"):
        body = {"messages": USER, field: value}
    error = assert_400(http.post("/v1/chat/completions", json=body), field, needle)
    assert "engine error" not in error["message"] and "incompatible function arguments" not in error["message"]
    still_serving(server, http)


COMPLETION_SWEEP: list[tuple[str, Any, str]] = [
    ("prompt", 5, "valid string"),
    ("prompt", [], "non-empty list"),
    ("prompt", ["a"] * 33, "33 prompts x n=1"),
    ("prompt", ["a", ""], "empty"),
    ("prompt", "", "empty"),
    ("logprobs", -1, "greater than or equal to 0"),
    ("logprobs", 6, "less than or equal to 5"),
    ("logprobs", 2, "not supported"),
    ("best_of", 0, "greater than or equal to 1"),
    ("best_of", 2, "not supported"),
    ("echo", "x", "valid boolean"),
    ("suffix", "tail", "not supported"),
    ("max_tokens", CONTEXT, f"maximum context length is {CONTEXT} tokens"),
    ("seed", -(2**63) - 1, "greater than or equal to -9223372036854775808"),  # -1 is a random seed
]


@pytest.mark.real_model
@pytest.mark.parametrize(("field", "value", "needle"), COMPLETION_SWEEP,
                         ids=[f"{f}={str(v)[:12]}" for f, v, _ in COMPLETION_SWEEP])
def test_completion_parameter_out_of_range_is_400_naming_it(server: ModelServerProcess, http: httpx.Client,
                                                            field: str, value: Any, needle: str) -> None:
    body: dict[str, Any] = {"prompt": "Hello", "max_tokens": 5, field: value}
    assert_400(http.post("/v1/completions", json=body), field, needle)
    still_serving(server, http)


@pytest.mark.real_model
def test_extreme_but_valid_values_reach_the_engine_and_answer(http: httpx.Client) -> None:
    body = {"messages": USER, "max_tokens": 2, "temperature": 2, "top_p": 1e-9, "top_k": 2**31 - 1,
            "seed": 2**64 - 1, "n": 2, "presence_penalty": -2, "frequency_penalty": 2, "repetition_penalty": 10,
            "min_tokens": 2, "stop": ["x" * 1024] * 16}
    answer = http.post("/v1/chat/completions", json=body)  # n = 2 seeds wrap past 2**64 - 1
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"]) == 2


@pytest.mark.real_model
def test_a_2_mb_prompt_is_400_context_length_exceeded_without_generating(server: ModelServerProcess,
                                                                        http: httpx.Client) -> None:
    words = 400_000  # ~2 MB: far past the tokenizer's own cut at 8192 tokens
    started = time.monotonic()
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * words}]})
    elapsed_s = time.monotonic() - started
    error = assert_400(response, "messages", f"maximum context length is {CONTEXT} tokens",
                       code="context_length_exceeded")
    in_messages = int(error["message"].split("(")[1].split(" in the messages")[0])
    assert in_messages >= words  # counted whole: not the 8192 the tokenizer cuts at
    print(f"2 MB prompt: 400 after {elapsed_s * 1000:.0f} ms")  # the bench measures it; no timing assertion
    still_serving(server, http)


@pytest.mark.real_model
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_prompt_past_4_mib_is_refused_from_its_start_with_an_estimate(server: ModelServerProcess,
                                                                      http: httpx.Client, path: str) -> None:
    words = 1_000_000  # 5 MB: only its first 4 MiB are tokenized, the rest extrapolated
    text = "word " * words
    body = {"messages": [{"role": "user", "content": text}]} if "chat" in path else {"prompt": text}
    error = assert_400(http.post(path, json=body), "messages" if "chat" in path else "prompt",
                       f"maximum context length is {CONTEXT} tokens", "you requested about ",
                       code="context_length_exceeded")
    estimate = int(error["message"].split("(about ")[1].split(" ")[0])
    assert 0.9 * words <= estimate <= 1.1 * words
    still_serving(server, http)


@pytest.mark.real_model
def test_ten_thousand_messages_are_400_not_an_answer_to_a_cut_prompt(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": f"message number {i}"} for i in range(10_000)]
    assert_400(http.post("/v1/chat/completions", json={"messages": messages}), "messages",
               code="context_length_exceeded")


@pytest.mark.real_model
def test_prompt_plus_max_tokens_over_the_context_is_400_on_max_tokens(http: httpx.Client) -> None:
    prompt = "word " * 400  # about 400 tokens: fits alone
    response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 200})
    error = assert_400(response, "max_tokens", f"maximum context length is {CONTEXT} tokens", "200 in the completion",
                       code="context_length_exceeded")
    prompt_tokens = int(error["message"].split("(")[1].split(" in the prompt")[0])
    assert prompt_tokens + 200 > CONTEXT
    assert f"you requested {prompt_tokens + 200} tokens" in error["message"]


@pytest.mark.real_model
@pytest.mark.parametrize("stream", [False, True])
def test_without_max_tokens_the_answer_is_capped_at_what_the_context_leaves(http: httpx.Client, stream: bool) -> None:
    prompt = "word " * 490  # leaves fewer than default_max_tokens (64) of the 512
    body = {"prompt": prompt, "ignore_eos": True, "stream": stream, "stream_options": {"include_usage": True}}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        events = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: {")]
        finish = next(e["choices"][0]["finish_reason"] for e in events if e["choices"] and
                      e["choices"][0]["finish_reason"])
        usage = events[-1]["usage"]
    else:
        finish, usage = response.json()["choices"][0]["finish_reason"], response.json()["usage"]
    assert finish == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT  # ignore_eos: exactly what was left
    assert 0 < usage["completion_tokens"] < 64


@pytest.mark.real_model
def test_a_streamed_request_over_the_context_is_a_plain_400(http: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "word " * 2000}], "stream": True}
    response = http.post("/v1/chat/completions", json=body)
    assert response.headers["content-type"].startswith("application/json")
    assert_400(response, "messages", code="context_length_exceeded")


@pytest.mark.real_model
def test_the_load_logs_the_context_in_effect(server: ModelServerProcess) -> None:
    log = server.wait_log("loaded smollm2")
    assert f"context_length={CONTEXT}" in log and "tokenizer_cap=8192" in log


@pytest.mark.real_model
def test_a_context_length_option_above_the_models_fails_the_load(demo_gguf: Path) -> None:
    raw = {"path": str(demo_gguf), "options": {"context_length": 9000}}
    with modelserver(spec=build_model_spec("big", raw), wait=False) as failing:
        assert failing.wait_exit(60) == 1
        assert "options.context_length: 9000 is above the model's own context length of 8192" in failing.log_text()


# -- the real encoders, in process ------------------------------------------------------------------


@contextlib.asynccontextmanager
async def real_encoder(task: str, folder: str, tmp_path: Path) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    """A real embeddings or rerank engine behind the model server's app, in process; closed on exit."""
    from modelserver.engines import embeddings, rerank

    if not (MODELS / folder / ".built").exists():
        pytest.fail(f"{MODELS / folder} is missing: run `make test-models` (make test does it)")
    spec = build_model_spec(folder, {"task": task, "path": str(MODELS / folder), "cache_dir": str(tmp_path)})
    engine = (embeddings.load if task == "embeddings" else rerank.load)(spec)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(spec, engine)), base_url="http://m")
    try:
        yield engine, client
    finally:
        await client.aclose()
        engine.close()


@pytest.mark.real_model
async def test_minilm_refuses_an_input_above_its_256_tokens_unless_truncate(tmp_path: Path) -> None:
    async with real_encoder("embeddings", "minilm-ov", tmp_path) as (engine, client):
        texts = ["a short sentence", "word " * 300]
        refused = await client.post("/v1/embeddings", json={"input": texts})
        assert_400(refused, "input", "input[1]: 302 tokens", "maximum input of 256 tokens",
                   code="context_length_exceeded")  # [CLS] 300 words [SEP]
        cut = await client.post("/v1/embeddings", json={"input": texts, "truncate": True})
        assert cut.status_code == 200, cut.text
        assert cut.json()["usage"]["prompt_tokens"] == 5 + 256  # the long one counted as embedded: cut at 256


@pytest.mark.real_model
async def test_an_over_long_input_among_concurrent_requests_fails_only_its_own(tmp_path: Path) -> None:
    async with real_encoder("embeddings", "minilm-ov", tmp_path) as (engine, client):
        bodies = [{"input": "a short sentence"}, {"input": "word " * 300}, {"input": ["another", "one"]}]
        good, long, pair = await asyncio.gather(*(client.post("/v1/embeddings", json=body) for body in bodies))
        assert_400(long, "input", "input: 302 tokens", code="context_length_exceeded")
        assert [len(r.json()["data"]) for r in (good, pair)] == [1, 2]
        assert engine.stats()["failed"] == 0  # refused in the batch, not by a failed pipeline call


@pytest.mark.real_model
async def test_a_reranker_refuses_a_pair_above_its_maximum_unless_truncate(tmp_path: Path) -> None:
    async with real_encoder("rerank", "rerank-tiny-ov", tmp_path) as (engine, client):
        body = {"query": "what is a cat", "documents": ["a cat is an animal", "word " * 600]}
        assert_400(await client.post("/v1/rerank", json=body), "documents", "documents[1]:",
                   "maximum input of 512 tokens", code="context_length_exceeded")
        cut = await client.post("/v1/rerank", json={**body, "truncate": True})
        assert cut.status_code == 200, cut.text
        assert sorted(result["index"] for result in cut.json()["results"]) == [0, 1]


@pytest.mark.real_model
async def test_a_vlm_checks_its_language_models_context(tmp_path: Path) -> None:
    from modelserver.engines import vlm

    spec = build_model_spec("llava", {"task": "vlm", "path": str(MODELS / "llava-tiny-ov"), "cache_dir": str(tmp_path),
                                      "options": {"context_length": 256}})
    engine = vlm.load(spec)
    app = build_app(spec, engine)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://m") as client:
            long = [{"role": "user", "content": "word " * 300}]
            assert_400(await client.post("/v1/chat/completions", json={"messages": long}), "messages",
                       "maximum context length is 256 tokens", code="context_length_exceeded")
            over = await client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 256})
            assert_400(over, "max_tokens", "256 in the completion", code="context_length_exceeded")
            assert_400(await client.post("/v1/completions", json={"prompt": "word " * 300}), "prompt",
                       "in the prompt", code="context_length_exceeded")
            fits = await client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
            assert fits.status_code == 200, fits.text
    finally:
        engine.close()
