"""Loading real OpenVINO models: failures exit non-zero with one clear line; save_ov_model converts once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from modelserver_helpers import modelserver, spawn_modelserver

from modelserver.spec import build_model_spec

pytestmark = pytest.mark.real_model


def assert_fails_to_load(raw: dict[str, Any], *needles: str) -> None:
    server = spawn_modelserver(spec=build_model_spec("broken", raw))
    try:
        assert server.wait_exit(timeout_s=120) == 1
        lines = [line for line in server.log_text().splitlines() if "failed to load broken: " in line]
        assert len(lines) == 1, server.log_text()
        for needle in needles:
            assert needle in lines[0]
    finally:
        server.stop()


def test_missing_model_file(tmp_path: Path) -> None:
    assert_fails_to_load({"path": str(tmp_path / "nope.gguf")}, "model path does not exist", "nope.gguf")


def test_not_a_model_file(tmp_path: Path) -> None:
    fake = tmp_path / "fake.gguf"
    fake.write_text("not a gguf", encoding="utf-8")
    assert_fails_to_load({"path": str(fake)}, "fake.gguf")


def test_an_embeddings_folder_under_task_llm_names_the_task_to_set(demo_gguf: Path) -> None:
    folder = demo_gguf.parent / "minilm-ov"
    assert_fails_to_load({"path": str(folder), "task": "llm"},
                         f"{folder} looks like an embeddings model (config.json architectures: BertModel)",
                         "set task: embeddings")


def test_unknown_scheduler_field_is_named(demo_gguf: Path) -> None:
    assert_fails_to_load(
        {"path": str(demo_gguf), "scheduler": {"max_num_seqz": 4}}, "scheduler.max_num_seqz", "max_num_seqs"
    )


def test_wrong_scheduler_value_type_is_named(demo_gguf: Path) -> None:
    assert_fails_to_load(
        {"path": str(demo_gguf), "scheduler": {"max_num_seqs": "many"}}, "scheduler.max_num_seqs: expected int"
    )


def test_bad_ov_config_property_is_named(demo_gguf: Path) -> None:
    assert_fails_to_load({"path": str(demo_gguf), "ov_config": {"NOT_A_PROPERTY": 1}}, "NOT_A_PROPERTY")


def test_save_ov_model_converts_once_then_loads_the_ir(demo_gguf: Path, tmp_path: Path) -> None:
    raw = {"path": str(demo_gguf), "save_ov_model": True, "state_dir": str(tmp_path), "scheduler": {"max_num_seqs": 4}}
    spec = build_model_spec("smollm2", raw)
    converted = tmp_path / "converted" / "smollm2"
    with modelserver(spec=spec, ready_timeout_s=180) as first:
        assert "(gguf (converting to IR))" in first.log_text()
    assert (converted / "openvino_model.xml").is_file()
    assert (converted / "openvino_model.bin").is_file()
    assert (converted / "openvino_tokenizer.xml").is_file()  # later starts need no tokenizer rebuilt from the .gguf
    assert (converted / "openvino_detokenizer.xml").is_file()
    assert json.loads((converted / "source.json").read_text())["source"] == str(demo_gguf.resolve())
    assert not (converted / demo_gguf.name).exists()  # the link used for the conversion is gone
    with modelserver(spec=spec, ready_timeout_s=180) as second, second.client() as client:
        assert f"source={converted} (converted IR)" in second.log_text()
        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0}
        answer = client.post("/v1/chat/completions", json=body).json()
        assert "Paris" in answer["choices"][0]["message"]["content"]


def test_a_converted_folder_without_its_tokenizer_is_converted_again(demo_gguf: Path, tmp_path: Path) -> None:
    raw = {"path": str(demo_gguf), "save_ov_model": True, "state_dir": str(tmp_path), "scheduler": {"max_num_seqs": 4}}
    spec = build_model_spec("smollm2", raw)
    converted = tmp_path / "converted" / "smollm2"
    with modelserver(spec=spec, ready_timeout_s=180):
        pass
    (converted / "openvino_detokenizer.xml").unlink()  # as left by a version that saved no tokenizer
    with modelserver(spec=spec, ready_timeout_s=180) as again:
        assert "(gguf (converting to IR))" in again.log_text()
    assert (converted / "openvino_detokenizer.xml").is_file()


@pytest.mark.parametrize(("option", "asked", "loaded"), [
    (None, [True, False], False),  # unset: built with word timings, and without where they are refused
    (False, [False], False),  # never asked
])
def test_whisper_word_timestamps_fall_back_only_when_unset(monkeypatch: pytest.MonkeyPatch, option: bool | None,
                                                           asked: list[bool], loaded: bool) -> None:
    from modelserver.engines import transcription

    tried: list[bool] = []

    def refusing(path: str, device: str, **properties: Any) -> object:
        tried.append(bool(properties.get("word_timestamps")))
        if properties.get("word_timestamps"):
            raise RuntimeError("word timestamps need alignment heads")
        return object()

    monkeypatch.setattr(transcription.ov_genai, "WhisperPipeline", refusing)
    spec = build_model_spec("w", {"task": "transcription", "path": "/nowhere"})
    pipe, words = transcription._pipeline(Path("/nowhere"), spec, {}, option)
    assert tried == asked and words is loaded and pipe is not None
    tried.clear()
    with pytest.raises(transcription.LoadError, match="alignment heads"):  # asked for explicitly: the load fails
        transcription._pipeline(Path("/nowhere"), spec, {}, True)
