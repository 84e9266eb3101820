"""How a configured model becomes a procman ``BackendSpec`` (what to run, how to reach it)."""

from __future__ import annotations

import sys
from pathlib import Path

from modelserver.spec import SPEC_ENV, ModelSpec
from procman import BackendSpec, RestartPolicy
from router.config import RouterSettings

__all__ = ["ROUTER_ONLY_FIELDS", "backend_spec"]

#: Settings the router applies itself; changing them on reload never restarts the process.
ROUTER_ONLY_FIELDS = frozenset(
    {
        "aliases",
        "preload",
        "group",
        "max_concurrency",
        "max_queue",
        "retry_on_fatal",
        "request_timeout_s",
        "stream_idle_timeout_s",
        "loading_progress",
    }
)


def _modelserver_argv(spec: ModelSpec, router: RouterSettings, config_path: Path | None) -> tuple[str, ...]:
    argv = [sys.executable, "-m", "modelserver", "--model", spec.name]
    if config_path is not None:
        argv += ["--config", str(config_path)]
    if router.transport == "uds":
        argv += ["--uds", "${SOCKET}"]
    else:
        argv += ["--host", "127.0.0.1", "--port", "${PORT}"]
    return tuple(argv)


def _transport(spec: ModelSpec, router: RouterSettings) -> str:
    if spec.command is not None:
        return "uds" if any("${SOCKET}" in part for part in spec.command) else "tcp"
    if spec.url is not None:
        return "tcp"
    return router.transport


def backend_spec(spec: ModelSpec, router: RouterSettings, config_path: Path | None = None) -> BackendSpec:
    """The process-level view of a model; two equal results mean "no restart needed"."""
    env: dict[str, str] = dict(spec.env)
    if spec.launches_modelserver:
        argv: tuple[str, ...] | None = _modelserver_argv(spec, router, config_path)
        process_view = ModelSpec.model_validate(spec.model_dump(exclude=set(ROUTER_ONLY_FIELDS)))
        env[SPEC_ENV] = process_view.to_env()
    else:
        argv = spec.command
    return BackendSpec(
        name=spec.name,
        argv=argv,
        env=env,
        cwd=str(config_path.parent) if config_path is not None else None,
        url=spec.url,
        transport=_transport(spec, router),  # type: ignore[arg-type]
        health_path=spec.health_path,
        startup_timeout_s=spec.startup_timeout_s,
        health_interval_s=spec.health_interval_s,
        health_timeout_s=spec.health_timeout_s,
        health_failures=spec.health_failures,
        stop_timeout_s=spec.stop_timeout_s,
        idle_timeout_s=spec.idle_timeout_s,
        drain_timeout_s=spec.drain_timeout_s,
        policy=RestartPolicy(
            max_retries=spec.max_retries,
            backoff_base_s=spec.backoff_base_s,
            backoff_max_s=spec.backoff_max_s,
            stable_after_s=spec.stable_after_s,
        ),
    )
