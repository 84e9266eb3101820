"""Cold start of the other model kinds: stopped -> whole first answer through the router, against the bare pipeline.

For each kind whose small model ``models/`` holds (``tools/build_test_models.py``), the
cold-start section (``bench/coldstart.py``) configures one model and, round by round, sends it
one request while it is stopped (a spare interpreter waiting, ``cache_dir`` warm from an
earlier load), timing the request's send to its whole answer; then it runs this module in a
fresh process (``python -m bench.coldkinds --task T --path P --cache-dir D``), which imports
openvino_genai, builds the kind's pipeline with the properties the model server would give it
(``CACHE_DIR`` where the kind imports its blob on CPU, the vlm's stateful language model) and
answers the same request in-process, printing ``import_s``, ``load_s`` and ``first_s`` as one
JSON line. The figures are reported without a target (issue 24's target is the LLM's).
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.common import median, ratio
from bench.procs import ROOT, die_with_parent

__all__ = ["KINDS", "Kind", "bare", "first_answer", "model_entries", "present", "rows", "send"]

MODELS = ROOT / "models"
TEXT = "A cat sits on the mat."


@dataclass(frozen=True, slots=True)
class Kind:
    task: str
    folder: str  # under models/

    @property
    def name(self) -> str:
        return f"cold-{self.task}"


KINDS = (Kind("embeddings", "minilm-ov"), Kind("rerank", "rerank-tiny-ov"),
         Kind("transcription", "whisper-tiny-en-ov"), Kind("speech", "speecht5-tiny-ov"), Kind("vlm", "llava-tiny-ov"))


def present(models: Path = MODELS) -> list[Kind]:
    """The kinds whose model is built (``.built`` is written last, so a half model never counts)."""
    return [kind for kind in KINDS if (models / kind.folder / ".built").is_file()]


def model_entries(kinds: list[Kind], models: Path = MODELS) -> dict[str, dict[str, Any]]:
    """One config entry per kind; ``cache_dir`` comes from the router."""
    return {kind.name: {"task": kind.task, "engine": "openvino", "path": str(models / kind.folder), "device": "CPU"}
            for kind in kinds}


def _wav(seconds: float = 1.0, rate: int = 16_000) -> bytes:
    import numpy as np
    import soundfile

    samples = (0.2 * np.sin(2 * np.pi * 440 * np.arange(int(seconds * rate)) / rate)).astype(np.float32)
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format="WAV")
    return buffer.getvalue()


def send(client: httpx.Client, url: str, kind: Kind) -> httpx.Response:
    name = kind.name
    if kind.task == "embeddings":
        return client.post(url + "/v1/embeddings", json={"model": name, "input": TEXT})
    if kind.task == "rerank":
        return client.post(url + "/v1/rerank", json={"model": name, "query": "a cat", "documents": [TEXT, "stocks"]})
    if kind.task == "transcription":
        return client.post(url + "/v1/audio/transcriptions", data={"model": name},
                           files={"file": ("tone.wav", _wav(), "audio/wav")})
    if kind.task == "speech":
        return client.post(url + "/v1/audio/speech",
                           json={"model": name, "input": TEXT, "voice": "alloy", "response_format": "wav"})
    return client.post(url + "/v1/chat/completions",
                       json={"model": name, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})


def first_answer(url: str, kind: Kind) -> float:
    """Seconds from sending ``kind``'s request to its whole answer (the model stopped before)."""
    with httpx.Client(timeout=600) as client:
        start = time.perf_counter()
        answer = send(client, url, kind)
        answer.read()
        took = time.perf_counter() - start
    if answer.status_code != 200:
        raise RuntimeError(f"{kind.name}: cold request answered {answer.status_code}: {answer.text[:300]}")
    return took


def bare(python: str, kind: Kind, cache_dir: Path, models: Path = MODELS) -> dict[str, float]:
    """The bare pipeline in a fresh process: ``import_s``, ``load_s``, ``first_s``."""
    argv = [python, "-m", "bench.coldkinds", "--task", kind.task, "--path", str(models / kind.folder),
            "--cache-dir", str(cache_dir)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False, cwd=ROOT,
                          preexec_fn=die_with_parent)  # noqa: PLW1509 - only a prctl
    line = next((ln for ln in reversed(done.stdout.splitlines()) if ln.startswith("{")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"bare {kind.task} failed ({done.returncode}): {done.stderr.strip()[-600:]}")
    return {key: float(value) for key, value in json.loads(line).items()}


def rows(samples: Mapping[str, Mapping[str, list[float]]]) -> list[list[object]]:
    """One row per kind: ovrouter's median (min-max), the bare load + first answer's, their ratio."""
    found: list[list[object]] = []
    for task, figures in samples.items():
        cold, base = figures.get("cold_s") or [], figures.get("bare_s") or []
        if not cold or not base:
            continue
        start = figures.get("start_s") or []
        found.append([task, median(cold), f"{min(cold):.2f}-{max(cold):.2f}", median(start) if start else None,
                      median(base), median(figures.get("bare_load_s") or [0.0]), ratio(median(cold), median(base))])
    return found


# -- the bare side, in its own process -----------------------------------------------------------


def _properties(task: str, cache_dir: str | None) -> dict[str, Any]:
    """What the model server hands the pipeline on CPU (``engines/ov_options.py``, ``engines/vlm.py``)."""
    from modelserver.engines.ov_options import NO_CPU_CACHE

    properties: dict[str, Any] = {"CACHE_DIR": cache_dir} if cache_dir and task not in NO_CPU_CACHE else {}
    if task == "vlm":
        properties["ATTENTION_BACKEND"] = "SDPA"
    return properties


def _pipeline(ov_genai: Any, task: str, path: str, properties: dict[str, Any]) -> tuple[Any, Callable[[], Any]]:
    if task == "embeddings":
        pipe = ov_genai.TextEmbeddingPipeline(path, "CPU", **properties)
        return pipe, lambda: pipe.embed_documents([TEXT])
    if task == "rerank":
        pipe = ov_genai.TextRerankPipeline(path, "CPU", **properties)
        return pipe, lambda: pipe.rerank("a cat", [TEXT, "stocks"])
    if task == "transcription":
        import numpy as np

        pipe = ov_genai.WhisperPipeline(path, "CPU", **properties)
        rate = 16_000
        tone = (0.2 * np.sin(2 * np.pi * 440 * np.arange(rate) / rate)).astype(np.float32)
        return pipe, lambda: pipe.generate(tone.tolist())
    if task == "speech":
        pipe = ov_genai.Text2SpeechPipeline(path, "CPU", **properties)
        return pipe, lambda: pipe.generate(TEXT)
    pipe = ov_genai.VLMPipeline(path, "CPU", **properties)
    return pipe, lambda: pipe.generate("Hello", max_new_tokens=4)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.coldkinds", description=__doc__.splitlines()[0])
    parser.add_argument("--task", required=True, choices=[kind.task for kind in KINDS])
    parser.add_argument("--path", required=True)
    parser.add_argument("--cache-dir")
    args = parser.parse_args(argv)
    properties = _properties(args.task, args.cache_dir)
    start = time.perf_counter()
    import openvino_genai as ov_genai

    imported = time.perf_counter()
    _, answer = _pipeline(ov_genai, args.task, args.path, properties)
    loaded = time.perf_counter()
    answer()
    done = time.perf_counter()
    print(json.dumps({"import_s": imported - start, "load_s": loaded - imported, "first_s": done - loaded}), flush=True)


if __name__ == "__main__":
    main()
