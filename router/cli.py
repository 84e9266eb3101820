"""``ovrouter serve | check | status``."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import logging
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from router.config import Config, ConfigError, load_config, start_warnings
from router.statustable import status_table

__all__ = ["main"]

log = logging.getLogger("ovrouter")

DEFAULT_CONFIG = "config.yaml"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ovrouter", description="One OpenAI-compatible URL for many OpenVINO models.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the router")
    _config_arguments(serve)
    serve.add_argument("--host", help="listen address (default: router.host)")
    serve.add_argument("--port", type=int, help="listen port (default: router.port)")
    serve.add_argument("--log-level", default=os.environ.get("OVROUTER_LOG_LEVEL", "info"),
                       choices=["debug", "info", "warning", "error"])
    check = sub.add_parser("check", help="validate a config file and print every problem")
    _config_arguments(check)
    status = sub.add_parser("status", help="print the models table of a running router")
    status.add_argument("--config", default=DEFAULT_CONFIG, help="read host, port and admin key from this file")
    status.add_argument("--url", help="router URL (default: from the config)")
    status.add_argument("--key", default=os.environ.get("OVROUTER_API_KEY"), help="admin key (or $OVROUTER_API_KEY)")
    status.add_argument("--json", action="store_true", help="print the raw JSON")
    export = sub.add_parser("export", help="write the config out for another platform")
    target = export.add_subparsers(dest="target", required=True)
    k8s = target.add_parser("k8s", help="Kubernetes manifests: per model a Deployment, a Service and a cache claim")
    k8s.add_argument("--config", default=DEFAULT_CONFIG, help="config file (default: %(default)s)")
    k8s.add_argument("--image", default="ovrouter:latest", help="container image with ovrouter installed")
    k8s.add_argument("--namespace", help="put every object in this namespace")
    k8s.add_argument("--models-claim", default="ovrouter-models",
                     help="PersistentVolumeClaim holding the model files, mounted at /models (default: %(default)s)")
    return parser


def _config_arguments(command: argparse.ArgumentParser) -> None:
    """The config file as ``ovrouter serve config.yaml`` or ``--config config.yaml`` (both commands take both)."""
    command.add_argument("config", nargs="?", default=None, help=f"config file (default: {DEFAULT_CONFIG})")
    command.add_argument("--config", dest="config_option", metavar="CONFIG", help="the same, as an option")


def _config_path(args: argparse.Namespace) -> str:
    if args.config is not None and args.config_option is not None and args.config != args.config_option:
        print(f"ovrouter {args.command}: two config files ({args.config}, {args.config_option}): give one",
              file=sys.stderr)
        raise SystemExit(2)
    return str(args.config or args.config_option or DEFAULT_CONFIG)


def _load(path: str) -> Config:
    try:
        return load_config(Path(path))
    except ConfigError as exc:
        print(f"{exc.source}: {len(exc.errors)} problem(s):", file=sys.stderr)
        for line in exc.errors:
            print(f"  {line}", file=sys.stderr)
        raise SystemExit(2) from None


def _fault_log() -> None:
    """``OVROUTER_FAULT_DIR`` set (the test suite does): a fatal signal's traceback of every thread goes to
    ``<dir>/router-<pid>.txt``, as modelserver/startup.py does for a model server."""
    if folder := os.environ.get("OVROUTER_FAULT_DIR"):
        path = Path(folder, f"router-{os.getpid()}.txt")
        path.parent.mkdir(parents=True, exist_ok=True)
        faulthandler.enable(path.open("w"), all_threads=True)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from router.app import build_app
    from router.edge.connlimits import GuardedHttpProtocol, connection_limits, raise_open_file_limit

    _fault_log()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    config = _load(_config_path(args))
    host, port = args.host or config.router.host, args.port if args.port is not None else config.router.port
    shown = f"[{host}]" if ":" in host else host
    log.info("serving %d model(s) from %s", len(config.models), config.path)
    for warning in start_warnings(config):
        log.warning("%s", warning)
    log.info("OpenAI base_url: http://%s:%d/v1  (models: %s)", shown, port, ", ".join(config.models) or "none")
    settings = config.router
    limits = connection_limits(settings.head_timeout_s, settings.body_timeout_s, settings.max_connections,
                               raise_open_file_limit())
    log.info("connections: at most %d open, request head within %gs, body silence %gs, keep-alive idle %gs",
             limits.max_connections, limits.head_timeout_s, limits.body_timeout_s, settings.keep_alive_timeout_s)
    server = uvicorn.Server(uvicorn.Config(
        build_app(config),
        host=host,
        port=port,
        loop="uvloop",
        http=GuardedHttpProtocol.with_limits(limits),  # httptools, one write per loop turn, bounded connections
        ws="none",  # no websocket route: an Upgrade request is answered as plain HTTP, in JSON (was an empty 403)
        timeout_keep_alive=settings.keep_alive_timeout_s,  # type: ignore[arg-type]  # a float works
        log_level=args.log_level,
        access_log=False,
        proxy_headers=False,  # the router is the edge; its ProxyHeadersMiddleware costs every request
        timeout_graceful_shutdown=config.router.shutdown_timeout_s,  # type: ignore[arg-type]  # float works; 0 = none
    ))
    sockets = None
    if settings.ollama_port is not None:  # a second listener, Ollama's API at its root (router.app._OllamaDoors)
        log.info("Ollama's API: http://%s:%d/ollama and http://%s:%d", shown, port, shown, settings.ollama_port)
        sockets = [server.config.bind_socket()]
        server.config.port = settings.ollama_port  # bound the same way (a second Config would reset the logging)
        sockets.append(server.config.bind_socket())
        server.config.port = port
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=sockets)
    return 0


def _check(args: argparse.Namespace) -> int:
    config = _load(_config_path(args))
    print(f"{config.path}: OK, {len(config.models)} model(s)")
    for name, spec in config.models.items():
        where = spec.url or (" ".join(spec.command) if spec.command else f"{spec.engine} {spec.path or ''}".strip())
        print(f"  {name:<20} {spec.task:<14} {spec.device:<8} {where}")
    for warning in start_warnings(config):
        print(f"  warning: {warning}")
    return 0


def _export(args: argparse.Namespace) -> int:
    import yaml

    from router.k8s import manifests

    config = _load(args.config)
    objects = manifests(config, image=args.image, namespace=args.namespace, models_claim=args.models_claim)
    print("# ovrouter export k8s: schema-checked manifests (kubernetes-validate), not run by ovrouter's tests")
    print(yaml.safe_dump_all(objects, sort_keys=False), end="")
    return 0


def _status(args: argparse.Namespace) -> int:
    url, key = args.url, args.key
    if url is None or key is None:
        config = _load(args.config)
        url = url or f"http://{config.router.host}:{config.router.port}"
        key = key or next(iter(config.router.effective_admin_keys), None)
    request = urllib.request.Request(url.rstrip("/") + "/api/models")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            rows = json.load(response)["models"]
    except urllib.error.HTTPError as exc:
        print(f"{url}: HTTP {exc.code}: {exc.read().decode(errors='replace')}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{url}: no router answering ({exc})", file=sys.stderr)
        return 1
    print(json.dumps(rows, indent=2) if args.json else _table(rows))
    return 0


def _table(rows: list[dict[str, Any]]) -> str:
    return status_table(rows)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handler = {"serve": _serve, "check": _check, "status": _status, "export": _export}[args.command]
    try:
        code = handler(args)
        sys.stdout.flush()  # here, not at exit, so a closed pipe is caught below
    except BrokenPipeError:  # `ovrouter status --json | head`: the reader has gone; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush writes nowhere
        return 1
    return code


if __name__ == "__main__":
    raise SystemExit(main())
