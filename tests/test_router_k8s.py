"""``ovrouter export k8s``: the manifests are valid against a current Kubernetes API schema (offline, with
kubernetes-validate) and say what the config says: replicas, probes, the Intel GPU resource, the cache volume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from router.cli import main
from router.config import load_config
from router.k8s import GPU_RESOURCE, manifests, resource_name
from tests.router_helpers import fake_model, write_config

#: The newest schema kubernetes-validate ships (checked strictly: unknown fields are errors).
K8S_VERSION = kubernetes_validate.utils.latest_version()


def _config(tmp_path: Path) -> Path:
    models = {
        "chat": fake_model(preload=True, health_interval_s=7, health_timeout_s=3, health_failures=4,
                           startup_timeout_s=60),
        "Big_GPU.model": {"task": "llm", "path": str(tmp_path / "m.gguf"), "device": "GPU.1", "memory_mb": 900,
                          "idle_timeout_s": 300, "health_interval_s": 0},
        "llama": {"command": ["llama-server", "--host", "${HOST}", "--port", "${PORT}"], "idle_timeout_s": 0},
        "remote": {"url": "http://10.0.0.5:9000"},
    }
    return write_config(tmp_path, models)


def _by_kind(objects: list[dict[str, Any]], kind: str, model: str) -> dict[str, Any]:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["annotations"]["ovrouter/model"] == model)


def test_every_manifest_is_valid_against_the_kubernetes_schema(tmp_path: Path) -> None:
    objects = manifests(load_config(_config(tmp_path)), namespace="llm")
    assert {o["kind"] for o in objects} == {"Deployment", "Service", "PersistentVolumeClaim"}
    assert len(objects) == 9  # the url model gets nothing
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    broken = _by_kind(objects, "Deployment", "chat") | {"spec": {"replicas": "one"}}
    with pytest.raises(kubernetes_validate.ValidationError):  # the check can fail
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_replicas_probes_gpu_and_cache_follow_the_config(tmp_path: Path) -> None:
    objects = manifests(load_config(_config(tmp_path)))
    chat, gpu, llama = (_by_kind(objects, "Deployment", m) for m in ("chat", "Big_GPU.model", "llama"))
    assert chat["spec"]["replicas"] == 1 and llama["spec"]["replicas"] == 1 and gpu["spec"]["replicas"] == 0
    box = chat["spec"]["template"]["spec"]["containers"][0]
    assert box["startupProbe"]["periodSeconds"] * box["startupProbe"]["failureThreshold"] >= 60
    assert box["livenessProbe"] == {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 7,
                                    "timeoutSeconds": 3, "failureThreshold": 4}
    assert {"name": "cache", "mountPath": "/cache"} in box["volumeMounts"]
    gpu_box = gpu["spec"]["template"]["spec"]["containers"][0]
    assert "livenessProbe" not in gpu_box  # health_interval_s 0: no probe while ready, as under ovrouter
    assert gpu_box["resources"]["limits"] == {GPU_RESOURCE: 1} and gpu_box["resources"]["requests"]["memory"] == "900Mi"
    spec_env = next(e["value"] for e in gpu_box["env"] if e["name"] == "OVROUTER_MODEL_SPEC")
    assert '"path":"/models/m.gguf"' in spec_env and '"cache_dir":"/cache"' in spec_env
    assert "resources" not in box  # a CPU model asks for no GPU
    assert llama["spec"]["template"]["spec"]["containers"][0]["command"] == [
        "llama-server", "--host", "0.0.0.0", "--port", "8000"]
    service = _by_kind(objects, "Service", "Big_GPU.model")
    assert service["spec"]["selector"] == gpu["spec"]["selector"]["matchLabels"]
    assert resource_name("Big_GPU.model") != resource_name("big-gpu-model")  # cleaned names stay unique


def test_the_cli_prints_the_manifests_as_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "k8s", "--config", str(_config(tmp_path)), "--image", "registry.local/ovrouter:1"]) == 0
    documents = list(yaml.safe_load_all(capsys.readouterr().out))
    assert len(documents) == 9
    images = {d["spec"]["template"]["spec"]["containers"][0]["image"] for d in documents if d["kind"] == "Deployment"}
    assert images == {"registry.local/ovrouter:1"}
