"""A spare interpreter warms what the config's model servers import: the engines of its (engine, task) pairs.

The router passes the pairs on the spare's command line (``--spare --warm openvino:llm,...``); the spare
imports each engine's module and what its load imports later; a config that adds a pair changes the
command, which retires the waiting spare and starts one that warms the new engine too.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from modelserver.engines import ENGINES
from modelserver.spare import DEFAULT_WARM, LOAD_IMPORTS, SPARE_READY, main, parse_warm, warm_modules
from router.config import load_config
from router.state.launch import spare_argv, spare_spec
from tests.modelserver_helpers import free_port
from tests.router_helpers import fake_model, write_config
from tests.test_procman_real import gone
from tests.test_procman_spares import router_spares
from tests.test_router_process import router_process

pytestmark = [pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parent.parent


def test_each_pair_warms_its_engine_module_and_what_its_load_imports_once() -> None:
    modules = warm_modules(["openvino:embeddings", "openvino:rerank", "fake:llm"])
    assert modules == ["modelserver.engines.embeddings", "openvino_tokenizers", "tokenizers",
                       "modelserver.engines.rerank", "modelserver.engines.fake"]
    assert warm_modules(["fake:llm", "fake:embeddings"]) == ["modelserver.engines.fake"]
    assert warm_modules(["nosuch:llm", "openvino"]) == []  # unknown pairs warm nothing (and do not fail)
    every = warm_modules(f"{engine}:{task}" for engine, task in ENGINES)
    assert set(LOAD_IMPORTS) <= set(ENGINES) and len(every) == len(set(every))


def test_the_command_line_names_the_pairs_and_nothing_means_the_llm_engine() -> None:
    assert parse_warm([]) == DEFAULT_WARM == ("openvino:llm",)
    assert parse_warm(["--warm", "openvino:vlm,fake:llm"]) == ("openvino:vlm", "fake:llm")
    with pytest.raises(ValueError, match="--warm"):
        parse_warm(["--cold"])
    assert main(["--warm"]) == 2  # a bad command line: status 2 before any import


def _loaded_libraries(pid: int) -> str:
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
        return maps.read()


def _spare(*argv: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "modelserver", "--spare", *argv], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == SPARE_READY
    return proc


def test_a_spare_imports_the_engines_it_is_told_and_no_openvino_for_fake_models() -> None:
    fake = _spare("--warm", "fake:llm,fake:embeddings")
    real = _spare("--warm", "openvino:embeddings")
    try:
        assert "libopenvino" not in _loaded_libraries(fake.pid)  # a fake-only config's spare stays light
        loaded = _loaded_libraries(real.pid)
        assert "libopenvino_genai" in loaded and "tokenizers.abi3" in loaded  # the engine, and the counting library
    finally:
        for proc in (fake, real):
            proc.communicate("", timeout=30)  # end of input: a spare exits 0
            assert proc.returncode == 0


def test_the_spare_command_names_the_config_s_engines_and_tasks(tmp_path: Path) -> None:
    models = {"a": fake_model(), "b": fake_model(), "e": fake_model(task="embeddings"),
              "ext": {"command": ["true", "${PORT}"]}}
    config = load_config(write_config(tmp_path, models, router={"spare_interpreters": 1}))
    assert spare_argv(config)[-2:] == ("--warm", "fake:embeddings,fake:llm")  # sorted, each pair once
    spec = spare_spec(config)
    assert spec is not None and spec.argv == spare_argv(config)
    assert any(path.endswith("openvino_tokenizers") for path in spec.watch)  # what it warms, changed, makes it stale
    only_external = load_config(write_config(tmp_path, {"ext": {"command": ["true", "${PORT}"]}}))
    assert spare_argv(only_external)[-1] == "--spare"  # nothing to warm: the spare's default


def _warm_arg(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", encoding="utf-8") as cmdline:
        argv = cmdline.read().split("\0")
    return argv[argv.index("--warm") + 1]


def test_a_config_that_adds_a_task_retires_the_spare_and_the_next_warms_it(tmp_path: Path) -> None:
    port = free_port()
    router = {"spare_interpreters": 1}
    config = write_config(tmp_path, {"a": fake_model()}, router=router)
    with router_process(config, port):
        [first] = router_spares(port, 1)
        assert _warm_arg(first) == "fake:llm"
        write_config(tmp_path, {"a": fake_model(), "b": fake_model()}, router=router)  # the same pairs
        assert httpx.post(f"http://127.0.0.1:{port}/api/reload", timeout=30).status_code == 200
        assert router_spares(port, 1) == [first]
        write_config(tmp_path, {"a": fake_model(), "b": fake_model(), "e": fake_model(task="embeddings")},
                     router=router)
        assert httpx.post(f"http://127.0.0.1:{port}/api/reload", timeout=30).status_code == 200
        deadline = time.monotonic() + 60
        while not gone(first) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(first), "the spare of the old settings is still running"
        [second] = router_spares(port, 1)
        assert second != first and _warm_arg(second) == "fake:embeddings,fake:llm"
