"""Every pipeline that can import its compiled blob from ``cache_dir`` does: a second start rewrites none of them.

A blob the CPU plugin cannot import is recompiled and written again on every start (no speed-up,
only the cost of writing it), so its file's mtime changes; an imported one is only read. Two
fresh processes load the same kinds in turn with one ``cache_dir`` each (the real small models of
``models/``); the second must leave the blobs the first wrote untouched, except the one speech
decoder blob openvino 2026.4 cannot import (``modelserver/engines/ov_options.py``). Transcription on
CPU gets no ``cache_dir`` at all, for the same reason (its decoder's blob is 113 MiB).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
KINDS = {"embeddings": "minilm-ov", "rerank": "rerank-tiny-ov", "vlm": "llava-tiny-ov", "speech": "speecht5-tiny-ov",
         "transcription": "whisper-tiny-en-ov"}
LOAD = """
import os, sys
from pathlib import Path
from modelserver.engines import make_engine
from modelserver.spec import build_model_spec
root = Path(sys.argv[1])
for pair in sys.argv[2:]:
    kind, folder = pair.split("=")
    make_engine(build_model_spec(kind, {"task": kind, "path": folder, "cache_dir": str(root / kind)}))
sys.stdout.flush()
os._exit(0)  # the pipelines' teardown is not what this test is about
"""


def _load_all(cache: Path) -> None:
    pairs = []
    for kind, folder in KINDS.items():
        if not (MODELS / folder / ".built").exists():
            pytest.fail(f"models/{folder} is missing: run `make test-models` (make test does it)")
        pairs.append(f"{kind}={MODELS / folder}")
    subprocess.run([sys.executable, "-c", LOAD, str(cache), *pairs], cwd=ROOT, check=True, timeout=600)


def _blobs(folder: Path) -> dict[str, int]:
    return {blob.name: blob.stat().st_mtime_ns for blob in folder.glob("*.blob")} if folder.is_dir() else {}


def test_a_second_start_imports_every_blob_it_can_and_rewrites_none(tmp_path: Path) -> None:
    _load_all(tmp_path)
    first = {kind: _blobs(tmp_path / kind) for kind in KINDS}
    assert not first["transcription"]  # no cache_dir on CPU: its decoder's blob never imports
    assert all(first[kind] for kind in ("embeddings", "rerank", "vlm", "speech"))
    assert len(first["vlm"]) == 3  # vision embeddings, text embeddings, and the stateful language model
    _load_all(tmp_path)
    for kind in ("embeddings", "rerank", "vlm"):
        assert _blobs(tmp_path / kind) == first[kind], f"{kind}: a blob was compiled and written again"
    again = _blobs(tmp_path / "speech")
    kept = [name for name, mtime in first["speech"].items() if again.get(name) == mtime]
    assert again.keys() == first["speech"].keys() and len(kept) >= len(first["speech"]) - 1  # all but the decoder
