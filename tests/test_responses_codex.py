"""Codex CLI (``@openai/codex``) against the router's Responses API, non-interactively, on the fake engine.

Codex's default prompt (~3k fake tokens here, ~10k real ones) and tools (``function``, ``custom``,
``namespace``, ``web_search``...) go through unchanged. Skipped unless a ``codex`` binary is found
(``CODEX_BIN``, or ``codex`` on PATH: ``npm install @openai/codex`` in any folder, ~400 MB, is enough).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from tests.router_helpers import RunningRouter, fake_model, running_router, write_config

CODEX = os.environ.get("CODEX_BIN") or shutil.which("codex")
pytestmark = [pytest.mark.timeout(180), pytest.mark.skipif(not CODEX, reason="codex CLI not installed (CODEX_BIN)")]


async def _codex(router: RunningRouter, home: Path, prompt: str) -> str:
    work = home / "work"
    work.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        'model = "echo"\nmodel_provider = "ovrouter"\n\n[model_providers.ovrouter]\nname = "ovrouter"\n'
        f'base_url = "{router.url}/v1"\nwire_api = "responses"\nenv_key = "OVROUTER_API_KEY"\n'
    )
    env = {**os.environ, "CODEX_HOME": str(home), "OVROUTER_API_KEY": "unused", "HOME": str(home)}
    assert CODEX is not None
    proc = await asyncio.create_subprocess_exec(CODEX, "exec", "--skip-git-repo-check", prompt, cwd=work, env=env,
                                                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 120)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()[-2000:]
    return out.decode()


async def test_codex_exec_answers_and_runs_a_tool_round_trip(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"echo": fake_model(fake={"load_s": 0.05, "token_delay_s": 0.001})})
    async with running_router(config) as router:
        assert "say hello to the world" in await _codex(router, tmp_path / "home", "say hello to the world")
        # [[tool]]: the fake calls Codex's first tool; Codex runs it and sends the function_call_output back
        assert "tool result:" in await _codex(router, tmp_path / "home", "[[tool]] list the files")
