"""The schema of one model: pure data, no engine imports.

This is the only module of ``modelserver`` that the router imports. ``router/config.py``
builds the whole config from it; the model server reads the same schema, so the two can
never disagree about what a key means.

A model's settings are the ``defaults`` section merged under the model's own mapping
(nested mappings such as ``ov_config`` are merged key by key), then validated into a
frozen :class:`ModelSpec`.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = [
    "AUDIENCES",
    "CHILD_AUDIENCES",
    "DEFAULT_CACHE_DIR",
    "DEFAULT_FATAL_PATTERNS",
    "DEFAULT_STATE_DIR",
    "DEFAULT_SUSPECT_PATTERNS",
    "SPEC_ENV",
    "ConfigError",
    "FakeSpec",
    "PlacementSpec",
    "Audience",
    "ModelSpec",
    "Task",
    "audience_of",
    "build_model_spec",
    "fields_for",
    "format_errors",
    "load_model_spec",
    "merge_defaults",
    "read_yaml",
    "restarts_process",
]

Task = Literal["llm", "embeddings", "rerank", "transcription", "speech", "vlm"]
EngineName = Literal["openvino", "fake"]

#: Environment variable through which the router hands a child the exact spec it validated.
SPEC_ENV = "OVROUTER_MODEL_SPEC"

#: ``router.state_dir`` and ``router.cache_dir`` when the config says nothing (``router/config.py`` and a
#: model server started from a config file both take them from here).
DEFAULT_STATE_DIR = ".ovrouter"
DEFAULT_CACHE_DIR = ".ovrouter/ov-cache"

#: Engine errors (and last stderr lines of a process that exited non-zero) after which the
#: device must not be touched again: the process answers, exits, and is replaced. Matched as
#: case-insensitive substrings. The evidence: OpenVINO's GPU plugin messages after a kernel or
#: queue failure ("any further OpenCL call may cause the application to hang"), the OpenCL
#: status names and their numeric codes, Level Zero's device-lost results.
DEFAULT_FATAL_PATTERNS: tuple[str, ...] = (
    "CL_OUT_OF_RESOURCES",
    "error code: -5",
    "GPU plugin may be unable to finish correctly",
    "GPU plugin can't finish correctly",
    "CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST",
    "error code: -14",
    "CL_INVALID_EVENT",
    "error code: -58",
    "CL_INVALID_COMMAND_QUEUE",
    "error code: -36",
    "DEVICE_LOST",
    "device hung, reset, was removed",
    "failed with code 1879048193",
)
#: Errors that may mean a sick device, or only a request too big for it: each is an ordinary
#: 500, and the second within a minute replaces the process.
DEFAULT_SUSPECT_PATTERNS: tuple[str, ...] = ("CL_MEM_OBJECT_ALLOCATION_FAILURE", "could not execute a primitive")

#: Keys of a model that only make sense per model; they are refused in ``defaults``.
PER_MODEL_KEYS = frozenset({"name", "path", "aliases", "command", "url", "preload", "group"})


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


#: Who reads a setting: the model server's engine, the launch of its process, the supervisor
#: (procman: health, idle, stop, restart policy) or the router (routing, limits, timeouts).
#: A change of an ``engine`` or ``launch`` setting restarts the model's process; a change of a
#: ``supervisor`` or ``router`` setting is applied to the running process.
Audience = Literal["engine", "launch", "supervisor", "router"]
AUDIENCES: tuple[Audience, ...] = ("engine", "launch", "supervisor", "router")
#: What the model's process receives (by inclusion: nothing else reaches it).
CHILD_AUDIENCES: tuple[Audience, ...] = ("engine", "launch")


def _field(audience: Audience) -> Any:
    def field(*args: Any, **kwargs: Any) -> Any:
        return Field(*args, json_schema_extra={"audience": audience}, **kwargs)

    field.__name__ = f"for_{audience}"
    return field


for_engine, for_launch, for_supervisor, for_router = (_field(a) for a in AUDIENCES)


class FakeSpec(_Frozen):
    """Knobs of the built-in deterministic engine (``engine: fake``)."""

    load_s: float = Field(0.2, ge=0, description="seconds the fake load takes before /health turns 200")
    token_delay_s: float = Field(0.01, ge=0, description="seconds between streamed words")
    dims: int = Field(64, ge=1, le=8192, description="size of fake embedding vectors")
    fail_load: str | None = Field(None, description="make the load fail with this message (tests a failed start)")
    memory_mb: float | None = Field(
        None, gt=0, description="size the fake reports on /health as its memory (exercises memory_budget)"
    )


class PlacementSpec(_Frozen):
    """Where the model's process may run on an engine with nodes (``router.engine.kind: ray``)."""

    resources: dict[str, float] = Field(
        default_factory=dict, description='what it needs of a node\'s advertised resources, e.g. {"GPU.0": 1}'
    )
    node: str | None = Field(None, description="run it on this node only (a node id, id prefix, name or IP)")


