"""The context size on every text model's entry (``/v1/models``, ``/v1/models/{id}``, ``/models``), known
before the model loads: :func:`modelserver.modelfiles.served_context` read from the model's files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from modelserver.modelfiles import GGUF_TOKENIZER_CAP, gguf_metadata, served_context
from modelserver.spec import build_model_spec
from tests.router_helpers import fake_model, running_router, write_config

MODELS = Path(__file__).resolve().parent.parent / "models"


def test_a_gguf_serves_its_declared_context_cut_at_the_tokenizers_8192(demo_gguf: Path) -> None:
    assert gguf_metadata(demo_gguf)["general.architecture"] == "llama"
    assert served_context(build_model_spec("m", {"path": str(demo_gguf)})) == 8192 == GGUF_TOKENIZER_CAP


def test_options_context_length_lowers_it_and_a_larger_option_changes_nothing(demo_gguf: Path) -> None:
    lowered = build_model_spec("m", {"path": str(demo_gguf), "options": {"context_length": 2048}})
    assert served_context(lowered) == 2048
    raised = build_model_spec("m", {"path": str(demo_gguf), "options": {"context_length": 100_000}})
    assert served_context(raised) == 8192  # the load refuses this option; the model's own number stands


def test_ir_folders_serve_config_json_and_a_vlm_its_language_models() -> None:
    assert served_context(build_model_spec("m", {"path": str(MODELS / "qwen2-tools-tiny-ov")})) == 4096
    assert served_context(build_model_spec("m", {"task": "vlm", "path": str(MODELS / "llava-tiny-ov")})) == 2048


def test_models_without_a_known_context_have_none() -> None:
    assert served_context(build_model_spec("m", {"task": "embeddings", "path": str(MODELS / "minilm-ov")})) is None
    assert served_context(build_model_spec("m", {"command": ["x"], "options": {"context_length": 4}})) is None
    assert served_context(build_model_spec("m", {"engine": "fake"})) is None
    assert served_context(build_model_spec("m", {"engine": "fake", "options": {"context_length": 64}})) == 64


def test_the_file_is_read_again_once_it_changes(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"max_position_embeddings": 1024}))
    model = build_model_spec("m", {"path": str(tmp_path)})
    assert served_context(model) == 1024
    config.write_text(json.dumps({"max_position_embeddings": 32768}))
    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 1_000_000_000))
    assert served_context(model) == 32768


@pytest.mark.timeout(120)
async def test_v1_models_and_models_carry_the_context_of_every_text_model(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"short": fake_model(options={"context_length": 512}, aliases=["s"]),
                                   "plain": fake_model(), "emb": fake_model(task="embeddings")})
    async with running_router(path) as router:
        for listing in ("/v1/models", "/models"):
            entries = {m["id"]: m for m in (await router.client.get(listing)).json()["data"]}
            assert {k: entries["short"][k] for k in ("max_model_len", "context_length", "meta")} == {
                "max_model_len": 512, "context_length": 512, "meta": {"n_ctx_train": 512}}
            assert "max_model_len" not in entries["plain"] and "max_model_len" not in entries["emb"]
        one = (await router.client.get("/v1/models/s")).json()
        assert (one["id"], one["root"], one["max_model_len"]) == ("s", "short", 512)
        await router.client.post("/v1/chat/completions", json={"model": "short", "messages": [
            {"role": "user", "content": "hi"}]})
        upstream = (await router.client.get("/upstream/short/v1/models")).json()["data"][0]
        assert upstream["max_model_len"] == 512  # what the loaded process itself enforces
