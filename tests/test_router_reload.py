"""Hot reload over real processes: add, remove, change, router-only change, invalid file,
and each trigger (POST /api/reload, a rename-save picked up by watchfiles; SIGHUP in test_router_process.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from procman import State
from router.config import parse_config
from router.metrics import Metrics
from router.state.registry import Registry
from tests.procman_fakes import Harness
from tests.router_helpers import fake_model, running_router, write_config
from tests.test_router_proxy import alive, chat, wait_for

pytestmark = pytest.mark.timeout(120)


def rewrite(path: Path, edit: Any) -> None:
    """Edit the YAML the way editors save: write a new file, rename it over the old one."""
    data = yaml.safe_load(path.read_text())
    edit(data)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    os.replace(tmp, path)


async def save_until(path: Path, edit: Any, applied: Any, timeout_s: float = 60.0) -> None:
    """Save as editors do until the watcher applies it: watchfiles arms in a thread of its own and has no ready
    event, so a save before it armed is missed; a watch lost to an earlier rename misses every save."""
    deadline = time.monotonic() + timeout_s
    while True:
        rewrite(path, edit)
        with contextlib.suppress(AssertionError):
            return await wait_for(applied, 3, "the watcher to apply a save")
        assert time.monotonic() < deadline, f"no save was applied in {timeout_s}s"


async def test_reload_adds_removes_changes_and_leaves_the_rest_alone(tmp_path: Path) -> None:
    slow = {"load_s": 0, "token_delay_s": 0.1}
    path = write_config(tmp_path, {"keep": fake_model(), "edit": fake_model(fake=slow), "drop": fake_model(fake=slow)})
    async with running_router(path) as router:
        for name in ("keep", "edit", "drop"):
            assert (await router.client.post("/v1/chat/completions", json=chat(name, "x"))).status_code == 200
        pids = {name: router.backend(name).pid for name in ("keep", "edit", "drop")}
        words = "one two three four five six seven " * 4 + "eight"  # seconds of tokens: in flight at the reload
        streams = {
            name: asyncio.create_task(router.client.post("/v1/chat/completions", json=chat(name, words, stream=True)))
            for name in ("edit", "drop")
        }
        await wait_for(lambda: router.backend("edit").in_flight and router.backend("drop").in_flight, 60, "in flight")

        def edit(data: dict[str, Any]) -> None:
            data["models"]["edit"]["fake"]["token_delay_s"] = 0.01
            del data["models"]["drop"]
            data["models"]["new"] = fake_model(preload=True)

        rewrite(path, edit)
        result = (await router.client.post("/api/reload")).json()
        assert result["ok"] and result["diff"] == {"added": ["new"], "changed": ["edit"], "removed": ["drop"]}
        assert (await router.client.post("/v1/chat/completions", json=chat("drop"))).status_code == 404
        # requests in flight on the removed and the changed model finish on their old processes
        for name, task in streams.items():
            reply = await task
            assert reply.status_code == 200 and "eight" in reply.text, name
        assert (await router.client.post("/v1/chat/completions", json=chat("edit", "fresh"))).status_code == 200
        # a rolling change: the old process serves until the new one is ready, then drains and exits
        await wait_for(lambda: router.backend("edit").pid not in (None, pids["edit"]), 60, "edit's new process")
        await wait_for(lambda: not alive(pids["edit"]), 60, "edit's old process to exit")
        await wait_for(lambda: not alive(pids["drop"]), 60, "the removed model's process to exit")
        await wait_for(lambda: router.backend("new").state is State.READY, 60, "the added preload model")
        assert router.backend("keep").pid == pids["keep"], "an unchanged model is not touched"
        assert [m["id"] for m in (await router.client.get("/v1/models")).json()["data"]] == ["keep", "edit", "new"]


async def test_a_new_task_is_stop_first_so_its_requests_never_reach_the_old_process(tmp_path: Path) -> None:
    """Rolling, the old llm process served until the new one was ready, while the router already checked routes
    against the new task: an embeddings request reached the llm process (a 404 "this server serves ...", seen in
    bench/chaosmix.py). Stop-first, it waits for the embeddings process; the stream in flight finishes."""
    path = write_config(tmp_path, {"shifty": fake_model(fake={"load_s": 1.0, "token_delay_s": 0.05})})
    async with running_router(path) as router:
        assert (await router.client.post("/v1/chat/completions", json=chat("shifty"))).status_code == 200
        words = "one two three four five six seven " * 2 + "eight"
        stream = asyncio.create_task(router.client.post("/v1/chat/completions",
                                                        json=chat("shifty", words, stream=True)))
        await wait_for(lambda: router.backend("shifty").in_flight, 60, "the stream in flight")
        rewrite(path, lambda d: d["models"]["shifty"].update(task="embeddings", fake={"load_s": 1.0}))
        assert (await router.client.post("/api/reload")).json()["diff"]["changed"] == ["shifty"]
        embedded = await router.client.post("/v1/embeddings", json={"model": "shifty", "input": ["a b"]})
        assert embedded.status_code == 200 and len(embedded.json()["data"]) == 1, embedded.text
        refused = await router.client.post("/v1/chat/completions", json=chat("shifty"))
        assert refused.status_code == 400 and "embeddings" in refused.json()["error"]["message"]
        reply = await stream
        assert reply.status_code == 200 and "eight" in reply.text


async def test_a_restart_after_a_failed_rolling_change_runs_the_config_s_settings(tmp_path: Path) -> None:
    """A rolling change whose new process is killed leaves the old one serving with the old settings; a restart
    then ran the old settings again. It runs what config.yaml says (found by bench/chaosmix.py's kill-roll)."""
    path = write_config(tmp_path, {"roll": fake_model(fake={"load_s": 1.0, "token_delay_s": 0.005})})
    async with running_router(path) as router:
        assert (await router.client.post("/v1/chat/completions", json=chat("roll"))).status_code == 200
        old = router.backend("roll").pid
        rewrite(path, lambda d: d["models"]["roll"]["fake"].update(token_delay_s=0.001))
        assert (await router.client.post("/api/reload")).json()["diff"]["changed"] == ["roll"]

        def new_process() -> list[psutil.Process]:
            found = []
            for proc in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.Error):  # gone, or a zombie another test left to its reaper
                    if proc.pid != old and "roll" in proc.cmdline() and proc.status() != psutil.STATUS_ZOMBIE:
                        found.append(proc)
            return found

        await wait_for(new_process, 60, "the rolling change's new process")
        for proc in new_process():
            with contextlib.suppress(psutil.Error):
                proc.kill()
        residency = router.service.registry.residency
        await wait_for(lambda: residency.rolling_errors.get("roll"), 60, "the rolling change to fail")
        model = router.service.registry.models["roll"]
        assert router.backend("roll").pid == old and router.backend("roll").spec != router.service.registry.\
            process_spec(model)
        assert (await router.client.post("/api/models/roll/restart")).status_code == 200
        assert router.backend("roll").pid != old and router.backend("roll").spec == router.service.registry.\
            process_spec(model)
        assert residency.rolling_errors.get("roll") is None
        assert (await router.client.post("/v1/chat/completions", json=chat("roll"))).status_code == 200


