"""The small pieces of procman: backoff arithmetic, specs, addresses, the log buffer, the prober."""

from __future__ import annotations

import asyncio
import socket
import stat
from dataclasses import replace
from pathlib import Path

import pytest

from procman import (
    Address,
    AddressAllocator,
    BackendSpec,
    BackendUnavailable,
    HttpProber,
    LogBuffer,
    RestartPolicy,
    backoff_delay,
)
from procman.address import is_address_clash, short_name
from procman.deaths import exit_cause
from procman.process import exit_words

pytestmark = pytest.mark.timeout(30)


# -- policy -------------------------------------------------------------------------------


def test_backoff_sequence_with_defaults() -> None:
    policy = RestartPolicy()
    assert [backoff_delay(n, policy) for n in range(1, 11)] == [0, 1, 2, 4, 8, 16, 32, 60, 60, 60]


def test_backoff_sequence_custom_and_huge_attempts() -> None:
    policy = RestartPolicy(backoff_base_s=0.5, backoff_max_s=3.0)
    assert [backoff_delay(n, policy) for n in range(0, 7)] == [0, 0, 0.5, 1.0, 2.0, 3.0, 3.0]
    assert backoff_delay(10_000, policy) == 3.0


def test_policy_refuses_negative_values() -> None:
    with pytest.raises(ValueError, match="RestartPolicy.backoff_base_s: expected a number >= 0, got -1"):
        RestartPolicy(backoff_base_s=-1)


# -- spec ---------------------------------------------------------------------------------


