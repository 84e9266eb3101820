"""What a ModelSpec means to OpenVINO (pure decisions of ``modelserver/engines/ov_options.py``)."""

from __future__ import annotations

import json
from pathlib import Path

from modelserver.engines.ov_options import TOKENIZER_XMLS, ov_properties, prepare_source
from modelserver.spec import build_model_spec


def test_llm_and_transcription_on_cpu_get_no_cache_dir_they_could_never_import(tmp_path: Path) -> None:
    for task in ("llm", "transcription"):
        spec = build_model_spec("m", {"task": task, "path": "x.gguf", "cache_dir": str(tmp_path / "c")})
        assert "CACHE_DIR" not in ov_properties(spec)


def test_other_kinds_on_cpu_and_llm_on_gpu_get_the_cache_dir(tmp_path: Path) -> None:
    kinds = ({"task": "embeddings"}, {"task": "rerank"}, {"task": "speech"}, {"task": "vlm"},
             {"task": "llm", "device": "GPU.0"}, {"task": "transcription", "device": "GPU"})
    for raw in kinds:
        spec = build_model_spec("m", {**raw, "path": "x", "cache_dir": str(tmp_path / "c")})
        assert ov_properties(spec)["CACHE_DIR"] == str(tmp_path / "c")


def test_an_explicit_cache_dir_in_ov_config_wins(tmp_path: Path) -> None:
    spec = build_model_spec("m", {"task": "llm", "path": "x.gguf", "ov_config": {"CACHE_DIR": str(tmp_path)}})
    assert ov_properties(spec)["CACHE_DIR"] == str(tmp_path)


def _converted(tmp_path: Path, files: tuple[str, ...]) -> tuple[Path, Path]:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    folder = tmp_path / "state" / "converted" / "m"
    folder.mkdir(parents=True)
    for name in files:
        (folder / name).write_text("<xml/>")
    info = gguf.stat()
    stamp = {"source": str(gguf.resolve()), "size": info.st_size, "mtime_ns": info.st_mtime_ns}
    (folder / "source.json").write_text(json.dumps(stamp))
    return gguf, folder


def test_a_complete_converted_folder_loads_with_its_own_tokenizer(tmp_path: Path) -> None:
    gguf, folder = _converted(tmp_path, ("openvino_model.xml", *TOKENIZER_XMLS))
    spec = build_model_spec("m", {"path": str(gguf), "save_ov_model": True, "state_dir": str(tmp_path / "state")})
    source = prepare_source(spec)
    assert (source.path, source.tokenizer_path, source.kind) == (folder, None, "converted IR")


def test_a_converted_folder_without_a_tokenizer_is_converted_again(tmp_path: Path) -> None:
    gguf, folder = _converted(tmp_path, ("openvino_model.xml", "openvino_tokenizer.xml"))
    spec = build_model_spec("m", {"path": str(gguf), "save_ov_model": True, "state_dir": str(tmp_path / "state")})
    source = prepare_source(spec)
    assert source.kind == "gguf (converting to IR)"
    assert source.convert_into == folder and source.tokenizer_path == source.path == folder / gguf.name
    assert source.extra_properties() == {"enable_save_ov_model": True}
