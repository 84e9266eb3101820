"""On the real SmolLM2: a stream whose model process is SIGKILLed mid-generation is resumed on the
fresh process and completes as one answer (one role delta, one [DONE], the same id, usage summed)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.router_helpers import running_router, write_config

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(600)]


async def test_a_real_stream_survives_a_kill_of_its_backend(tmp_path: Path, demo_gguf: Path) -> None:
    model = {"task": "llm", "engine": "openvino", "path": str(demo_gguf), "save_ov_model": True,
             "startup_timeout_s": 300}
    path = write_config(tmp_path, {"smollm2": model}, router={"cache_dir": str(tmp_path / "ov-cache")})
    body = {"model": "smollm2", "stream": True, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "Count from one to fifty, separated by commas."}]}
    async with running_router(path) as router:
        lines: list[str] = []
        before = ""
        async with router.client.stream("POST", "/v1/chat/completions", json=body, timeout=300) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue  # a blank line, or a `: loading` comment while the model starts
                lines.append(line)
                if len(lines) == 9:  # the role chunk and eight pieces of the answer
                    before = text_of(lines)
                    pid = router.backend("smollm2").pid
                    assert pid is not None
                    os.kill(pid, signal.SIGKILL)
        parsed = [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]" for line in lines]
        assert parsed.count("[DONE]") == 1 and parsed[-1] == "[DONE]"
        chunks = [p for p in parsed if isinstance(p, dict)]
        assert not [c for c in chunks if "error" in c], chunks
        assert len({c["id"] for c in chunks}) == 1 and len({c["model"] for c in chunks}) == 1
        assert sum("role" in (c["choices"][0].get("delta") or {}) for c in chunks if c["choices"]) == 1
        whole = text_of(lines)
        assert whole.startswith(before) and len(whole) > len(before)
        assert whole.count(before.strip()) == 1, "the answer went on instead of starting over"
        usage = [c["usage"] for c in chunks if c.get("usage")]
        assert len(usage) == 1 and usage[0]["completion_tokens"] == 48  # ignore_eos: exactly max_tokens in all
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        # a fast CPU may have streamed all 48 tokens before the kill landed: its death is then seen a little later
        async with asyncio.timeout(60):
            while router.backend("smollm2").restarts == 0:
                await asyncio.sleep(0.02)
        assert router.backend("smollm2").restarts == 1


def text_of(lines: list[str]) -> str:
    out = ""
    for line in lines:
        if line.startswith("data: {"):
            event: Any = json.loads(line[6:])
            for choice in event.get("choices") or ():
                out += (choice.get("delta") or {}).get("content") or ""
    return out