class ModelSpec(_Frozen):
    """Everything about one model, after ``defaults`` were merged under it."""

    name: str = for_engine(..., min_length=1, description="the model's key under `models`")
    task: Task = for_engine("llm", description="llm | embeddings | rerank | transcription | speech | vlm")
    engine: EngineName = for_engine("openvino", description="openvino | fake")
    path: str | None = for_engine(
        None, description="a .gguf file or an OpenVINO IR folder (relative to the config file)"
    )
    device: str = for_engine(
        "CPU", min_length=1, description="OpenVINO device string, passed through (CPU, GPU.0, NPU…)"
    )
    aliases: tuple[str, ...] = for_router((), description="other names that route to this model")
    preload: bool = for_router(False, description="start with the router instead of on the first request")
    ov_config: dict[str, Any] = for_engine(default_factory=dict, description="OpenVINO properties, passed through")
    scheduler: dict[str, Any] = for_engine(default_factory=dict, description=(
        "openvino_genai.SchedulerConfig fields; `llm` turns `enable_prefix_caching` on (and on CPU a fixed cache "
        "sized for `max_concurrency` full contexts, at most 1 GB) unless set: docs/prefix-caching.md"))
    group: str | None = for_router(None, description="a key of `groups` (shared max_loaded)")
    pin: bool = for_router(False, description="never stopped to make room for another model")
    min_residency_s: float = for_router(
        10, ge=0, description="not stopped to make memory room until loaded this long (no thrashing)"
    )
    restart: Literal["rolling", "stop-first"] = for_router(
        "rolling", description="a change or restart starts the new process first where memory allows"
    )
    memory_mb: float | None = for_router(
        None, gt=0, description="its size on its device, when measuring is not wanted (a `command:` reports none)"
    )
    fake: FakeSpec = for_engine(default_factory=FakeSpec, description="fake engine settings")
    save_ov_model: bool = for_engine(
        False, description="convert a .gguf to OpenVINO IR once under state_dir and reuse it"
    )
    options: dict[str, Any] = for_engine(default_factory=dict, description="task-specific engine options")
    default_max_tokens: int = for_engine(
        512, ge=1, description="max_tokens when a request gives none (at most what the context leaves)"
    )
    loading_progress: Literal["comments", "reasoning", "off"] = for_router(
        "comments", description="a stream waiting on a start gets `: loading` comments (and reasoning_content chunks)"
    )

    command: tuple[str, ...] | None = for_launch(
        None, description="launch this OpenAI-compatible server instead; ${PORT} / ${SOCKET} are substituted"
    )
    url: str | None = for_launch(None, description="a server elsewhere: proxied and health-checked, never launched")
    health_path: str = for_supervisor("/health", description="path that answers 200 when the backend is ready")
    health_method: Literal["GET", "HEAD"] = for_supervisor("GET", description="HTTP method of the health probe")
    path_prefix: str = for_router(
        "", pattern=r"^(/[^/?#]+)*$",
        description="put before the path of every request to a `command`/`url` backend (OVMS: /v3)",
    )
    env: dict[str, str] = for_launch(default_factory=dict, description=(
        "extra environment for the model process (a model with its own starts a fresh process, never a spare "
        "interpreter: variables read at start, such as `MALLOC_ARENA_MAX`, take effect)"))
    placement: PlacementSpec = for_launch(
        default_factory=PlacementSpec, description="engine ray: the node resources it needs, or its node"
    )
    tool_parser: Literal["hermes", "llama3_json", "pythonic", "mistral", "none"] | None = for_engine(
        None, description="form of the model's tool calls; null = detected from the chat template"
    )
    max_n: int = for_engine(8, ge=1, le=128, description="largest `n` (choices per chat request) this model serves")

    idle_timeout_s: float = for_supervisor(900, ge=0, description="stop after this long without requests; 0 = never")
    startup_timeout_s: float = for_supervisor(180, gt=0, description="deadline for /health to answer 200 after a start")
    health_interval_s: float = for_supervisor(
        2, ge=0, description="seconds between health probes while ready; 0 = probe only while starting"
    )
    health_timeout_s: float = for_supervisor(4, gt=0, description="timeout of one health probe")
    health_failures: int = for_supervisor(2, ge=1, description="consecutive failed probes that mark a backend hung")
    stuck_after_s: float = for_engine(
        30, ge=0, description="work waiting and no generation step finished this long: /health says stuck "
        "(503), so the probes replace the process; 0 = never"
    )
    stop_timeout_s: float = for_supervisor(10, ge=0, description="SIGTERM grace before SIGKILL")
    request_timeout_s: float = for_router(600, gt=0, description="deadline for the first byte of a backend response")
    stream_idle_timeout_s: float = for_router(300, gt=0, description="longest silence allowed between streamed chunks")
    drain_timeout_s: float = for_supervisor(
        300, ge=0, description="how long a reload/unload waits for in-flight requests"
    )
    max_concurrency: int = for_router(16, ge=1, description="requests in flight per model")
    max_queue: int = for_router(64, ge=0, description="requests waiting for a slot, then 429")
    max_request_mb: float = for_engine(64, gt=0, description="request body limit in MiB, then 413")
    fatal_patterns: tuple[str, ...] = for_engine(
        DEFAULT_FATAL_PATTERNS, description="engine errors that mean the process is beyond repair"
    )
    suspect_patterns: tuple[str, ...] = for_engine(
        DEFAULT_SUSPECT_PATTERNS, description="errors that may mean a sick device: a 500; two in 60 s restart it"
    )
    retry_on_fatal: bool = for_router(True, description="retry a non-streamed request once on the fresh backend")
    max_resumes: int = for_router(
        2, ge=0, description="times a stream is continued on a fresh process after its backend died; 0 = cut it"
    )
    stall_timeout_s: float = for_router(
        60, gt=0, description="a generation without a token this long (health still fine) means a hung backend: "
        "a stream's silence, or a non-streamed request's heartbeats showing no progress"
    )
    max_retries: int = for_supervisor(
        5, ge=0, description="failed starts/crashes in a row before backing off at the cap"
    )
    backoff_base_s: float = for_supervisor(1.0, ge=0, description="first backoff delay; doubles per failure")
    backoff_max_s: float = for_supervisor(60.0, ge=0, description="cap of the backoff delay")
    stable_after_s: float = for_supervisor(30.0, ge=0, description="uptime after which the failure count resets")

    cache_dir: str | None = for_engine(None, description="OpenVINO CACHE_DIR (from router.cache_dir unless set)")
    state_dir: str | None = for_engine(None, description="where converted models live (from router.state_dir)")

    @model_validator(mode="after")
    def _one_kind(self) -> ModelSpec:
        if self.command is not None and self.url is not None:
            raise ValueError("give either `command` or `url`, not both")
        if self.command is not None and len(self.command) == 0:
            raise ValueError("`command` must not be empty")
        if self.path_prefix and self.launches_modelserver:
            raise ValueError("`path_prefix` is for `command` or `url` backends (the built-in server needs none)")
        if self.launches_modelserver and self.engine == "openvino" and not self.path:
            raise ValueError("`path` is required for engine openvino (a .gguf file or an OpenVINO IR folder)")
        return self

    @property
    def launches_modelserver(self) -> bool:
        """True when the backend is our own ``python -m modelserver``."""
        return self.command is None and self.url is None

    @property
    def max_request_bytes(self) -> int:
        return int(self.max_request_mb * 1024 * 1024)

    def child_view(self) -> ModelSpec:
        """This spec as the model's process sees it: the engine and launch settings, the rest at defaults."""
        return ModelSpec.model_validate(self.model_dump(include=set(fields_for(*CHILD_AUDIENCES))))

    def to_env(self) -> str:
        """JSON for :data:`SPEC_ENV` (the :meth:`child_view`)."""
        return self.child_view().model_dump_json()

    @classmethod
    def from_env(cls, value: str) -> ModelSpec:
        return cls.model_validate_json(value)


