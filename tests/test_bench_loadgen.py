"""The bench's load generators and the embeddings section's accounting (no timings asserted: the numbers are the
bench's; these check that what it reports is read and added up right).

wrk itself runs only where it is installed (`make bench-deps`); its output parser, the child's own CPU from
``wait4`` and the embeddings verdict are checked everywhere.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.embeddings import Window, client_target, cpu_ratio, rate_ratio, server_window, verdict
from bench.loadgen import LoadResult, Target, _run_child, parse_wrk, run_asyncio, run_wrk

WRK_LINE = (
    'BENCH_JSON {"requests":1200,"duration_us":2000000,"bytes":90000,"errors":{"connect":0,"read":0,"write":0,'
    '"status":3,"timeout":0},"latency_us":{"min":900,"mean":1650.5,"max":9000,"pct":{"50":1500,"99":4000,'
    '"99.9":8000}}}'
)


def test_parse_wrk_reads_the_bench_json_line_among_wrk_s_own_output() -> None:
    stdout = f"Running 2s test @ http://127.0.0.1:1/v1/embeddings\n  1 threads and 4 connections\n{WRK_LINE}\n"
    result = parse_wrk(stdout, 4)
    assert (result.tool, result.connections, result.requests, result.duration_s) == ("wrk", 4, 1200, 2.0)
    assert result.errors == {"status": 3} and result.ok == 1197
    assert result.p(50) == 1.5 and result.p(99.9) == 8.0 and result.mean_ms == pytest.approx(1.6505)
    assert result.cpu_s is None  # run_wrk fills it from the child's rusage


def test_parse_wrk_without_its_line_is_an_error() -> None:
    with pytest.raises(ValueError, match="BENCH_JSON"):
        parse_wrk("unable to connect to 127.0.0.1:1 Connection refused\n", 1)


def test_run_child_counts_the_child_s_own_cpu_and_output() -> None:
    spin = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\nprint('done')"
    code, out, err, cpu_s = _run_child([sys.executable, "-c", spin], dict(os.environ), 60)
    assert (code, out.strip(), err) == (0, "done", "")
    assert cpu_s >= 0.3  # at least what it spun; the interpreter's start-up comes on top


def test_run_child_kills_a_child_past_its_time() -> None:
    code, _, _, _ = _run_child([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ), 0.2)
    assert code != 0


def test_a_target_refuses_bodies_that_are_not_one_line() -> None:
    with pytest.raises(ValueError, match="one line"):
        Target("http://127.0.0.1:1/", b"{}", (b'{"a":\n1}',))
    with pytest.raises(ValueError, match="loopback"):
        Target("http://192.0.2.1:1/", b"{}")


def test_client_target_sends_one_text_per_request_in_base64() -> None:
    target = client_target("http://127.0.0.1:1", 3)
    bodies = [json.loads(body) for body in target.all_bodies()]
    assert len(bodies) == 3 and len({b["input"] for b in bodies}) == 3
    assert all(isinstance(b["input"], str) and b["encoding_format"] == "base64" for b in bodies)


def _load(ok: int, cpu_s: float, errors: dict[str, int] | None = None) -> LoadResult:
    return LoadResult("wrk", 1, 2.0, ok + sum((errors or {}).values()), errors or {}, cpu_s=cpu_s)


def test_server_window_keeps_the_server_s_cpu_and_the_load_generator_s_apart() -> None:
    window = server_window(_load(1000, 0.05), server_cpu_s=4.0)
    assert (window.rate, window.cpu_ms, window.loadgen_cpu_ms, window.total_cpu_ms) == (500.0, 4.0, 0.05, 4.05)
    with pytest.raises(RuntimeError, match="failed"):
        server_window(_load(1000, 0.05, {"status": 2}), server_cpu_s=4.0)


def test_the_verdict_judges_emb_s_and_the_server_s_own_cpu_and_shows_the_load_generator_s() -> None:
    bare = [Window(1000, 2.0, 3.0)]  # 500/s, 3 ms per embedding
    server = [Window(850, 2.0, 3.4, 0.4)]  # 425/s (0.85x), 4 ms server (0.75x), 4.47 ms with the generator
    assert rate_ratio(server, bare) == pytest.approx(0.85)
    assert cpu_ratio(server, bare) == pytest.approx(0.75)
    assert cpu_ratio(server, bare, with_loadgen=True) == pytest.approx(3.0 / (3.4 / 0.85 + 0.4 / 0.85))
    line = verdict(16, 0.8, server, bare)
    assert "MISSED" in line and "0.85x by emb/s" in line and "0.75x by server CPU" in line and "0.67x" in line
    assert "met (" in verdict(1, 0.7, server, bare)


class _Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[bytes] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append(body)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def echo() -> Iterator[str]:
    _Echo.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/embeddings"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_the_asyncio_generator_sends_every_body_and_counts_its_cpu(echo: str) -> None:
    target = Target(echo, b'{"n":0}', (b'{"n":0}', b'{"n":1}'))
    result = run_asyncio(target, 2, 0.3)
    assert result.ok > 0 and result.error_count == 0 and result.cpu_s is not None and result.cpu_s > 0
    assert set(_Echo.seen) == {b'{"n":0}', b'{"n":1}'}


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed (make bench-deps)")
def test_wrk_sends_the_bodies_in_turn_and_reports_its_own_cpu(echo: str) -> None:
    target = Target(echo, b'{"n":0}', (b'{"n":0}', b'{"n":1}', b'{"n":2}'))
    result = run_wrk(target, 1, 1)
    assert result.ok > 0 and result.error_count == 0 and result.cpu_s is not None and result.cpu_s > 0
    assert set(_Echo.seen) == {b'{"n":0}', b'{"n":1}', b'{"n":2}'}
