"""Config validation, reload diff, admission limits and body routing: pure, no processes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from modelserver.spec import ModelSpec, build_model_spec
from router.config import ConfigError, load_config, missing_paths, parse_config
from router.edge.body import model_of, read_body
from router.edge.errors import BadRequest, PayloadTooLarge, TooManyRequests
from router.reload import diff
from router.state.launch import backend_spec
from router.state.limits import Limiter

ROOT = Path(__file__).resolve().parent.parent


def errors_of(data: dict, base: Path = Path("/tmp")) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data, base)
    return info.value.errors


def test_default_config_file_is_valid() -> None:
    config = load_config(ROOT / "config.yaml")
    assert {"smollm2", "tiny-fake"} <= set(config.models)
    assert "gpt-4o-mini" in config.models["smollm2"].aliases
    assert Path(config.models["smollm2"].path or "").is_absolute()


def test_error_names_key_path_and_bad_value() -> None:
    errors = errors_of({"models": {"smollm2": {"engine": "fake", "idle_timeout_s": "soon"}}})
    assert errors == ['models.smollm2.idle_timeout_s: expected a number >= 0, got "soon"']


def test_every_problem_is_reported_at_once() -> None:
    errors = errors_of({
        "routr": {},
        "router": {"transport": "pigeon"},
        "defaults": {"max_queue": -1},
        "models": {"a": {"engine": "fake", "tsk": "llm"}, "b": {"engine": "fake"}},
    })
    text = "\n".join(errors)
    assert "routr: unknown top-level key" in text
    assert "router.transport: expected one of 'uds' or 'tcp', got \"pigeon\"" in text
    assert "defaults.max_queue: expected a number >= 0, got -1" in text
    assert "models.a.tsk: unknown key (did you mean 'task'?)" in text
    assert len(errors) == len(set(errors)), "a bad default is reported once, not once per model"


def test_unknown_group_is_an_error() -> None:
    errors = errors_of({"models": {"b": {"engine": "fake", "group": "nope"}}, "groups": {"gpu0": {"max_loaded": 1}}})
    assert errors == ["models.b.group: no group 'nope' under `groups` (known: gpu0)"]


def test_alias_clash_is_an_error() -> None:
    errors = errors_of({"models": {"a": {"engine": "fake"}, "b": {"engine": "fake", "aliases": ["a"]}}})
    assert errors == ["models.b.aliases: 'a' already names model 'a'"]


def test_openvino_model_needs_a_path() -> None:
    errors = errors_of({"models": {"m": {"engine": "openvino"}}})
    assert errors and "path" in errors[0] and errors[0].startswith("models.m")


def test_per_model_key_in_defaults_is_refused() -> None:
    errors = errors_of({"defaults": {"path": "x.gguf"}, "models": {"m": {"engine": "fake"}}})
    assert errors == ["defaults.path: this key is per model; set it under models.<name>"]


def test_defaults_merge_under_models_and_paths_are_relative_to_the_file(tmp_path: Path) -> None:
    path = tmp_path / "conf" / "c.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump({
        "router": {"state_dir": "st"},
        "defaults": {"idle_timeout_s": 5, "ov_config": {"A": 1, "B": 2}},
        "models": {"m": {"path": "m.gguf", "idle_timeout_s": 7, "ov_config": {"B": 3}}, "n": {"engine": "fake"}},
    }))
    config = load_config(path)
    m, n = config.models["m"], config.models["n"]
    assert (m.idle_timeout_s, n.idle_timeout_s) == (7, 5)
    assert m.ov_config == {"A": 1, "B": 3}
    assert m.path == str(path.parent / "m.gguf")
    assert m.state_dir == str(path.parent / "st") and config.router.state_dir == str(path.parent / "st")


def test_check_command_prints_all_errors_and_exits_non_zero(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("models:\n  a: {engine: fake, max_queue: lots}\n  b: {engine: warp}\n")
    result = subprocess.run([sys.executable, "-m", "router.cli", "check", str(path)], capture_output=True, text=True)
    assert result.returncode == 2
    assert 'models.a.max_queue: expected an integer >= 0, got "lots"' in result.stderr
    assert "models.b.engine: expected one of 'openvino' or 'fake', got \"warp\"" in result.stderr
    good = subprocess.run([sys.executable, "-m", "router.cli", "check", str(ROOT / "config.yaml")],
                          capture_output=True, text=True)
    assert good.returncode == 0 and "OK, 2 model(s)" in good.stdout
    path.write_text("models:\n  gone: {path: nowhere.gguf}\n  fake: {engine: fake}\n")
    missing = subprocess.run([sys.executable, "-m", "router.cli", "check", str(path)], capture_output=True, text=True)
    assert missing.returncode == 0 and "OK, 2 model(s)" in missing.stdout
    assert f"warning: models.gone.path: {tmp_path / 'nowhere.gguf'} does not exist" in missing.stdout
    assert "models.fake" not in missing.stdout


def test_check_takes_config_as_an_option_as_serve_and_status_do(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("models:\n  gone: {path: nowhere.gguf}\n")
    run = [sys.executable, "-m", "router.cli", "check"]
    opt = subprocess.run([*run, "--config", str(path)], capture_output=True, text=True)
    assert opt.returncode == 0 and f"{path}: OK, 1 model(s)" in opt.stdout
    assert "warning: models.gone.path:" in opt.stdout
    both = subprocess.run([*run, str(path), "--config", str(ROOT / "config.yaml")], capture_output=True, text=True)
    assert both.returncode == 2 and "two config files" in both.stderr


def test_serve_takes_the_config_as_check_does(tmp_path: Path) -> None:
    # `ovrouter serve config.yaml` as `ovrouter check config.yaml`: an invalid file stops it before it listens
    path = tmp_path / "c.yaml"
    path.write_text("models:\n  m: {engine: fake, idle_timeout_s: soon}\n")
    serve = [sys.executable, "-m", "router.cli", "serve"]
    positional = subprocess.run([*serve, str(path)], capture_output=True, text=True, timeout=60)
    assert positional.returncode == 2 and f"{path}: 1 problem(s)" in positional.stderr
    assert "models.m.idle_timeout_s" in positional.stderr
    both = subprocess.run([*serve, str(path), "--config", str(ROOT / "config.yaml")], capture_output=True,
                          text=True, timeout=60)
    assert both.returncode == 2 and "ovrouter serve: two config files" in both.stderr


def test_serve_warns_of_a_model_path_that_does_not_exist(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A new user's config with a wrong path: serve says so at start, not only at the first request's 503."""
    from router import cli

    path = tmp_path / "c.yaml"
    path.write_text("models:\n  gone: {path: nowhere.gguf}\n  fake: {engine: fake}\n")
    config = load_config(path)
    assert missing_paths(config) == [
        f"models.gone.path: {tmp_path / 'nowhere.gguf'} does not exist (the model cannot start)"]
    ran: list[object] = []

    class Server:
        def __init__(self, config: object) -> None:
            ran.append(config)

        def run(self, sockets: object = None) -> None:
            ran.append("run")

    import uvicorn
    monkeypatch.setattr(uvicorn, "Server", Server)  # builds the app, starts nothing
    with caplog.at_level("WARNING", logger="ovrouter"):
        assert cli.main(["serve", "--config", str(path)]) == 0
    assert ran[-1] == "run"
    assert "models.gone.path:" in caplog.text and "does not exist" in caplog.text


