"""Claude Code (``claude -p``) against the router, on the fake engine: its whole prompt (~75 kB of system text,
24 tools, ``thinking``, ``output_config``, ``context_management``, a ``system`` message inside ``messages``,
``max_tokens`` 32000, a streamed ``/v1/messages?beta=true`` with ``x-api-key``) must be served unchanged.

Skipped unless Claude Code is installed: ``CLAUDE_CODE_BIN`` names the binary, else ``claude`` on the PATH
(``npm install @anthropic-ai/claude-code`` in any directory gives ``node_modules/.bin/claude``). HOME is a
temporary directory and telemetry is off, so nothing leaves the machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest

from tests.router_helpers import fake_model, running_router, write_config

pytestmark = pytest.mark.timeout(180)

CLAUDE = os.environ.get("CLAUDE_CODE_BIN") or shutil.which("claude")


@pytest.mark.skipif(CLAUDE is None, reason="Claude Code is not installed (set CLAUDE_CODE_BIN)")
async def test_claude_code_print_mode_runs_against_the_router(tmp_path: Path) -> None:
    model = fake_model(fake={"load_s": 0.05, "token_delay_s": 0.0}, aliases=["claude-sonnet-4-5"])
    config = write_config(tmp_path, {"echo": model}, router={"api_keys": ["sekret"]})
    home = tmp_path / "home"
    home.mkdir()
    async with running_router(config) as router:
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home), "ANTHROPIC_BASE_URL": router.url,
               "ANTHROPIC_API_KEY": "sekret", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_ERROR_REPORTING": "1",
               **{f"ANTHROPIC_DEFAULT_{tier}_MODEL": "claude-sonnet-4-5" for tier in ("OPUS", "SONNET", "HAIKU")}}
        process = await asyncio.create_subprocess_exec(
            str(CLAUDE), "-p", "say hello in five words", "--output-format", "json", cwd=tmp_path, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(process.communicate(), 150)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    assert process.returncode == 0, err.decode()[-2000:]
    result = json.loads(out)
    assert result["subtype"] == "success" and not result["is_error"]
    assert "say hello in five words" in result["result"]  # the fake echoes the user's turn