def audience_of(name: str) -> Audience:
    """Who reads the ModelSpec setting ``name`` (untagged settings count as ``engine``: they restart)."""
    extra = ModelSpec.model_fields[name].json_schema_extra
    audience = extra.get("audience") if isinstance(extra, dict) else None
    return audience if audience in AUDIENCES else "engine"


def fields_for(*audiences: Audience) -> frozenset[str]:
    """The ModelSpec settings read by any of ``audiences``."""
    return frozenset(name for name in ModelSpec.model_fields if audience_of(name) in audiences)


def restarts_process(name: str) -> bool:
    """Whether changing setting ``name`` of a loaded model restarts its process."""
    return audience_of(name) in CHILD_AUDIENCES


class ConfigError(ValueError):
    """A config that does not validate; ``errors`` holds one line per problem."""

    def __init__(self, errors: list[str], source: str = "config") -> None:
        self.errors = errors
        self.source = source
        super().__init__(f"{source}: " + "; ".join(errors))


def merge_defaults(defaults: Mapping[str, Any], model: Mapping[str, Any]) -> dict[str, Any]:
    """``defaults`` under ``model``; nested mappings merge key by key, the model winning."""
    merged: dict[str, Any] = dict(defaults)
    for key, value in model.items():
        base = merged.get(key)
        if isinstance(base, Mapping) and isinstance(value, Mapping):
            merged[key] = merge_defaults(base, value)
        else:
            merged[key] = value
    return merged


