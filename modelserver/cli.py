"""``python -m modelserver``: serve one model over a Unix socket or TCP.

::

    python -m modelserver --config config.yaml --model NAME (--uds PATH | --port N [--host H])
    python -m modelserver --task llm --path models/x.gguf [--device CPU] --port 8000    # no config file
    python -m modelserver --engine fake --port 8000                                     # fake echo model

When ``OVROUTER_MODEL_SPEC`` is set it holds the exact ModelSpec the router validated and
wins over the config file (``--config/--model`` then only name things in logs).

The loader thread starts as soon as the spec is known, before the HTTP server's modules are
imported (OpenVINO releases the GIL while it builds a pipeline, so those imports cost a cold
start nothing); the server then answers at once (``/health`` 503 "loading") until the
engine is loaded. A model that cannot load logs ``failed to load <name>: <reason>`` and the process
exits with status 1 (2 for a bad command line or config). A fatal engine error (a device
beyond repair) answers its request and exits with status 3 at once, without touching the
pipeline again. SIGTERM stops it gracefully
(in-flight requests get ``GRACEFUL_SHUTDOWN_S``); uvicorn then re-raises the signal, so
the parent sees the process ended by SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from modelserver import startup
from modelserver.engines import make_engine
from modelserver.loglines import LoopLines
from modelserver.runtime import ModelRuntime
from modelserver.spec import SPEC_ENV, ConfigError, ModelSpec, build_model_spec, load_model_spec

if TYPE_CHECKING:
    import uvicorn

__all__ = ["main", "parse_args", "resolve_spec"]

log = logging.getLogger("modelserver")

EXIT_LOAD_FAILED = 1
EXIT_USAGE = 2
EXIT_FATAL = 3
GRACEFUL_SHUTDOWN_S = 3
#: The bearer token the router hands a process it runs on a node (``procman.process.TOKEN_ENV``, the same name).
TOKEN_ENV = "OVROUTER_MODEL_TOKEN"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m modelserver", description="Serve one model (OpenAI API).")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--uds", help="listen on this Unix socket path")
    where.add_argument("--port", type=int, help="listen on this TCP port")
    parser.add_argument("--host", default="127.0.0.1", help="TCP host (default 127.0.0.1)")
    parser.add_argument("--config", type=Path, help="config file (with --model)")
    parser.add_argument("--model", help="the model's key under `models` in --config")
    parser.add_argument("--task", help="no-config form: llm | embeddings | ...")
    parser.add_argument("--path", help="no-config form: a .gguf file or an OpenVINO IR folder")
    parser.add_argument("--device", help="no-config form: OpenVINO device (default: the `device` setting's, CPU)")
    parser.add_argument("--engine", choices=["openvino", "fake"], help="no-config form: engine (default openvino)")
    parser.add_argument("--name", help="no-config form: the model's name (default: the file's stem)")
    parser.add_argument("--cache-dir", help="no-config form: OpenVINO CACHE_DIR")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    if not os.environ.get(SPEC_ENV) and not (args.config or args.task or args.path or args.engine):
        parser.error("give --config and --model, or --task/--path (or --engine fake) to serve without a config")
    if args.config and not args.model:
        parser.error("--config needs --model NAME")
    return args


def resolve_spec(args: argparse.Namespace) -> ModelSpec:
    """The spec to serve: the router's (``OVROUTER_MODEL_SPEC``), the config file's, or the flags'."""
    from_env = os.environ.get(SPEC_ENV)
    if from_env:
        try:
            return ModelSpec.from_env(from_env)
        except ValidationError as exc:
            raise ConfigError([f"{SPEC_ENV}: {err['msg']} at {err['loc']}" for err in exc.errors()]) from None
    if args.config:
        return load_model_spec(args.config, args.model)
    raw: dict[str, Any] = {"task": args.task, "engine": args.engine, "path": args.path, "device": args.device}
    raw["cache_dir"] = args.cache_dir
    raw = {key: value for key, value in raw.items() if value is not None}
    name = args.name or (Path(args.path).stem if args.path else f"{args.engine or 'openvino'}-{args.task or 'llm'}")
    return build_model_spec(name, raw, base_dir=Path.cwd())