def test_invalid_yaml_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("models: [unclosed\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "not valid YAML" in info.value.errors[0]


def spec(name: str, **kw: object) -> ModelSpec:
    return build_model_spec(name, {"engine": "fake", **kw})


def test_diff_is_by_name_and_equality() -> None:
    old = {"same": spec("same"), "edit": spec("edit"), "gone": spec("gone")}
    new = {"same": spec("same"), "edit": spec("edit", idle_timeout_s=1), "new": spec("new")}
    result = diff(old, new)
    assert (result.added, result.changed, result.removed) == (("new",), ("edit",), ("gone",))
    assert not diff(old, dict(old))


def test_router_only_changes_keep_the_process_spec() -> None:
    router = parse_config({}, Path("/tmp")).router
    base = backend_spec(spec("m"), router)
    assert backend_spec(spec("m", aliases=["x"], max_concurrency=2, max_queue=1), router) == base
    retuned = backend_spec(spec("m", idle_timeout_s=3, health_interval_s=2, max_retries=1), router)
    assert retuned != base and retuned.process_view == base.process_view  # the same process, retuned
    assert retuned.idle_timeout_s == 3 and retuned.health_interval_s == 2 and retuned.policy.max_retries == 1
    engine = backend_spec(spec("m", fake={"token_delay_s": 0.5}), router)
    assert engine.process_view != base.process_view  # what the engine reads restarts the process


def test_every_model_setting_has_one_audience_and_the_child_gets_only_its_own() -> None:
    from modelserver.spec import AUDIENCES, fields_for

    groups = [fields_for(audience) for audience in AUDIENCES]
    assert set().union(*groups) == set(ModelSpec.model_fields) and sum(map(len, groups)) == len(ModelSpec.model_fields)
    assert {"idle_timeout_s", "health_interval_s", "max_retries"} <= fields_for("supervisor")
    assert {"aliases", "max_concurrency", "max_queue", "request_timeout_s"} <= fields_for("router")
    custom = spec("m", idle_timeout_s=3, aliases=["x"], max_concurrency=2, device="GPU.1", fake={"dims": 8})
    child = custom.child_view()
    assert (child.device, child.fake.dims) == ("GPU.1", 8)  # engine settings by inclusion
    assert (child.idle_timeout_s, child.aliases, child.max_concurrency) == (900, (), 16)  # the rest never reaches it


def test_command_backend_transport_follows_its_placeholder() -> None:
    router = parse_config({}, Path("/tmp")).router
    assert backend_spec(spec("t", command=["srv", "--port", "${PORT}"]), router).transport == "tcp"
    assert backend_spec(spec("u", command=["srv", "--sock", "${SOCKET}"]), router).transport == "uds"
    remote = backend_spec(spec("r", url="http://127.0.0.1:9"), router)
    assert remote.argv is None and remote.url == "http://127.0.0.1:9"


async def test_limiter_queues_then_refuses_with_retry_after() -> None:
    limiter = Limiter("m", max_concurrency=1, max_queue=1)
    release = asyncio.Event()

    async def hold() -> None:
        async with limiter:
            await release.wait()

    first = asyncio.create_task(hold())
    await asyncio.sleep(0)
    second = asyncio.create_task(hold())
    await asyncio.sleep(0)
    assert (limiter.in_flight, limiter.queued) == (1, 1)
    with pytest.raises(TooManyRequests) as info:
        async with limiter:
            pass
    assert info.value.retry_after_s and "max_queue=1" in info.value.message
    release.set()
    await asyncio.gather(first, second)
    assert (limiter.in_flight, limiter.queued) == (0, 0)


def test_model_of_json_and_multipart() -> None:
    assert model_of(b'{"model": "m", "stream": true}', "application/json", []).stream is True
    form = (b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nRIFF\r\n'
            b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper\r\n--b--\r\n')
    assert model_of(form, "multipart/form-data; boundary=b", []).model == "whisper"
    with pytest.raises(BadRequest, match="not valid JSON"):
        model_of(b"{nope", "application/json", [])
    urlencoded = "application/x-www-form-urlencoded"
    assert model_of(b'{"model": "m"}', urlencoded, []).model == "m"  # curl -d without a Content-Type
    with pytest.raises(BadRequest, match="not valid JSON .*a form is read only as multipart/form-data"):
        model_of(b"model=whisper", urlencoded, [])
    with pytest.raises(BadRequest, match="nested too deeply"):  # a RecursionError, not a 500
        model_of(b"[" * 100_000 + b"]" * 100_000, "application/json", [])
    with pytest.raises(BadRequest, match="`model` is required: name one of a, b"):
        model_of(b'{"messages": []}', "application/json", ["b", "a"])
    with pytest.raises(BadRequest, match="`model` must be a string, got 5: name one of a, b"):
        model_of(b'{"model": 5}', "application/json", ["b", "a"])


async def test_read_body_refuses_past_the_limit_without_content_length() -> None:
    chunks = [{"type": "http.request", "body": b"x" * 600, "more_body": True}] * 3

    async def receive() -> dict:
        return chunks.pop()

    with pytest.raises(PayloadTooLarge, match="limit of"):
        await read_body(receive, None, 1000)
    with pytest.raises(PayloadTooLarge):
        await read_body(receive, 5000, 1000)


def test_docs_config_reference_matches_the_config_models() -> None:
    from router.docs import BEGIN, END, reference

    page = (ROOT / "docs" / "configuration.md").read_text()
    start, end = page.index(BEGIN), page.index(END) + len(END)
    assert page[start:end] == reference(), "docs/configuration.md's reference is stale: paste `python -m router.docs`"


def test_forget_drops_every_series_of_a_removed_model() -> None:
    from router.metrics import Metrics

    metrics = Metrics()
    for model in ("gone", "kept"):
        metrics.state.labels(model, "ready").set(1)
        metrics.starts.labels(model, "cold", "ok").inc()
        metrics.restarts.labels(model, "crash").inc()
        metrics.stops.labels(model, "idle").inc()
        metrics.cold_start.labels(model).observe(1.0)
        metrics.loaded.labels(model).set(1)
        metrics.observe_request(model, 200, 0.1)
    metrics.forget("gone")
    text = metrics.render().decode()
    assert 'model="gone"' not in text and text.count('model="kept"') > 10


def test_check_warns_of_a_model_folder_configured_under_the_wrong_task(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A copied config puts an embeddings folder under task: llm: `ovrouter check` says which task to set."""
    from router import cli
    from router.config import start_warnings, wrong_tasks

    minilm, gguf = ROOT / "models" / "minilm-ov", ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not (minilm / "config.json").exists():
        pytest.skip("models/minilm-ov is missing: run `make test-models`")
    path = tmp_path / "c.yaml"
    path.write_text(f"models:\n  wrong: {{path: {minilm}}}\n  right: {{path: {minilm}, task: embeddings}}\n"
                    f"  chat: {{path: {gguf}}}\n  fake: {{engine: fake}}\n")
    config = load_config(path)
    [warning] = wrong_tasks(config)
    assert warning.startswith(f"models.wrong.task: llm, but {minilm} looks like an embeddings model (config.json ")
    assert warning.endswith("set task: embeddings (the model cannot start)")
    assert wrong_tasks(config, ["right", "chat", "fake"]) == [] and start_warnings(config, ["wrong"]) == [warning]
    assert cli.main(["check", str(path)]) == 0
    assert f"  warning: {warning}" in capsys.readouterr().out
