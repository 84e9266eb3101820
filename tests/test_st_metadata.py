"""Embeddings options declared by a model folder's sentence-transformers files (modelserver/engines/st_metadata.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from modelserver.engines.st_metadata import declared_options
from modelserver.errors import LoadError


def folder_with(tmp_path: Path, pooling: dict[str, Any], normalize: bool = True) -> Path:
    modules = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8, **pooling}))
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    return tmp_path


def test_mean_pooling_and_normalize_are_read(tmp_path: Path) -> None:
    folder = folder_with(tmp_path, {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False})
    assert declared_options(folder, {}) == {"pooling": "mean", "normalize": True, "max_length": 128}


def test_no_normalize_module_means_no_normalization(tmp_path: Path) -> None:
    folder = folder_with(tmp_path, {"pooling_mode_cls_token": True}, normalize=False)
    assert declared_options(folder, {})["normalize"] is False


def test_a_folder_without_modules_json_declares_nothing(tmp_path: Path) -> None:
    assert declared_options(tmp_path, {}) == {}


def test_a_pooling_the_pipeline_cannot_do_fails_the_load_unless_set(tmp_path: Path) -> None:
    folder = folder_with(tmp_path, {"pooling_mode_max_tokens": True})
    with pytest.raises(LoadError, match="pooling_mode_max_tokens.*set options.pooling"):
        declared_options(folder, {})
    assert "pooling" not in declared_options(folder, {"pooling": "mean"})  # the explicit option wins
