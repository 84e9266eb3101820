"""The whole config file as typed, validated, frozen objects.

``load_config(path)`` parses and validates everything or raises :class:`ConfigError` with
one line per problem, each naming the key path and the bad value. The schema of one
model lives in :mod:`modelserver.spec` (with the file readers of :mod:`modelserver.modelfiles`, the
only pieces of ``modelserver`` the router imports: pure data, no engine); this module adds the
``router`` and ``groups`` sections and the cross-checks
(aliases that clash, groups that do not exist).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from modelserver.modelfiles import a_kind, config_json, likely_task
from modelserver.spec import (
    DEFAULT_CACHE_DIR,
    DEFAULT_STATE_DIR,
    PER_MODEL_KEYS,
    ConfigError,
    ModelSpec,
    build_model_spec,
    format_errors,
    read_yaml,
)
from procman.address import DEFAULT_PORT_RANGE
from router.state.budget import parse_budget

__all__ = ["Config", "ConfigError", "EngineSettings", "GroupSpec", "RouterSettings", "load_config", "parse_config"]

TOP_LEVEL_KEYS = ("router", "defaults", "models", "groups")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EngineSettings(_Frozen):
    """``router.engine``: where model processes run. ``local``: children of the router; ``ray``: on a Ray cluster."""

    kind: Literal["local", "ray"] = Field("local", description="local | ray")
    address: str = Field("auto", description="ray: the cluster to join (auto, or host:port of its head)")
    namespace: str = Field("ovrouter", min_length=1, description="ray: the namespace of ovrouter's actors")


class RouterSettings(_Frozen):
    """The ``router`` section."""

    host: str = Field("127.0.0.1", description="address the router listens on")
    port: int = Field(8080, ge=0, le=65535, description="port the router listens on")
    api_keys: tuple[str, ...] = Field((), description="Bearer (or x-api-key) keys for /v1 and /upstream; empty = open")
    admin_keys: tuple[str, ...] = Field(
        (), description="Bearer (or x-api-key) keys for /api and /metrics; empty = same as api_keys")
    state_dir: str = Field(
        DEFAULT_STATE_DIR, description="sockets, logs, converted models (relative to the config file)"
    )
    cache_dir: str = Field(DEFAULT_CACHE_DIR, description="OpenVINO CACHE_DIR handed to every model server")
    transport: Literal["uds", "tcp"] = Field("uds", description="how the router reaches model servers: uds | tcp")
    engine: EngineSettings = Field(
        default_factory=EngineSettings, description="where model processes run: {kind: local} or {kind: ray, ...}"
    )
    port_range: tuple[int, int] = Field(DEFAULT_PORT_RANGE, description="TCP ports for model servers (transport tcp)")
    max_loaded_models: int = Field(0, ge=0, description="models loaded at once (LRU idle stops first); 0 = no limit")
    shutdown_timeout_s: float = Field(30, ge=0, description="on SIGTERM, how long in-flight requests may finish")
    watch: bool = Field(True, description="reload when config.yaml changes on disk")
    ollama_port: int | None = Field(
        None, ge=1, le=65535, description="also serve Ollama's API at the root of this port (e.g. 11434) for apps "
        "that cannot take a path prefix; null = only under /ollama on `port`"
    )
    cors_origins: tuple[str, ...] | None = Field(
        None, description='browser origins allowed by CORS ("*" = any); unset = pages on this machine '
        "(http://localhost:*, http://127.0.0.1:*, http://[::1]:*); [] = none"
    )
    metrics_names: tuple[Literal["ovrouter", "vllm"], ...] = Field(
        ("ovrouter",), description="metric families /metrics exposes: ovrouter, and vllm (the same "
        "figures under vLLM's vllm:* names, label model_name, for its Grafana boards)"
    )
    device_failure_threshold: int = Field(
        3, ge=0, description="fatal errors of this many models on one GPU or NPU within 10 min mark it unhealthy "
        "(never the CPU); 0 = off"
    )
    max_buffered_body_mb: float = Field(
        256, gt=0, description="request bodies held in memory at once, all models together (never below the "
        "largest max_request_mb); beyond it a request waits body_wait_s, then 503"
    )
    body_wait_s: float = Field(30, gt=0, description="how long a request waits for room under max_buffered_body_mb")
    body_timeout_s: float = Field(
        30, gt=0, description="the longest silence while a request body is read (then 408)"
    )
    head_timeout_s: float = Field(
        10, gt=0, description="a connection must send a complete request head this soon after it opens or after "
        "the first byte of its next request, else it is closed"
    )
    keep_alive_timeout_s: float = Field(5, gt=0, description="an idle keep-alive connection is closed after this")
    max_connections: int = Field(
        0, ge=0, description="open client connections; beyond it a new one closes the one idle the longest "
        "(503 when every one has a request under way); 0 = auto (from the open-file limit)"
    )
    responses_store_max: int = Field(
        1000, ge=0, description="finished Responses kept for previous_response_id and GET /v1/responses/{id} "
        "(oldest dropped first); 0 = store none"
    )
    responses_store_mb: float = Field(64, gt=0, description="their JSON size, all together, in MiB")
    responses_store_ttl_s: float = Field(3600, gt=0, description="how long a stored Response is kept")
    spare_interpreters: int = Field(
        1, ge=0, le=8, description="model-server interpreters kept started and past their imports (Python, "
        "uvicorn, and the engines of the configured models' tasks: openvino, openvino_genai) while a model is "
        "stopped: the next cold start takes one instead of a fresh process (about 0.6-0.9 s less on a 2-core "
        "machine) and another starts behind it; each holds about 89-96 MiB (58 MiB with only fake models), "
        "counted in memory_budget CPU. 0 = none; engine ray: none"
    )
    memory_budget: str | dict[str, int | float | str] | None = Field(
        None, description="memory per device: `auto`, or {CPU: 12GiB, GPU.0: 75%, GPU.1: auto}; null = counts only"
    )

    @field_validator("ollama_port")
    @classmethod
    def _own_port(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value == info.data.get("port"):
            raise ValueError(f"expected a port other than router.port ({value}), or null")
        return value

    @field_validator("port_range")
    @classmethod
    def _ordered(cls, value: tuple[int, int]) -> tuple[int, int]:
        low, high = value
        if not 1 <= low <= high <= 65535:
            raise ValueError(f"expected [low, high] with 1 <= low <= high <= 65535, got {list(value)}")
        return value

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _budget(cls, value: Any) -> str | dict[str, int | float | str] | None:
        return parse_budget(value)

    @field_validator("api_keys", "admin_keys")
    @classmethod
    def _keys(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        # an empty key (an unset variable templated in) would let a request with no key through
        for key in value:
            if not re.fullmatch(r"[\x21-\x7e]+", key):
                what = "an empty key" if not key.strip() else "a key with spaces or characters outside printable ASCII"
                raise ValueError(f"expected keys of printable ASCII characters without spaces, got {what}")
        return value

    @field_validator("metrics_names")
    @classmethod
    def _names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("expected at least one of ovrouter, vllm")
        return tuple(dict.fromkeys(value))

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        for origin in value or ():
            if origin != "*" and not re.fullmatch(r"https?://[^/?#\s]+", origin):
                raise ValueError(f'expected "*" or origins like "http://localhost:3000" (no path), got {origin!r}')
        return value

    @property
    def effective_admin_keys(self) -> tuple[str, ...]:
        return self.admin_keys or self.api_keys


class GroupSpec(_Frozen):
    """One entry of ``groups``: models that share a device budget."""

    max_loaded: int = Field(0, ge=0, description="models of this group loaded at once; 0 = no limit")


@dataclass(frozen=True, slots=True)
class Config:
    """A validated config; ``path`` is the file it came from (None when built in memory)."""

    router: RouterSettings
    models: Mapping[str, ModelSpec]
    groups: Mapping[str, GroupSpec]
    path: Path | None = None


def _section(data: Mapping[str, Any], key: str, errors: list[str]) -> dict[str, Any]:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        errors.append(f"{key}: expected a mapping, got {json.dumps(value, default=str)}")
        return {}
    return dict(value)


def _router(raw: dict[str, Any], base_dir: Path, errors: list[str]) -> RouterSettings:
    try:
        settings = RouterSettings.model_validate(raw)
    except ValidationError as exc:
        errors.extend(format_errors(exc, "router", secret=frozenset({"api_keys", "admin_keys"})))
        return RouterSettings()
    state_dir, cache_dir = _absolute(settings.state_dir, base_dir), _absolute(settings.cache_dir, base_dir)
    return settings.model_copy(update={"state_dir": state_dir, "cache_dir": cache_dir})


def _absolute(value: str, base_dir: Path) -> str:
    path = Path(os.path.expanduser(value))
    return str(path if path.is_absolute() else (base_dir / path).resolve())


def _groups(raw: dict[str, Any], errors: list[str]) -> dict[str, GroupSpec]:
    groups = {}
    for name, value in raw.items():
        try:
            groups[str(name)] = GroupSpec.model_validate(value or {})
        except ValidationError as exc:
            errors.extend(format_errors(exc, f"groups.{name}"))
    return groups


def _models(
    raw: dict[str, Any], defaults: dict[str, Any], router: RouterSettings, base_dir: Path, errors: list[str]
) -> dict[str, ModelSpec]:
    for key in sorted(set(defaults) & PER_MODEL_KEYS):
        errors.append(f"defaults.{key}: this key is per model; set it under models.<name>")
        del defaults[key]
    inherited = {"state_dir": router.state_dir, "cache_dir": router.cache_dir}
    models = {}
    for name, value in raw.items():
        try:
            models[str(name)] = build_model_spec(str(name), value, defaults, base_dir, inherited)
        except ConfigError as exc:
            errors.extend(exc.errors)
    return models


def _cross_check(models: Mapping[str, ModelSpec], groups: Mapping[str, GroupSpec], errors: list[str]) -> None:
    owners: dict[str, str] = {name: name for name in models}
    for spec in models.values():
        for alias in spec.aliases:
            other = owners.setdefault(alias, spec.name)
            if other != spec.name:
                errors.append(f"models.{spec.name}.aliases: {alias!r} already names model {other!r}")
        if spec.group is not None and spec.group not in groups:
            known = ", ".join(sorted(groups)) or "none"
            errors.append(f"models.{spec.name}.group: no group {spec.group!r} under `groups` (known: {known})")


def parse_config(data: Mapping[str, Any], base_dir: Path, path: Path | None = None) -> Config:
    """Validate an already-parsed mapping; every problem is collected before raising."""
    errors: list[str] = []
    for key in data:
        if key not in TOP_LEVEL_KEYS:
            errors.append(f"{key}: unknown top-level key (expected one of {', '.join(TOP_LEVEL_KEYS)})")
    router = _router(_section(data, "router", errors), base_dir, errors)
    groups = _groups(_section(data, "groups", errors), errors)
    models = _models(_section(data, "models", errors), _section(data, "defaults", errors), router, base_dir, errors)
    _cross_check(models, groups, errors)
    if errors:
        raise ConfigError(list(dict.fromkeys(errors)), str(path) if path else "config")
    return Config(router=router, models=models, groups=groups, path=path)


def missing_paths(config: Config, names: Iterable[str] | None = None) -> list[str]:
    """Valid, but these models (of ``names``; default all) would fail to start, a 503 naming the path:
    said by ``ovrouter check``, at serve and on a reload that adds or changes them."""
    chosen = config.models if names is None else {name: config.models[name] for name in names}
    return [f"models.{name}.path: {spec.path} does not exist (the model cannot start)"
            for name, spec in chosen.items()
            if spec.engine == "openvino" and spec.path and not (spec.url or spec.command)
            and not Path(spec.path).exists()]


def wrong_tasks(config: Config, names: Iterable[str] | None = None) -> list[str]:
    """Valid, but these ``llm``/``vlm`` models (of ``names``; default all) are folders whose ``config.json`` says they
    are another kind of model (:func:`modelserver.modelfiles.likely_task`): their load would fail naming the task to
    set, so ``ovrouter check``, serve and a reload say it first."""
    chosen = config.models if names is None else {name: config.models[name] for name in names}
    found = []
    for name, spec in chosen.items():
        if spec.engine != "openvino" or spec.task not in ("llm", "vlm") or not spec.path or spec.url or spec.command:
            continue
        if Path(spec.path).is_dir() and (likely := likely_task(config_json(Path(spec.path)))) is not None:
            task, evidence = likely
            found.append(f"models.{name}.task: {spec.task}, but {spec.path} looks like {a_kind(task, evidence)}: "
                         f"set task: {task} (the model cannot start)")
    return found


def start_warnings(config: Config, names: Iterable[str] | None = None) -> list[str]:
    """What would keep these models (of ``names``; default all) from starting though the config is valid."""
    return missing_paths(config, names) + wrong_tasks(config, names)


def load_config(path: Path) -> Config:
    """Read and validate a config file; relative paths are relative to its folder."""
    path = path.resolve()
    return parse_config(read_yaml(path), path.parent, path)

