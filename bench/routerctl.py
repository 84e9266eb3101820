"""Start ``ovrouter serve`` on a generated config and drive its management API (sync, loopback)."""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.common import SectionSkipped
from bench.procs import Procs, free_port, http_get, wait_http, wait_until

__all__ = ["Router", "fake_model", "require_router", "router_config", "start_router"]

log = logging.getLogger(__name__)


def require_router() -> list[str]:
    """argv prefix that runs ``ovrouter``; SectionSkipped when the router is not in this tree yet."""
    if importlib.util.find_spec("router.cli") is None:
        raise SectionSkipped("the router (router/cli.py, `ovrouter serve`) is not in this tree yet")
    script = Path(sys.executable).with_name("ovrouter")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from router.cli import main; sys.exit(main())"]


def fake_model(load_s: float = 0.0, token_delay_s: float = 0.0, **extra: Any) -> dict[str, Any]:
    return {"task": "llm", "engine": "fake", "fake": {"load_s": load_s, "token_delay_s": token_delay_s}, **extra}


def router_config(state_dir: Path, models: dict[str, Any], defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """A whole config.yaml as a mapping; the port is given on the command line."""
    return {
        "router": {
            "host": "127.0.0.1",
            "state_dir": str(state_dir),
            "cache_dir": str(state_dir / "ov-cache"),
        },
        "defaults": {"idle_timeout_s": 0, "health_interval_s": 2, **(defaults or {})},
        "models": models,
        "groups": {},
    }


def write_config(path: Path, config: dict[str, Any]) -> None:
    """Write by rename, as editors do, so a watcher never reads half a file."""
    part = path.with_suffix(".part")
    part.write_text(yaml.safe_dump(config, sort_keys=False))
    part.replace(path)


@dataclass(slots=True)
class Router:
    """A running router: its process, URL and config file."""

    proc: subprocess.Popen[bytes]
    url: str
    config_path: Path
    start_s: float

    def get(self, path: str, attempts: int = 3) -> Any:
        """GET a JSON body; a connection-level failure (no status) is retried, and logged, twice."""
        for attempt in range(1, attempts + 1):
            status, body = http_get(self.url + path, timeout_s=10)
            if status != 0 or attempt == attempts:
                break
            log.warning("GET %s failed (%s), attempt %d of %d", path, body.decode(errors="replace"), attempt, attempts)
            time.sleep(0.2)
        if status != 200:
            raise RuntimeError(f"GET {path}: {status} {body[:300]!r}")
        return json.loads(body)

    def post(self, path: str, payload: Any = None, timeout_s: float = 300) -> tuple[int, Any]:
        data = json.dumps(payload or {}).encode()
        req = urllib.request.Request(self.url + path, data, {"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 - loopback only
                return int(resp.status), _json_or_text(resp.read())
        except urllib.error.HTTPError as exc:
            return int(exc.code), _json_or_text(exc.read())

    def models(self) -> dict[str, dict[str, Any]]:
        """``GET /api/models`` as {name: entry}, whatever list/dict shape the router uses."""
        data = self.get("/api/models")
        if isinstance(data, dict):
            data = data.get("models", data.get("data", data))
        if isinstance(data, dict):
            return {name: dict(entry, name=name) for name, entry in data.items()}
        return {entry["name"]: entry for entry in data}

    def pid(self, name: str) -> int | None:
        pid = self.models()[name].get("pid")
        return int(pid) if pid else None

    def state(self, name: str) -> str:
        return str(self.models()[name].get("state", "")).upper()

    def load(self, name: str) -> int:
        """Start a model and wait until READY and warm: an ``llm`` that started on its stateful pipeline
        (first answers while continuous batching compiles: modelserver/engines/llm_first.py) has switched,
        so what a section measures is the steady state. Its pid."""
        status, body = self.post(f"/api/models/{name}/load")
        if status >= 400:
            raise RuntimeError(f"load {name}: {status} {body}")
        wait_until(lambda: self.state(name) == "READY", 300, f"{name} READY", interval_s=0.05)
        wait_until(lambda: self.get(f"/upstream/{name}/health").get("pipeline") != "stateful", 300,
                   f"{name} on its continuous-batching pipeline", interval_s=0.1)
        pid = self.pid(name)
        if pid is None:
            raise RuntimeError(f"{name} is READY but has no pid")
        return pid

    def unload(self, name: str) -> None:
        status, body = self.post(f"/api/models/{name}/unload")
        if status >= 400:
            raise RuntimeError(f"unload {name}: {status} {body}")
        wait_until(lambda: self.state(name) == "STOPPED", 60, f"{name} STOPPED", interval_s=0.05)


def _json_or_text(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def start_router(procs: Procs, tmp: Path, config: dict[str, Any], name: str = "router") -> Router:
    """Write ``config`` to ``tmp/config.yaml``, start the router on a free port, wait for /health."""
    argv = require_router()
    tmp.mkdir(parents=True, exist_ok=True)
    config_path = tmp / "config.yaml"
    write_config(config_path, config)
    port = free_port()
    started = time.perf_counter()
    proc = procs.spawn(name, [*argv, "serve", "--config", str(config_path), "--host", "127.0.0.1", "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", proc, timeout_s=120)
    except (RuntimeError, TimeoutError) as exc:
        raise RuntimeError(f"{exc}\n{procs.log_tail(name)}") from None
    return Router(proc=proc, url=url, config_path=config_path, start_s=time.perf_counter() - started)
