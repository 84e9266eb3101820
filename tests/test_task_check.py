"""A model folder under a text-generation task that its config.json says is no such model fails its load by name."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import ROOT

from modelserver.engines.task_check import check_generative, likely_task
from modelserver.errors import LoadError
from modelserver.spec import build_model_spec

MODELS = ROOT / "models"


def check(name: str, path: Path, task: str = "llm") -> None:
    check_generative(build_model_spec(name, {"path": str(path), "task": task}), path)


@pytest.mark.parametrize(("folder", "task"), [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "llm"),
    ("qwen2-tools-tiny-ov", "llm"),
    ("llava-tiny-ov", "vlm"),
])
def test_real_generation_models_pass(folder: str, task: str) -> None:
    path = MODELS / folder
    assert path.exists(), f"{path} is missing: run `make models`"
    check(folder, path, task)


def test_an_ir_converted_from_gguf_passes(tmp_path: Path) -> None:
    """What save_ov_model writes under the state dir: IR and tokenizers, no config.json."""
    for name in ("openvino_model.xml", "openvino_tokenizer.xml", "openvino_detokenizer.xml", "source.json"):
        (tmp_path / name).write_text("", encoding="utf-8")
    check("smollm2", tmp_path)


@pytest.mark.parametrize(("folder", "task", "evidence"), [
    ("minilm-ov", "embeddings", "config.json architectures: BertModel"),
    ("rerank-tiny-ov", "rerank", "config.json architectures: BertForSequenceClassification"),
    ("whisper-tiny-en-ov", "transcription", "WhisperForConditionalGeneration"),
    ("speecht5-tiny-ov", "speech", "SpeechT5ForTextToSpeech"),
])
@pytest.mark.parametrize("configured", ["llm", "vlm"])
def test_other_models_fail_naming_the_task_to_set(folder: str, task: str, evidence: str, configured: str) -> None:
    path = MODELS / folder
    with pytest.raises(LoadError) as caught:
        check("x", path, configured)
    message = str(caught.value)
    assert message.startswith(f"models.x: {path} looks like a")
    assert evidence in message
    assert f"not one for task: {configured}" in message
    assert message.endswith(f"set task: {task}")


@pytest.mark.parametrize("config", [
    {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    {"architectures": ["ChatGLMModel"], "model_type": "chatglm"},  # a generator despite its bare *Model name
    {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
    {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl"},
    {},
    {"architectures": "not a list"},
])
def test_generation_or_unknown_configs_pass(config: dict[str, object]) -> None:
    assert likely_task(config) is None


def test_model_type_alone_is_evidence() -> None:
    assert likely_task({"model_type": "xlm-roberta"}) == ("embeddings", "config.json model_type: xlm-roberta")
