"""The model server's per-request plumbing that the embeddings and rerank paths were trimmed to: the disconnect
watch of :func:`until_disconnect` (no task of the work's own, started only for work that lasts), and
:meth:`SerialWorker.call` (one hop there and back, the answer handed to a callback on the loop).

Waits are on conditions, never on sleeps; nothing here asserts a duration.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from starlette.requests import Request

from modelserver.api.common import WATCH_AFTER_S, ClientGone, until_disconnect
from modelserver.engines.media_base import SerialWorker

pytestmark = pytest.mark.timeout(60)


class Client:
    """An ASGI ``receive`` whose client is there until ``leave()``; counts how often it was asked."""

    def __init__(self) -> None:
        self.asked = 0
        self.gone = asyncio.Event()

    def leave(self) -> None:
        self.gone.set()

    async def receive(self) -> dict[str, Any]:
        self.asked += 1
        await self.gone.wait()
        return {"type": "http.disconnect"}

    def request(self) -> Request:
        scope = {"type": "http", "method": "POST", "path": "/v1/embeddings", "headers": [], "query_string": b""}
        return Request(scope, self.receive)


async def test_work_that_ends_before_the_watch_starts_never_asks_for_a_disconnect() -> None:
    client = Client()

    async def quick() -> str:
        return "vectors"

    assert await until_disconnect(client.request(), quick()) == "vectors"
    await asyncio.sleep(WATCH_AFTER_S * 2)  # past the moment the watch would have started: it was called off
    assert client.asked == 0


async def test_a_client_that_leaves_during_long_work_cancels_it_and_gets_client_gone() -> None:
    client, started, cancelled = Client(), asyncio.Event(), asyncio.Event()

    async def long() -> str:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    handler = asyncio.ensure_future(until_disconnect(client.request(), long()))
    await started.wait()
    client.leave()  # before or after the watch starts: noticed either way
    with pytest.raises(ClientGone):
        await asyncio.wait_for(handler, 30)
    assert cancelled.is_set()
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_cancelled_request_stays_cancelled_not_client_gone() -> None:
    client, started = Client(), asyncio.Event()

    async def long() -> None:
        started.set()
        await asyncio.Event().wait()

    handler = asyncio.ensure_future(until_disconnect(client.request(), long()))
    await started.wait()
    handler.cancel()  # a server shutting down: not the client's doing
    with pytest.raises(asyncio.CancelledError):
        await handler
    assert handler.cancelled()


async def test_an_error_of_the_work_reaches_the_caller() -> None:
    async def failing() -> None:
        raise ValueError("input[0]: too long")

    with pytest.raises(ValueError, match="too long"):
        await until_disconnect(Client().request(), failing())


async def test_a_disconnect_after_the_answer_changes_nothing_later() -> None:
    client = Client()

    async def slow_enough() -> str:
        await asyncio.sleep(WATCH_AFTER_S * 3)  # the watch is running when it ends
        return "vectors"

    assert await until_disconnect(client.request(), slow_enough()) == "vectors"
    client.leave()
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # a late watch callback would cancel this task here
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def _called(worker: SerialWorker, fn: Any) -> Any:
    answered: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    worker.call(fn, answered.set_result)
    return await answered


async def test_serial_worker_call_answers_on_the_loop_in_order_and_counts() -> None:
    worker = SerialWorker("test-call")
    loop_thread = threading.get_ident()
    threads: list[int] = []
    try:
        answers: list[Any] = []

        def record(answer: Any) -> None:
            threads.append(threading.get_ident())
            answers.append(answer)

        done = asyncio.Event()
        for i in range(3):
            worker.call(lambda i=i: i * 10, record)
        worker.call(lambda: 1 // 0, lambda answer: (record(answer), done.set()))
        await asyncio.wait_for(done.wait(), 30)
        assert answers[:3] == [0, 10, 20] and isinstance(answers[3], ZeroDivisionError)
        assert set(threads) == {loop_thread}
        assert worker.stats() == {"running": 0, "completed": 3, "failed": 1}
    finally:
        worker.close()


async def test_a_closed_worker_answers_with_an_error() -> None:
    worker = SerialWorker("test-closed")
    worker.close()
    answer = await asyncio.wait_for(_called(worker, lambda: "never"), 30)
    assert isinstance(answer, RuntimeError)
    assert worker.stats()["failed"] == 1


# -- a client gone during a large embeddings request: 499, and the calls only it needed are skipped ---------------


class BlockingPipe:
    """A stand-in TextEmbeddingPipeline whose every call waits for ``go``; records how many inputs each call had."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.entered = threading.Event()
        self.go = threading.Event()
        self.started: list[str] = []

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        self.calls.append(len(texts))
        self.entered.set()
        self.go.wait(30)
        return [[1.0, 0.0] for _ in texts]

    def start_embed_documents_async(self, texts: list[str]) -> None:
        self.started = list(texts)

    def wait_embed_documents(self) -> list[list[float]]:
        return self.embed_documents(self.started)


async def test_a_client_gone_mid_embeddings_gets_499_and_the_rest_of_its_calls_are_skipped() -> None:
    from types import SimpleNamespace

    from modelserver.app import build_app
    from modelserver.engines.batching import BatchOptions
    from modelserver.engines.counting import TokenCounter
    from modelserver.engines.embeddings import OpenVINOEmbedder
    from modelserver.spec import build_model_spec

    class Words:
        def encode(self, text: str, add_special_tokens: bool = True) -> Any:
            return SimpleNamespace(ids=text.split() + ["[CLS]", "[SEP]"])

    pipe = BlockingPipe()
    counter = TokenCounter(lambda: pytest.fail("the exact tokenizer is not needed here"), Words())
    counter.confirmed = lambda texts, counts, near, special=True: counts  # type: ignore[method-assign]
    engine = OpenVINOEmbedder(build_model_spec("e", {"task": "embeddings", "engine": "fake"}), pipe, counter,
                              SimpleNamespace(max_length=4, normalize=True), 0.0, BatchOptions(max_batch=4))
    app = build_app(build_model_spec("e", {"task": "embeddings", "engine": "fake"}), engine)
    client, sent = Client(), []
    body = b'{"input": [' + b",".join(b'"text %d"' % i for i in range(20)) + b"]}"  # 4 tokens each: calls of 4
    first = [True]

    async def receive() -> dict[str, Any]:
        if first[0]:
            first[0] = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await client.receive()

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/embeddings", "raw_path": b"/v1/embeddings", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    try:
        handler = asyncio.ensure_future(app(scope, receive, send))
        await asyncio.get_running_loop().run_in_executor(None, pipe.entered.wait, 30)  # the first call runs
        client.leave()
        while not handler.done() and not sent:
            await asyncio.sleep(0.01)
        pipe.go.set()  # the first call ends; the four after it were needed by the gone client alone
        await asyncio.wait_for(handler, 30)
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499  # not a 500 "engine error"
        assert pipe.calls == [4]
        rows = await asyncio.wait_for(engine.embed(["again"]), 30)  # the model serves the next request
        assert rows.vectors == [[1.0, 0.0]] and pipe.calls == [4, 1]
    finally:
        pipe.go.set()
        engine.close()


def test_engine_errors_pass_a_client_gone_as_it_is() -> None:
    # every route wraps until_disconnect in engine_errors: a disconnect was a 500 "engine error: ClientGone"
    from types import SimpleNamespace

    from modelserver.api.common import engine_errors

    runtime: Any = SimpleNamespace(spec=None, set_failed=lambda message: pytest.fail("no engine failed"))
    with pytest.raises(ClientGone), engine_errors(runtime):
        raise ClientGone()