async def test_router_and_supervisor_changes_apply_without_a_restart(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"echo": fake_model()})
    async with running_router(path) as router:
        await router.client.post("/v1/chat/completions", json=chat("echo"))
        pid = router.backend("echo").pid
        edits = {"aliases": ["gpt-4o"], "max_concurrency": 2, "idle_timeout_s": 120, "health_interval_s": 2,
                 "max_retries": 1}
        rewrite(path, lambda d: d["models"]["echo"].update(edits))
        assert (await router.client.post("/api/reload")).json()["diff"]["changed"] == ["echo"]
        reply = await router.client.post("/v1/chat/completions", json=chat("gpt-4o", "via alias"))
        assert reply.status_code == 200 and router.backend("echo").pid == pid
        assert router.service.registry.models["echo"].limiter.max_concurrency == 2
        spec = router.backend("echo").spec
        assert (spec.idle_timeout_s, spec.health_interval_s, spec.policy.max_retries) == (120, 2, 1)


async def test_a_reload_that_adds_a_model_whose_path_is_missing_warns(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    path = write_config(tmp_path, {"echo": fake_model()})
    async with running_router(path) as router:
        rewrite(path, lambda d: d["models"].update({"ghost": {"path": "nowhere.gguf"}}))
        with caplog.at_level("WARNING", logger="router.state.registry"):
            assert (await router.client.post("/api/reload")).json()["diff"]["added"] == ["ghost"]
        assert f"models.ghost.path: {tmp_path / 'nowhere.gguf'} does not exist" in caplog.text
        assert "models.echo" not in caplog.text


RETUNES = {
    "idle_timeout_s": (60, lambda m: m.backend.spec.idle_timeout_s == 60),
    "health_interval_s": (7, lambda m: m.backend.spec.health_interval_s == 7),
    "max_retries": (1, lambda m: m.backend.spec.policy.max_retries == 1),
    "max_concurrency": (2, lambda m: m.limiter.max_concurrency == 2),
    "aliases": (["gpt-4o"], lambda m: m.spec.aliases == ("gpt-4o",)),
}


@pytest.mark.parametrize("setting", list(RETUNES))
async def test_supervisor_or_router_setting_of_a_loaded_model_keeps_its_process(tmp_path: Path, setting: str) -> None:
    """In process, procman under fakes: the edit is applied and the very same process keeps serving."""
    harness = Harness(tmp_path / "rt")
    old = parse_config({"models": {"echo": fake_model()}}, tmp_path)
    registry = Registry(old, Metrics(), manager=harness.manager)
    try:
        model = registry.models["echo"]
        await model.backend.ensure_ready()
        pid, spawned = model.backend.pid, len(harness.spawner.procs)
        value, applied = RETUNES[setting]
        new = parse_config({"models": {"echo": fake_model(**{setting: value})}}, tmp_path)
        assert (await registry.apply(new)).changed == ("echo",)
        await asyncio.gather(*registry._tasks)
        model = registry.models["echo"]
        assert applied(model), f"{setting} was not applied"
        assert model.backend.pid == pid and len(harness.spawner.procs) == spawned and model.backend.state is State.READY
        if setting == "aliases":
            assert registry.resolve("gpt-4o") is model
    finally:
        await harness.clock.run(registry.shutdown())


async def test_invalid_file_keeps_the_old_config_serving(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"echo": fake_model()})
    async with running_router(path) as router:
        await router.client.post("/v1/chat/completions", json=chat("echo"))
        pid = router.backend("echo").pid
        rewrite(path, lambda d: d["models"]["echo"].update(idle_timeout_s="soon"))
        rejected = await router.client.post("/api/reload")
        assert rejected.status_code == 400
        assert rejected.json()["errors"] == ['models.echo.idle_timeout_s: expected a number >= 0, got "soon"']
        assert (await router.client.post("/v1/chat/completions", json=chat("echo"))).status_code == 200
        assert router.backend("echo").pid == pid
        status = (await router.client.get("/api/status")).json()
        assert status["last_reload"]["ok"] is False and "idle_timeout_s" in status["last_reload"]["errors"][0]
        assert "ovrouter_config_valid 0.0" in (await router.client.get("/metrics")).text
        path.write_text("not: [valid")
        assert "not valid YAML" in (await router.client.post("/api/reload")).json()["errors"][0]


async def test_a_saved_edit_is_picked_up_by_the_watcher(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"echo": fake_model()}, router={"watch": True})
    async with running_router(path) as router:
        models = router.service.registry.models
        await save_until(path, lambda d: d["models"].update(second=fake_model()), lambda: "second" in models)
        # a second save: the watch survived a rename
        await save_until(path, lambda d: d["models"].update(third=fake_model()), lambda: "third" in models)
        assert router.service.last_reload["source"] == "watch"
