"""Metrics and cold-start feedback end to end, on a real router in front of real model-server processes:
the OpenAI SDK's stream after a cold start, ``ovrouter status`` and the measured RSS, the real pipeline's
KV-cache figures. The metrics of known traffic, comment lines before a cold stream's data and a failed
start after the head: tests/test_router_metrics_inprocess.py; /api/events, request cancellation, the
vLLM names and the streams' end at shutdown: tests/test_router_api_inprocess.py."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.metrics import Metrics
from router.vllm_metrics import VLLM_NAMES
from tests.router_helpers import fake_model, running_router, write_config

CHAT = {"model": "m", "messages": [{"role": "user", "content": "one two three four five"}]}


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def _sse_lines(client: httpx.AsyncClient, body: dict[str, Any]) -> list[str]:
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        return [line async for line in resp.aiter_lines()]


async def test_the_sdk_stream_is_the_same_after_a_cold_start(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"m": fake_model(fake={"load_s": 3, "token_delay_s": 0.005},
                                                     loading_progress="comments"),
                                     "r": fake_model(fake={"load_s": 3, "token_delay_s": 0.005},
                                                     loading_progress="reasoning")})
    async with running_router(config) as router:
        sdk = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)

        async def deltas(model: str) -> list[tuple[str | None, str | None]]:
            stream = await sdk.chat.completions.create(model=model, messages=CHAT["messages"], stream=True)
            out = []
            async for chunk in stream:
                if chunk.choices:
                    delta = chunk.choices[0].delta
                    out.append((delta.content, getattr(delta, "reasoning_content", None)))
            return out

        cold, warm = await deltas("m"), await deltas("m")
        assert cold == warm and "".join(c or "" for c, _ in cold) == "one two three four five"
        reasoning = await deltas("r")
        thinking = [r for _, r in reasoning if r]
        assert thinking and all(r.startswith("loading r ") for r in thinking)
        assert "".join(c or "" for c, _ in reasoning) == "one two three four five"
        await sdk.close()


def _exported_names() -> set[str]:
    names = set()
    for family in Metrics().registry.collect():
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
        names.update(family.name + suffix for suffix in ("_total", "_bucket", "_sum", "_count"))
    return names


def test_the_grafana_dashboard_and_the_api_page_use_exported_names() -> None:
    root = Path(__file__).resolve().parents[1]
    exported = _exported_names()
    dashboard = json.loads((root / "docs" / "grafana-dashboard.json").read_text())
    used = {name for panel in dashboard["panels"] for target in panel["targets"]
            for name in re.findall(r"ovrouter_\w+", target["expr"])}
    assert used and used <= exported, sorted(used - exported)
    page = (root / "docs" / "api.md").read_text()
    start = page.index("## Metrics")
    end = page.find("\n## ", start + 1)
    section = page[start:end if end >= 0 else None]
    listed = set(re.findall(r"`(ovrouter_\w+)`", section))
    families = {f.name: f.type for f in Metrics().registry.collect()}
    documented = {name.removesuffix("_total") for name in listed}
    missing = sorted(set(families) - documented)
    assert not missing, f"exported but not in docs/api.md's Metrics section: {missing}"
    assert documented <= set(families), sorted(documented - set(families))


async def test_ovrouter_status_prints_the_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from router import cli

    config = write_config(tmp_path, {"m": fake_model(), "idle": fake_model()})
    async with running_router(config) as router:
        for _ in range(2):
            assert (await router.client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert (await router.client.post("/api/models/m/restart")).status_code == 200
        samples = _samples((await router.client.get("/metrics")).text)
        assert _value(samples, "ovrouter_model_memory_rss_bytes", model="m") > 1 << 20  # the real process's RSS
        code = await asyncio.to_thread(cli.main, ["status", "--url", router.url, "--key", ""])
    assert code == 0
    head, *lines = capsys.readouterr().out.strip().splitlines()
    assert head.split()[:6] == ["MODEL", "STATE", "PID", "UP", "RSS", "IN"] and "TTFT50" in head
    rows = {line.split()[0]: line for line in lines}
    m = rows["m"].split()
    assert m[1] == "ready" and m[2].isdigit() and m[4].endswith("M")  # state, pid, RSS in MiB
    assert "1 manual:1" in rows["m"] and rows["m"].endswith("start:manual")  # restarts by reason, last reason
    assert rows["idle"].split()[1:3] == ["stopped", "-"]


@pytest.mark.real_model
@pytest.mark.timeout(600)
async def test_the_real_pipeline_reports_kv_cache_figures(tmp_path: Path, demo_gguf: Path) -> None:
    models = {"smollm2": {"task": "llm", "engine": "openvino", "path": str(demo_gguf), "device": "CPU",
                          "save_ov_model": True, "startup_timeout_s": 300}}
    config = write_config(tmp_path, models, router={"cache_dir": str(tmp_path / "ov-cache"),
                                                     "metrics_names": ["ovrouter", "vllm"]})
    async with running_router(config) as router:
        body = {"model": "smollm2", "messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 8,
                "stream": True, "stream_options": {"include_usage": True}}
        lines = await _sse_lines(router.client, body)
        usage = [json.loads(line[6:])["usage"] for line in lines if line.startswith("data: {") and '"usage":{' in line]
        samples = _samples((await router.client.get("/metrics")).text)
        for _ in range(300):  # the figures of procman's last health probe (every health_interval_s): the next one
            if _value(samples, "ovrouter_backend_kv_cache_bytes", model="smollm2") > 0:
                break
            await asyncio.sleep(0.1)
            samples = _samples((await router.client.get("/metrics")).text)
        assert _value(samples, "ovrouter_backend_kv_cache_bytes", model="smollm2") > 0
        assert 0 <= _value(samples, "ovrouter_backend_kv_cache_usage_ratio", model="smollm2") <= 1
        assert ("ovrouter_backend_scheduled_requests", (("model", "smollm2"),)) in samples
        assert _value(samples, "ovrouter_time_to_first_token_seconds_count", model="smollm2") == 1
        assert _value(samples, "ovrouter_completion_tokens_total", model="smollm2") == usage[-1]["completion_tokens"]
        assert _value(samples, "ovrouter_prompt_tokens_total", model="smollm2") == usage[-1]["prompt_tokens"]
        vllm = {name for name, labels in samples if name.startswith("vllm:") and labels == (("model_name", "smollm2"),)}
        assert {_vllm_sample(name) for name in VLLM_NAMES} <= vllm, "every vLLM name has a sample for the model"
        assert _value(samples, "vllm:kv_cache_usage_perc", model_name="smollm2") == _value(
            samples, "ovrouter_backend_kv_cache_usage_ratio", model="smollm2")


def _vllm_sample(family: str) -> str:
    """The sample name a family is read by: counters end ``_total``, histograms are read by their ``_count``."""
    if family in ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success"):
        return family + "_total"
    return family + "_count" if family.endswith("_seconds") else family
