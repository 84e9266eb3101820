"""Starting a real router (uvicorn, in the test's event loop) on a free port, over a config file."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn
import yaml

from router.app import build_app
from router.config import load_config
from router.edge.coalesce import CoalescingHttpToolsProtocol
from router.service import RouterService


def fake_model(**overrides: Any) -> dict[str, Any]:
    """A fake-engine LLM that loads at once and streams quickly.

    Without the cold-start feedback (``loading_progress: off``): these tests check the status a
    cold streamed request gets; tests/test_router_metrics.py turns the feedback on."""
    model: dict[str, Any] = {"task": "llm", "engine": "fake", "fake": {"load_s": 0.05, "token_delay_s": 0.005},
                             "loading_progress": "off"}
    model.update(overrides)
    return model


def write_config(directory: Path, models: dict[str, Any], router: dict[str, Any] | None = None,
                 defaults: dict[str, Any] | None = None, groups: dict[str, Any] | None = None) -> Path:
    data: dict[str, Any] = {
        # no spare interpreter unless a test asks (each imports openvino: ~1 s of CPU per router on this box)
        "router": {"state_dir": str(directory / "state"), "watch": False, "spare_interpreters": 0, **(router or {})},
        "defaults": {"health_interval_s": 1, "startup_timeout_s": 120, "stop_timeout_s": 3, **(defaults or {})},
        "models": models,
    }
    if groups:
        data["groups"] = groups
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@dataclass
class RunningRouter:
    url: str
    service: RouterService
    client: httpx.AsyncClient

    def backend(self, name: str) -> Any:
        return self.service.registry.models[name].backend


@contextlib.asynccontextmanager
async def running_router(config_path: Path, api_key: str | None = None,
                         sockets: list[socket.socket] | None = None) -> AsyncIterator[RunningRouter]:
    """The router on a free port; with ``sockets`` (bound), on those instead (the URL is the first one's)."""
    config = load_config(config_path)
    service = RouterService(config)
    app = build_app(config, service)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
                                           loop="none", http=CoalescingHttpToolsProtocol))
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]  # pytest owns the signals
    task = asyncio.create_task(server.serve(sockets=sockets))
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("router exited before it started")
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # idle connections are dropped after 1 s: uvicorn closes them after 5 s, and a request sent on one at that
        # moment gets a ReadError (httpx's own expiry is also 5 s)
        limits = httpx.Limits(keepalive_expiry=1.0)
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=headers, limits=limits) as client:
            yield RunningRouter(url, service, client)
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 60)