def _describe(err: Mapping[str, Any], field: str | None) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    bound = _bound_of(field)
    phrases = {
        "float_parsing": "expected a number" + bound,
        "float_type": "expected a number" + bound,
        "int_parsing": "expected an integer" + bound,
        "int_type": "expected an integer" + bound,
        "int_from_float": "expected an integer" + bound,
        "bool_parsing": "expected true or false",
        "bool_type": "expected true or false",
        "string_type": "expected a string",
        "dict_type": "expected a mapping",
        "tuple_type": "expected a list",
        "list_type": "expected a list",
        "missing": "required key is missing",
        "greater_than_equal": f"expected a number >= {ctx.get('ge')}",
        "greater_than": f"expected a number > {ctx.get('gt')}",
        "less_than_equal": f"expected a number <= {ctx.get('le')}",
        "string_too_short": "must not be empty",
        "literal_error": f"expected one of {ctx.get('expected')}",
    }
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    return phrases.get(kind, str(err["msg"]))


def _bound_of(field: str | None) -> str:
    info = ModelSpec.model_fields.get(field or "")
    for meta in getattr(info, "metadata", []):
        for attr, sign in (("ge", ">="), ("gt", ">")):
            if getattr(meta, attr, None) is not None:
                return f" {sign} {getattr(meta, attr)}"
    return ""


