"""How a configured model becomes a procman ``BackendSpec`` (what to run, how to reach it)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from modelserver.spec import SPEC_ENV, ModelSpec, fields_for
from procman import BackendSpec, RestartPolicy, SpareSpec
from procman.process import READY_ENV, TOKEN_ENV
from router.config import Config, RouterSettings

__all__ = ["backend_spec", "spare_argv", "spare_spec", "supervision"]

#: The command every model server starts with; a spare interpreter runs it with ``--spare``.
MODELSERVER = (sys.executable, "-m", "modelserver")
#: ``modelserver.spare.SPARE_FLAG`` and ``WARM_FLAG`` (the router imports no more of modelserver than its spec).
SPARE_FLAG, WARM_FLAG = "--spare", "--warm"
#: The libraries a spare imports for the engines it warms (``modelserver.spare.LOAD_IMPORTS`` and the engines'
#: modules): a change on disk makes it stale, as one of OpenVINO's does.
WARMED_PACKAGES = ("openvino_tokenizers", "tokenizers", "PIL", "soxr")

#: BackendSpec and RestartPolicy fields, filled from the ModelSpec settings tagged ``supervisor``.
_BACKEND_FIELDS = frozenset(f.name for f in dataclasses.fields(BackendSpec))
_POLICY_FIELDS = frozenset(f.name for f in dataclasses.fields(RestartPolicy))


def supervision(spec: ModelSpec) -> dict[str, Any]:
    """The supervisor's settings of ``spec``, derived from the tags (never copied field by field)."""
    tagged = {name: getattr(spec, name) for name in fields_for("supervisor")}
    unplaced = set(tagged) - _BACKEND_FIELDS - _POLICY_FIELDS
    if unplaced:  # a new supervisor setting must be a BackendSpec or RestartPolicy field of the same name
        raise AssertionError(f"supervisor settings procman does not know: {sorted(unplaced)}")
    policy = RestartPolicy(**{k: v for k, v in tagged.items() if k in _POLICY_FIELDS})
    return {**{k: v for k, v in tagged.items() if k in _BACKEND_FIELDS}, "policy": policy}


def _modelserver_argv(spec: ModelSpec, router: RouterSettings, config_path: Path | None) -> tuple[str, ...]:
    argv = [*MODELSERVER, "--model", spec.name]
    if config_path is not None:
        argv += ["--config", str(config_path)]
    if _transport(spec, router) == "uds":
        argv += ["--uds", "${SOCKET}"]
    else:
        argv += ["--host", "${HOST}", "--port", "${PORT}"]  # ${HOST}: 127.0.0.1, or the address of its node
    return tuple(argv)


def _transport(spec: ModelSpec, router: RouterSettings) -> str:
    if spec.command is not None:
        return "uds" if any("${SOCKET}" in part for part in spec.command) else "tcp"
    if spec.url is not None or router.engine.kind == "ray":  # a process on a node is reached over TCP
        return "tcp"
    return router.transport


def backend_spec(spec: ModelSpec, router: RouterSettings, config_path: Path | None = None) -> BackendSpec:
    """The process-level view of a model. Equal ``process_view`` means the same process: a change of
    supervisor settings is retuned in place, and router settings never reach procman at all."""
    env: dict[str, str] = dict(spec.env)
    if spec.launches_modelserver:
        argv: tuple[str, ...] | None = _modelserver_argv(spec, router, config_path)
        env[SPEC_ENV] = spec.to_env()  # the child view: engine and launch settings only
    else:
        argv = spec.command
    return BackendSpec(
        name=spec.name,
        argv=argv,
        env=env,
        cwd=str(config_path.parent) if config_path is not None else None,
        url=spec.url,
        transport=_transport(spec, router),  # type: ignore[arg-type]
        fatal_patterns=spec.fatal_patterns,  # an engine setting the supervisor also reads (exit classification)
        resources=spec.placement.resources,
        node=spec.placement.node,
        announces_ready=spec.launches_modelserver,  # readiness over the output pipe, not found by polling
        **supervision(spec),
    )


def spare_argv(config: Config) -> tuple[str, ...]:
    """``python -m modelserver --spare --warm ENGINE:TASK,...``: a spare imports ahead what the engines of this
    config's model servers import (a config that adds one changes this, and a new command retires the spares)."""
    pairs = sorted({f"{spec.engine}:{spec.task}" for spec in config.models.values() if spec.launches_modelserver})
    return (*MODELSERVER, SPARE_FLAG, *((WARM_FLAG, ",".join(pairs)) if pairs else ()))


def spare_spec(config: Config) -> SpareSpec | None:
    """The spare interpreters of ``router.spare_interpreters`` (none on an engine with nodes): processes that
    become any model server of this config, started in the folder and environment its model servers get."""
    router = config.router
    if router.spare_interpreters <= 0 or router.engine.kind != "local":
        return None
    return SpareSpec(
        argv=spare_argv(config),
        serves=MODELSERVER,
        count=router.spare_interpreters,
        cwd=str(config.path.parent) if config.path is not None else None,  # backend_spec's cwd
        late_env=frozenset({SPEC_ENV, READY_ENV, TOKEN_ENV}),  # read by the server once assigned
        watch=(sys.executable, *_package_dirs("openvino", "openvino_genai", "uvicorn", "starlette", *WARMED_PACKAGES)),
        watch_trees=tuple(_package_dirs("modelserver")),
        device="CPU",
    )


def _package_dirs(*names: str) -> list[str]:
    """The folders of installed packages, found without importing them (the router never loads OpenVINO)."""
    found = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.origin:
            found.append(os.path.dirname(spec.origin))
    return found
