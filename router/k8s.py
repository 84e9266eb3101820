"""``ovrouter export k8s``: Kubernetes manifests for the configured models (schema-checked, not run here).

Per model that ovrouter launches (its own model server or a ``command:``): a Deployment
with ``replicas`` 1 for a model that is always on (``preload``, or ``idle_timeout_s: 0``)
and 0 for one started on demand, a ClusterIP Service, and a PersistentVolumeClaim for its
OpenVINO cache (so a restarted pod imports the compiled model instead of compiling it).

- ``startupProbe`` from ``startup_timeout_s`` (``/health`` every :data:`STARTUP_PERIOD_S`
  until the deadline), a ``readinessProbe``, and a ``livenessProbe`` from the health settings
  (``health_interval_s``, ``health_timeout_s``, ``health_failures``; none when
  ``health_interval_s`` is 0). Kubernetes restarts a wedged container the way ovrouter
  kills a hung process; OVMS's runtime has no liveness probe at all.
- a ``GPU*`` device asks for one Intel GPU (``gpu.intel.com/i915``, the Intel device plugin's
  resource); ``memory_mb`` becomes the memory request.
- model files come from a volume (``--models-claim``, mounted read-only at ``/models``):
  ``path`` is rewritten to ``/models/<file name>``.

``url:`` models are servers elsewhere and get nothing. The router itself is not part of
the output; point a ``url:`` model of a router at each Service, or run these behind
your own gateway.
"""

from __future__ import annotations

import hashlib
import math
import re
from pathlib import PurePath
from typing import Any

from modelserver.spec import SPEC_ENV, ModelSpec
from router.config import Config

__all__ = ["CONTAINER_PORT", "GPU_RESOURCE", "manifests", "resource_name"]

CONTAINER_PORT = 8000
GPU_RESOURCE = "gpu.intel.com/i915"
STARTUP_PERIOD_S = 5
CACHE_MOUNT = "/cache"
MODELS_MOUNT = "/models"
CACHE_SIZE = "2Gi"
_INVALID = re.compile(r"[^a-z0-9-]+")


def resource_name(model: str) -> str:
    """A DNS-1035 label for ``model`` (``ovrouter-<name>``), unique: a hash is added when the name was changed."""
    clean = _INVALID.sub("-", model.lower()).strip("-") or "model"
    name = f"ovrouter-{clean}"
    if clean != model or len(name) > 63:
        name = f"{name[:54].rstrip('-')}-{hashlib.sha1(model.encode()).hexdigest()[:8]}"
    return name


def manifests(config: Config, image: str = "ovrouter:latest", namespace: str | None = None,
              models_claim: str = "ovrouter-models") -> list[dict[str, Any]]:
    """Every object for every launched model, in order: PersistentVolumeClaim, Deployment, Service."""
    objects: list[dict[str, Any]] = []
    for spec in config.models.values():
        if spec.url is not None:
            continue
        name = resource_name(spec.name)
        meta = _meta(name, spec.name, namespace)
        objects += [_cache_claim(meta), _deployment(spec, meta, image, models_claim), _service(meta)]
    return objects


def _meta(name: str, model: str, namespace: str | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": _labels(name), "annotations": {"ovrouter/model": model}}
    if namespace:
        meta["namespace"] = namespace
    return meta


def _labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "ovrouter"}


def _cache_claim(meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {**meta, "name": f"{meta['name']}-cache"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": CACHE_SIZE}}},
    }


def _deployment(spec: ModelSpec, meta: dict[str, Any], image: str, models_claim: str) -> dict[str, Any]:
    always_on = spec.preload or spec.idle_timeout_s == 0
    pod = {
        "containers": [_container(spec, image)],
        "volumes": [
            {"name": "cache", "persistentVolumeClaim": {"claimName": f"{meta['name']}-cache"}},
            {"name": "models", "persistentVolumeClaim": {"claimName": models_claim, "readOnly": True}},
        ],
        "terminationGracePeriodSeconds": math.ceil(spec.stop_timeout_s) or 1,
    }
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
        "spec": {
            "replicas": 1 if always_on else 0,
            "strategy": {"type": "Recreate"},  # one process per model: a device is never shared by two pods
            "selector": {"matchLabels": _labels(meta["name"])},
            "template": {"metadata": {"labels": _labels(meta["name"])}, "spec": pod},
        },
    }


def _service(meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": meta,
        "spec": {"selector": _labels(meta["name"]),
                 "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]},
    }


def _container(spec: ModelSpec, image: str) -> dict[str, Any]:
    env = [{"name": key, "value": value} for key, value in sorted(spec.env.items())]
    if spec.command is not None:
        values = {"${PORT}": str(CONTAINER_PORT), "${HOST}": "0.0.0.0"}
        command = [_fill(part, values) for part in spec.command]
    else:
        command = ["python", "-m", "modelserver", "--model", spec.name, "--host", "0.0.0.0",
                   "--port", str(CONTAINER_PORT)]
        env.append({"name": SPEC_ENV, "value": _pod_view(spec).to_env()})
    container: dict[str, Any] = {
        "name": "model", "image": image, "command": command, "env": env,
        "ports": [{"name": "http", "containerPort": CONTAINER_PORT}],
        "volumeMounts": [{"name": "cache", "mountPath": CACHE_MOUNT},
                         {"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True}],
        "startupProbe": _probe(spec, STARTUP_PERIOD_S, max(1, math.ceil(spec.startup_timeout_s / STARTUP_PERIOD_S))),
        "readinessProbe": _probe(spec, STARTUP_PERIOD_S, 1),
    }
    if spec.health_interval_s > 0:
        container["livenessProbe"] = _probe(spec, math.ceil(spec.health_interval_s), spec.health_failures)
    resources = _resources(spec)
    if resources:
        container["resources"] = resources
    return container


def _pod_view(spec: ModelSpec) -> ModelSpec:
    """The spec the pod's model server reads: cache and model files where the pod mounts them."""
    update: dict[str, Any] = {"cache_dir": CACHE_MOUNT, "state_dir": CACHE_MOUNT}
    if spec.path is not None:
        update["path"] = f"{MODELS_MOUNT}/{PurePath(spec.path).name}"
    return spec.model_copy(update=update)


def _probe(spec: ModelSpec, period_s: int, failures: int) -> dict[str, Any]:
    http: dict[str, Any] = {"path": spec.health_path, "port": "http"}
    return {"httpGet": http, "periodSeconds": max(1, period_s),
            "timeoutSeconds": max(1, math.ceil(spec.health_timeout_s)), "failureThreshold": max(1, failures)}


def _resources(spec: ModelSpec) -> dict[str, Any]:
    limits: dict[str, Any] = {}
    requests: dict[str, Any] = {}
    if "GPU" in spec.device.upper():
        limits[GPU_RESOURCE] = 1
        requests[GPU_RESOURCE] = 1
    if spec.memory_mb is not None:
        requests["memory"] = f"{math.ceil(spec.memory_mb)}Mi"
    return {key: value for key, value in (("limits", limits), ("requests", requests)) if value}


def _fill(part: str, values: dict[str, str]) -> str:
    for token, value in values.items():
        part = part.replace(token, value)
    return part