def configure_logging(level: str) -> None:
    """Lines of time, level, logger and message on stderr, those of one event-loop step written together
    (:class:`~modelserver.loglines.LoopLines`). Every request writes one (the access line), so a record also
    skips what the format never shows: its caller's file and line (a walk up the stack), thread and process
    (the logging HOWTO's optimizations; ~2.5 of the ~11 us a line costs)."""
    logging._srcfile = None  # documented: "set logging._srcfile to None"
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    logging.basicConfig(
        level=level.upper(), handlers=[LoopLines(sys.stderr)], format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )


class _Loader:
    """The loader thread; a failed load stops the server, whether it is already running or not yet built."""

    def __init__(self, runtime: ModelRuntime, readiness: startup.Readiness) -> None:
        self._runtime = runtime
        self._readiness = readiness
        self._server: uvicorn.Server | None = None
        self._failed = False
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="loader", daemon=True)

    def _run(self) -> None:
        ok = self._runtime.load(make_engine)
        if ok:
            self._readiness.loaded()
        with self._lock:
            self._failed = not ok
            if self._failed and self._server is not None:
                self._server.should_exit = True  # the main loop notices within 0.1 s; main() then exits non-zero

    def attach(self, server: uvicorn.Server) -> None:
        with self._lock:
            self._server = server
            server.should_exit = self._failed


def take_token() -> str | None:
    """The bearer token from :data:`TOKEN_ENV`, removed from the environment (nothing started here inherits it)."""
    return os.environ.pop(TOKEN_ENV, None) or None


def _server(
    args: argparse.Namespace, runtime: ModelRuntime, readiness: startup.Readiness, token: str | None = None
) -> uvicorn.Server:
    import uvicorn  # imported while the loader thread builds the pipeline

    from modelserver.app import build_app
    from modelserver.heartbeat import Heartbeat
    from modelserver.httpproto import JsonErrorsProtocol

    listen: dict[str, Any] = {"uds": args.uds} if args.uds else {"host": args.host, "port": args.port}
    config = uvicorn.Config(
        Heartbeat(build_app(runtime.spec, runtime=runtime, token=token)),  # outside: it needs uvicorn's send
        http=JsonErrorsProtocol,  # httptools, a malformed request answered in JSON
        loop="uvloop",
        ws="none",  # no websocket route: "auto" would import websockets (~12 ms, after a GIL-holding load)
        interface="asgi3",
        log_config=None,
        access_log=False,  # modelserver.app.RequestLog writes the access line
        proxy_headers=False,  # behind the router on a private socket: nothing here reads the client's address
        lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        **listen,
    )

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:  # bound and listening: what a health probe would find next
                readiness.listening()

    return Server(config)


def _exit_fatal() -> None:
    """The device failed beyond repair: leave now, skipping every teardown that could touch it."""
    log.error("exiting after a fatal engine error (status %d)", EXIT_FATAL)
    logging.shutdown()
    os._exit(EXIT_FATAL)


def main(argv: Sequence[str] | None = None) -> int:
    startup.mark("imports")
    args = parse_args(argv)
    token = take_token()
    configure_logging(args.log_level)
    try:
        spec = resolve_spec(args)
    except ConfigError as exc:
        log.error("failed to load %s: %s", args.model or args.name or args.path or "model", "; ".join(exc.errors))
        return EXIT_USAGE
    runtime = ModelRuntime(spec, on_fatal=_exit_fatal)
    readiness = startup.Readiness.from_env()
    loader = _Loader(runtime, readiness)
    loader.thread.start()
    server = _server(args, runtime, readiness, token)
    loader.attach(server)
    log.info("serving %s (task %s, engine %s) on %s", spec.name, spec.task, spec.engine, args.uds or args.port)
    server.run()
    code = EXIT_LOAD_FAILED if runtime.load_failed else 0
    # stopped while loading, or while the llm engine builds its second pipeline (engines/llm_first.py):
    # OpenVINO is mid-compile, skip interpreter teardown
    if loader.thread.is_alive() or getattr(runtime.loaded(), "building", False) is True:
        log.info("stopped %s while it was loading", spec.name)
        logging.shutdown()
        os._exit(code)
    return code
