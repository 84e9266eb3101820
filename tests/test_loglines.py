"""modelserver/loglines.py: the access lines of one event-loop step go out in one write, in order; other
loggers, warnings, other threads and code outside a loop are written at once."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator

import pytest

from modelserver.loglines import LoopLines


class Stream:
    """A stderr stand-in that records each write."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def text(self) -> str:
        return "".join(self.writes)


@pytest.fixture
def logged() -> Iterator[tuple[logging.Logger, Stream, LoopLines]]:
    stream = Stream()
    handler = LoopLines(stream)  # type: ignore[arg-type]
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("modelserver.access")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    yield logger, stream, handler
    logger.removeHandler(handler)
    logger.propagate = True
    logger.setLevel(logging.NOTSET)


async def test_the_lines_of_one_loop_step_go_out_in_one_write(logged: tuple[logging.Logger, Stream, LoopLines]) -> None:
    logger, stream, _ = logged
    for i in range(16):
        logger.info("POST /v1/embeddings 200 request %d", i)
    assert stream.writes == []  # kept until the step ends
    await asyncio.sleep(0)
    assert len(stream.writes) == 1
    assert stream.text().splitlines() == [f"INFO POST /v1/embeddings 200 request {i}" for i in range(16)]
    logger.debug("next step")
    await asyncio.sleep(0)
    assert stream.writes[-1] == "DEBUG next step\n"


async def test_a_warning_goes_out_at_once_after_what_was_kept(logged: tuple[logging.Logger, Stream, LoopLines]) -> None:
    logger, stream, _ = logged
    logger.info("first")
    logger.warning("exiting after a fatal engine error")
    assert stream.text() == "INFO first\nWARNING exiting after a fatal engine error\n"


async def test_another_thread_s_line_goes_out_at_once_in_order(
    logged: tuple[logging.Logger, Stream, LoopLines],
) -> None:
    logger, stream, _ = logged
    logger.info("on the loop")
    thread = threading.Thread(target=logger.info, args=("from the loader",))
    thread.start()
    thread.join()
    assert stream.text() == "INFO on the loop\nINFO from the loader\n"
    await asyncio.sleep(0)  # the scheduled flush finds nothing left
    assert stream.text() == "INFO on the loop\nINFO from the loader\n"


async def test_another_logger_s_line_goes_out_at_once_after_what_was_kept(
    logged: tuple[logging.Logger, Stream, LoopLines],
) -> None:
    logger, stream, handler = logged
    other = logging.getLogger("test.loglines.server")
    other.addHandler(handler)
    other.setLevel(logging.INFO)
    other.propagate = False
    try:
        logger.info("POST /v1/embeddings 200")
        other.info("Shutting down")  # uvicorn's line; then it re-raises SIGTERM: no loop step, no atexit after it
        assert stream.text() == "INFO POST /v1/embeddings 200\nINFO Shutting down\n"
    finally:
        other.removeHandler(handler)
        other.propagate = True


def test_without_a_loop_every_line_goes_out_at_once(logged: tuple[logging.Logger, Stream, LoopLines]) -> None:
    logger, stream, _ = logged
    logger.info("loading")
    assert stream.writes == ["INFO loading\n"]


async def test_a_flush_at_exit_writes_what_is_kept(logged: tuple[logging.Logger, Stream, LoopLines]) -> None:
    logger, stream, handler = logged
    logger.info("the last answer")
    handler.flush()  # what logging.shutdown() does for every handler
    assert stream.text() == "INFO the last answer\n"