def format_errors(exc: ValidationError, prefix: str, from_defaults: frozenset[str] = frozenset(),
                  secret: frozenset[str] = frozenset()) -> list[str]:
    """One readable line per pydantic error: ``key.path: what was expected, got <value>``.

    ``from_defaults`` names the top-level keys whose value came from ``defaults``; their
    errors are reported under ``defaults.`` so the user edits the right place. The value of a
    top-level key in ``secret`` (API keys) is never repeated: these lines reach logs and ``/api``.
    """
    lines = []
    for err in exc.errors():
        loc = [str(part) for part in err["loc"]]
        top = loc[0] if loc else None
        path = ".".join(["defaults", *loc] if top in from_defaults else [prefix, *loc]) if loc else prefix
        message = _describe(err, top if len(loc) == 1 else None)
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(loc[-1], ModelSpec.model_fields, n=1)
            message = "unknown key" + (f" (did you mean {close[0]!r}?)" if close else "")
        elif err["type"] != "missing" and "input" in err and top not in secret:
            message += f", got {json.dumps(err['input'], default=str)}"
        lines.append(f"{path}: {message}")
    return lines


def build_model_spec(
    name: str,
    raw: Any,
    defaults: Mapping[str, Any] | None = None,
    base_dir: Path | None = None,
    inherited: Mapping[str, Any] | None = None,
) -> ModelSpec:
    """Merge, validate and resolve one model; raises :class:`ConfigError` listing every problem.

    ``inherited`` holds router-wide values (``cache_dir``, ``state_dir``) used when the
    model does not set them; ``base_dir`` anchors relative paths (the config's folder).
    """
    prefix = f"models.{name}"
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError([f"{prefix}: expected a mapping, got {json.dumps(raw, default=str)}"])
    defaults = defaults or {}
    merged = merge_defaults({**(inherited or {}), **defaults}, raw)
    merged["name"] = name
    try:
        spec = ModelSpec.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(format_errors(exc, prefix, frozenset(set(defaults) - set(raw)))) from None
    return _resolve_paths(spec, base_dir) if base_dir is not None else spec


def _resolve_paths(spec: ModelSpec, base_dir: Path) -> ModelSpec:
    def absolute(value: str | None) -> str | None:
        if value is None:
            return None
        path = Path(os.path.expanduser(value))
        return str(path if path.is_absolute() else (base_dir / path).resolve())

    paths = {"path": spec.path, "cache_dir": spec.cache_dir, "state_dir": spec.state_dir}
    return spec.model_copy(update={key: absolute(value) for key, value in paths.items()})


def read_yaml(path: Path) -> dict[str, Any]:
    """The config file as a mapping; :class:`ConfigError` when it is not readable YAML."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError([f"cannot read {path}: {exc.strerror}"], str(path)) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"not valid YAML: {exc}".replace("\n", " ")], str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"top level: expected a mapping, got {type(data).__name__}"], str(path))
    return data


def load_model_spec(config_path: Path, name: str) -> ModelSpec:
    """One model out of a config file, the way the router would build it."""
    data = read_yaml(config_path)
    models = data.get("models") or {}
    if name not in models:
        known = ", ".join(sorted(models)) or "none"
        raise ConfigError([f"models.{name}: no such model (known: {known})"], str(config_path))
    router = data.get("router") or {}
    inherited = {
        "state_dir": router.get("state_dir", DEFAULT_STATE_DIR),
        "cache_dir": router.get("cache_dir", DEFAULT_CACHE_DIR),
    }
    return build_model_spec(name, models[name], data.get("defaults") or {}, config_path.parent.resolve(), inherited)
