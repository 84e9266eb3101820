"""The model server's HTTP server setup (modelserver/cli.py): what a start pays before it answers."""

from __future__ import annotations

from pathlib import Path

from modelserver import cli, startup
from modelserver.runtime import ModelRuntime


def test_the_server_loads_no_websocket_protocol(tmp_path: Path) -> None:
    """No route is a websocket: uvicorn's default (ws "auto") imports websockets, ~12 ms of a cold start that
    an OpenVINO load holding the GIL puts after the load."""
    args = cli.parse_args(["--engine", "fake", "--uds", str(tmp_path / "s.sock")])
    runtime = ModelRuntime(cli.resolve_spec(args))
    server = cli._server(args, runtime, startup.Readiness(None))
    server.config.load()
    assert server.config.ws_protocol_class is None
    assert server.config.interface == "asgi3"
