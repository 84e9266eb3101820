"""The cold-start baseline: load the pipeline in this process and generate the first token, nothing else.

``python -m bench.bare_pipeline --path IR_OR_GGUF [--tokenizer GGUF] --cache-dir DIR --prompt TEXT``
prints one JSON line: ``import_s`` (import openvino_genai), ``load_s`` (construct the
ContinuousBatchingPipeline, as the model server does, with the same CACHE_DIR), and
``first_token_s`` (chat template + one generated token, prefill included).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

__all__ = ["main"]


def _load(ov_genai: Any, path: str, tokenizer: str | None, device: str, cache_dir: str | None) -> Any:
    properties = {"CACHE_DIR": cache_dir} if cache_dir else {}
    scheduler = ov_genai.SchedulerConfig()
    if tokenizer:
        return ov_genai.ContinuousBatchingPipeline(path, ov_genai.Tokenizer(tokenizer), scheduler, device, **properties)
    return ov_genai.ContinuousBatchingPipeline(path, scheduler, device, properties)


def _first_token(ov_genai: Any, pipe: Any, prompt: str) -> str:
    text = pipe.get_tokenizer().apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    config = ov_genai.GenerationConfig()
    config.max_new_tokens = 1
    results = pipe.generate([text], [config])
    return str(results[0].m_generation_ids[0]) if hasattr(results[0], "m_generation_ids") else str(results[0])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bare_pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--path", required=True)
    parser.add_argument("--tokenizer")
    parser.add_argument("--device", default="CPU")
    parser.add_argument("--cache-dir")
    parser.add_argument("--prompt", default="What is the capital of France?")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    import openvino_genai as ov_genai

    imported = time.perf_counter()
    pipe = _load(ov_genai, args.path, args.tokenizer, args.device, args.cache_dir)
    loaded = time.perf_counter()
    token = _first_token(ov_genai, pipe, args.prompt)
    done = time.perf_counter()
    print(json.dumps({"import_s": imported - start, "load_s": loaded - imported, "first_token_s": done - loaded,
                      "token": token}), flush=True)


if __name__ == "__main__":
    main()