def test_spec_equality_and_hash_follow_content() -> None:
    a = BackendSpec(name="m", argv=["python", "-m", "x"], env={"B": "2", "A": "1"})  # type: ignore[arg-type]
    b = BackendSpec(name="m", argv=("python", "-m", "x"), env={"A": "1", "B": "2"})
    assert a == b and hash(a) == hash(b) and a.argv == ("python", "-m", "x")
    assert dict(a.env) == {"A": "1", "B": "2"} and a.env == {"A": "1", "B": "2"}
    assert replace(a, env={"A": "1"}) != a
    assert replace(a, policy=RestartPolicy(max_retries=1)) != a
    assert {a, b} == {a}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"argv": None}, "exactly one of argv"),
        ({"argv": ("x",), "url": "http://h:1"}, "exactly one of argv"),
        ({"argv": ()}, "argv must not be empty"),
        ({"argv": ("srv", "--port", "${PORT}")}, r"use \$\{PORT\} but transport is 'uds'"),
        ({"argv": ("srv", "--uds", "${SOCKET}"), "transport": "tcp"}, r"use \$\{SOCKET\} but transport is 'tcp'"),
        ({"argv": ("x",), "health_path": "health"}, "health_path must start with '/'"),
        ({"argv": ("x",), "health_method": "POST"}, "health_method: expected 'GET' or 'HEAD', got 'POST'"),
        ({"argv": ("x",), "health_interval_s": -1}, "health_interval_s: expected a number >= 0, got -1"),
        ({"argv": ("x",), "startup_timeout_s": 0}, "startup_timeout_s: expected a number > 0, got 0"),
        ({"argv": ("x",), "idle_timeout_s": -1}, "idle_timeout_s: expected a number >= 0, got -1"),
        ({"argv": ("x",), "health_failures": 0}, "health_failures: expected an integer >= 1"),
        ({"argv": ("x",), "env": {"A": 1}}, "env: keys and values must be strings"),
    ],
)
def test_spec_validation_says_what_to_fix(fields: dict[str, object], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        BackendSpec(name="m", **fields)  # type: ignore[arg-type]


# -- addresses ------------------------------------------------------------------------------


def test_address_urls() -> None:
    uds = Address(kind="uds", path="/run/x/m.sock")
    tcp = Address(kind="tcp", port=20001)
    remote = Address(kind="tcp", url="https://api.example.test/v1/")
    assert (uds.base_url, str(uds)) == ("http://localhost", "unix:/run/x/m.sock")
    assert (tcp.base_url, str(tcp)) == ("http://127.0.0.1:20001", "http://127.0.0.1:20001")
    assert remote.base_url == "https://api.example.test/v1"


def test_sockets_live_in_a_private_directory(tmp_path: Path) -> None:
    allocator = AddressAllocator(tmp_path / "rt")
    address = allocator.allocate("smollm2", "uds")
    assert address.kind == "uds" and address.path is not None
    folder = Path(address.path).parent
    assert folder == tmp_path / "rt" / "sockets"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


def test_relative_runtime_dir_gives_absolute_socket_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    address = AddressAllocator(Path(".ovrouter")).allocate("m", "uds")
    assert address.path == str(tmp_path / ".ovrouter" / "sockets" / "m-1.sock")  # a child with another cwd finds it


def test_too_deep_runtime_dir_falls_back_to_a_short_private_dir(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    allocator = AddressAllocator(deep)
    address = allocator.allocate("a model/with odd:name", "uds")
    assert address.path is not None and len(address.path.encode()) <= 103
    assert stat.S_IMODE(Path(address.path).parent.stat().st_mode) == 0o700
    assert Path(address.path).name == f"{short_name('a model/with odd:name')}-1.sock"
    folder = Path(address.path).parent
    allocator.close()
    assert not folder.exists()


def test_long_name_gets_a_short_socket_file(tmp_path: Path) -> None:
    allocator = AddressAllocator(tmp_path)
    long_name = "m" * 48
    address = allocator.allocate(long_name, "uds")
    assert address.path is not None and len(address.path.encode()) <= 103
    assert Path(address.path).parent == tmp_path / "sockets"
    assert allocator.allocate("plain", "uds").path == str(tmp_path / "sockets" / "plain-2.sock")


def test_each_process_gets_its_own_socket_and_a_release_removes_only_its_own(tmp_path: Path) -> None:
    allocator = AddressAllocator(tmp_path)
    old, new = allocator.allocate("m", "uds"), allocator.allocate("m", "uds")  # a drain overlapping a re-add
    assert old.path != new.path
    for address in (old, new):
        assert address.path is not None
        Path(address.path).touch()
    allocator.release(old)
    assert new.path is not None and Path(new.path).exists() and not Path(str(old.path)).exists()


def test_tcp_ports_are_never_shared_and_come_back(tmp_path: Path) -> None:
    low = _free_port_block(3)
    allocator = AddressAllocator(tmp_path, port_range=(low, low + 2))
    ports = [allocator.allocate(f"m{i}", "tcp").port for i in range(3)]
    assert sorted(ports) == [low, low + 1, low + 2]  # type: ignore[type-var]
    with pytest.raises(BackendUnavailable, match=f"no free TCP port for m3 in {low}-{low + 2}"):
        allocator.allocate("m3", "tcp")
    allocator.release(Address(kind="tcp", port=low + 1))
    assert allocator.allocate("m3", "tcp").port == low + 1


def test_a_port_bound_by_someone_else_is_skipped(tmp_path: Path) -> None:
    low = _free_port_block(2)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", low))
        squatter.listen()
        allocator = AddressAllocator(tmp_path, port_range=(low, low + 1))
        assert allocator.allocate("m", "tcp").port == low + 1


def test_clash_is_recognised_in_log_lines() -> None:
    assert is_address_clash(
        ["INFO x", "ERROR: [Errno 98] error while attempting to bind on address: address already in use"]
    )
    assert is_address_clash(["listen tcp 127.0.0.1:20000: bind: EADDRINUSE"])
    assert not is_address_clash(["ready", "loaded 98 layers"])


def _free_port_block(size: int) -> int:
    """A run of ``size`` ports that are free right now (for allocator tests only)."""
    for low in range(41000, 42000, size):
        socks = []
        try:
            for port in range(low, low + size):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return low
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no free port block")


# -- log buffer -----------------------------------------------------------------------------


def test_log_buffer_keeps_the_last_lines_and_writes_the_file(tmp_path: Path) -> None:
    logs = LogBuffer(tmp_path / "logs" / "m.log", max_lines=5)
    for i in range(8):
        logs.append(f"l{i}")
    mark = logs.total
    logs.append("after")
    assert logs.tail(3) == ["l6", "l7", "after"] and logs.tail() == ["l4", "l5", "l6", "l7", "after"]
    assert logs.since(mark) == ["after"] and logs.since(0) == logs.tail()
    logs.note("spawned pid=1")
    logs.close()
    text = (tmp_path / "logs" / "m.log").read_text().splitlines()
    assert text[:9] == [f"l{i}" for i in range(8)] + ["after"] and "procman: spawned pid=1" in text[9]


def test_log_files_are_private(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir(mode=0o755)
    (tmp_path / "logs" / "old.log").write_text("from before\n")
    (tmp_path / "logs" / "old.log").chmod(0o644)
    for name in ("m.log", "old.log"):
        logs = LogBuffer(tmp_path / "logs" / name)
        logs.append("a prompt's error")
        logs.close()
        assert stat.S_IMODE((tmp_path / "logs" / name).stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "logs").stat().st_mode) == 0o700


def test_log_file_rotates_past_its_size_limit(tmp_path: Path) -> None:
    path = tmp_path / "m.log"
    logs = LogBuffer(path, max_file_bytes=100)
    for i in range(30):
        logs.append(f"line {i:03d}")  # 9 bytes each with the newline
    logs.close()
    rotated = (tmp_path / "m.log.1").read_text().splitlines()
    current = path.read_text().splitlines()
    assert rotated and rotated[-1] < current[0]
    assert len(path.read_bytes()) <= 100 and (rotated + current)[-1] == "line 029"
    assert logs.tail(2) == ["line 028", "line 029"]


async def test_log_follow_gives_the_tail_then_live_lines() -> None:
    logs = LogBuffer(None)
    logs.append("old 1")
    logs.append("old 2")
    follower = logs.follow(tail=1)
    seen = [await anext(follower)]
    nxt = asyncio.ensure_future(anext(follower))
    await asyncio.sleep(0)
    assert not nxt.done()
    logs.append("live")
    seen.append(await nxt)
    await follower.aclose()
    assert seen == ["old 2", "live"] and not logs._followers


# -- prober -------------------------------------------------------------------------------


async def test_http_prober_over_uds_and_tcp(tmp_path: Path) -> None:
    statuses = iter([b"503 Service Unavailable", b"200 OK", b"200 OK"])

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await reader.readuntil(b"\r\n\r\n")
        assert request.startswith(b"GET /health HTTP/1.1\r\n")
        writer.write(b"HTTP/1.1 " + next(statuses) + b"\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    path = str(tmp_path / "p.sock")
    uds = await asyncio.start_unix_server(answer, path)
    tcp = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = tcp.sockets[0].getsockname()[1]
    prober = HttpProber()
    try:
        assert await prober.probe(Address(kind="uds", path=path), "/health", 2.0) is False  # 503
        assert await prober.probe(Address(kind="uds", path=path), "/health", 2.0) is True
        assert await prober.probe(Address(kind="tcp", port=port), "/health", 2.0) is True
        assert await prober.probe(Address(kind="uds", path=str(tmp_path / "none.sock")), "/health", 2.0) is False
    finally:
        uds.close()
        tcp.close()
        await uds.wait_closed()
        await tcp.wait_closed()


async def test_http_prober_times_out_on_a_silent_server(tmp_path: Path) -> None:
    gate = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await gate.wait()
        writer.close()

    path = str(tmp_path / "s.sock")
    server = await asyncio.start_unix_server(silent, path)
    try:
        assert await HttpProber().probe(Address(kind="uds", path=path), "/health", 0.2) is False
    finally:
        gate.set()
        server.close()
        await server.wait_closed()


async def test_http_prober_head_sends_head_and_reads_no_body() -> None:
    seen: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 42\r\n\r\n")  # a HEAD answer: the length, no body
        await writer.drain()
        await reader.read()  # held open: a prober waiting for 42 bytes of body would time out
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        assert await HttpProber().probe(Address(kind="tcp", port=port), "/v2/health/ready", 5.0, method="HEAD")
    finally:
        server.close()
        await server.wait_closed()
    assert seen[0].startswith(b"HEAD /v2/health/ready HTTP/1.1\r\n")


# -- exit classification ------------------------------------------------------------------------


@pytest.mark.parametrize(("code", "words"), [
    (0, "exited with code 0"),
    (3, "exited with code 3"),
    (-9, "was killed by SIGKILL (signal 9)"),
    (-11, "was killed by SIGSEGV (signal 11)"),
    (-19, "was found stopped by SIGSTOP (signal 19) and killed"),  # a hang silenced from outside
    (None, "exited (exit status unknown)"),
])
def test_exit_words_name_the_code_or_the_signal(code: int | None, words: str) -> None:
    assert exit_words(code) == words


@pytest.mark.parametrize(
    ("code", "tail", "cause"),
    [
        (134, ["loading", "[GPU] clFinish, error code: -5 ... GPU plugin can't finish correctly"], "fatal"),
        (-6, ["zeCommandQueueSynchronize failed with code 1879048193"], "fatal"),
        (1, ["Traceback", "ValueError: bad"], "crash"),
        (-9, [], "crash"),
        (0, ["cl_out_of_resources"], "crash"),  # a clean exit is never a device failure
    ],
)
def test_a_non_zero_exit_is_fatal_when_its_last_lines_match(code: int, tail: list[str], cause: str) -> None:
    patterns = ("CL_OUT_OF_RESOURCES", "error code: -5", "failed with code 1879048193")
    assert exit_cause(code, tail, patterns) == cause


def test_socket_numbers_too_long_for_the_runtime_dir_move_to_a_short_private_dir(tmp_path: Path) -> None:
    allocator = AddressAllocator(tmp_path)
    first = allocator.allocate("m", "uds")
    allocator._sockets = 10**30  # a router that restarted its models very, very often
    later = allocator.allocate("m", "uds")
    assert first.path is not None and later.path is not None and len(later.path.encode()) <= 103
    assert Path(later.path).parent != Path(first.path).parent
    assert stat.S_IMODE(Path(later.path).parent.stat().st_mode) == 0o700
    allocator.close()
