"""The /ui dashboard in a real headless browser: Debian's chromium driven by Playwright for Python.

No browser is downloaded: Playwright drives the system's ``/usr/bin/chromium`` (``make test``
installs it with apt-get when missing). Set ``OVROUTER_SCREENSHOTS=docs`` to write the
screenshots the README and docs/api.md show; otherwise they go to the test's temporary directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.router_helpers import RunningRouter, fake_model, running_router, write_config

playwright_api = pytest.importorskip("playwright.async_api")

CHROMIUM = os.environ.get("OVROUTER_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 20_000

pytestmark = pytest.mark.skipif(not shutil.which(CHROMIUM), reason=f"{CHROMIUM} missing: `make test` installs it")


def _models() -> dict[str, object]:
    return {"chat": fake_model(fake={"load_s": 0.05, "token_delay_s": 0.02}),
            "other": fake_model(task="embeddings")}


def _media_models() -> dict[str, object]:
    return {**_models(), "rr": fake_model(task="rerank"), "asr": fake_model(task="transcription")}


def _shots(tmp_path: Path) -> Path:
    target = os.environ.get("OVROUTER_SCREENSHOTS")
    return Path(target) if target else tmp_path


@pytest.fixture
async def browser() -> AsyncIterator[object]:
    async with playwright_api.async_playwright() as p:
        chromium = await p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield chromium
        finally:
            await chromium.close()


@contextlib.asynccontextmanager
async def _open(browser: object, router: RunningRouter, live: bool = True) -> AsyncIterator[object]:
    """The dashboard in a new page; the page is closed before the router stops (its streams end with it)."""
    page = await browser.new_page(viewport={"width": 1440, "height": 1000})  # type: ignore[attr-defined]
    try:
        page.set_default_timeout(TIMEOUT_MS)
        await page.goto(router.url + "/ui")
        if live:
            await page.wait_for_selector("#conn.on")
        yield page
    finally:
        await page.close()


def _row(page: object, model: str, state: str | None = None) -> str:
    return f'#models tr[data-model="{model}"]' + (f'[data-state="{state}"]' if state else "")


async def test_models_and_states_show_and_unload_is_seen_live(tmp_path: Path, browser: object) -> None:
    async with running_router(write_config(tmp_path, _models())) as router:
        async with _open(browser, router) as page:
            await page.wait_for_selector(_row(page, "chat", "stopped"))
            await page.wait_for_selector(_row(page, "other", "stopped"))
            await page.click(f'{_row(page, "chat")} button[data-act="load"]')
            await page.wait_for_selector(_row(page, "chat", "ready"))
            for words in ("a b c", "the quick brown fox jumps", "one two three four five six seven"):
                async with router.client.stream("POST", "/v1/chat/completions", json={
                        "model": "chat", "stream": True, "messages": [{"role": "user", "content": words}]}) as resp:
                    assert resp.status_code == 200
                    await resp.aread()
            await page.wait_for_selector("#requests tbody tr")
            cells = "document.querySelectorAll('#models tr[data-model=chat] td')"
            # memory and requests/min come with the next stats event (every 2 s)
            await page.wait_for_function(f"{cells}[4].textContent.trim() !== '–' && {cells}[7].textContent === '3'")
            await page.screenshot(path=str(_shots(tmp_path) / "ui-dashboard.png"), full_page=True)

            lags = await page.evaluate("window.ovrouter.stateLagMs.length")
            clicked = time.perf_counter()
            await page.click(f'{_row(page, "chat")} button[data-act="unload"]')
            await page.wait_for_selector(_row(page, "chat", "stopped"))
            click_to_stopped_ms = (time.perf_counter() - clicked) * 1000
            event_to_dom = (await page.evaluate("window.ovrouter.stateLagMs"))[lags:]
            assert event_to_dom, "the page saw no state event of the unload"
            assert router.backend("chat").pid is None
            print(f"\nUI state change: event->DOM median {statistics.median(event_to_dom):.1f} ms "
                  f"(max {max(event_to_dom):.1f} ms over {len(event_to_dom)}); unload click->'stopped' shown "
                  f"{click_to_stopped_ms:.0f} ms (includes stopping the process)")


async def test_the_page_loads_without_a_console_error(tmp_path: Path, browser: object) -> None:
    async with running_router(write_config(tmp_path, _models())) as router:
        page = await browser.new_page()  # type: ignore[attr-defined]
        failed: list[str] = []
        page.on("console", lambda m: failed.append(f"{m.text} {m.location}") if m.type == "error" else None)
        try:
            page.set_default_timeout(TIMEOUT_MS)
            await page.goto(router.url + "/ui")
            await page.wait_for_selector("#conn.on")
            await page.wait_for_selector(_row(page, "chat", "stopped"))
            # a browser asks for /favicon.ico (a 404, logged as a console error) unless the page names an icon
            assert await page.evaluate("document.querySelector('link[rel=icon]') !== null")
            assert failed == []
        finally:
            await page.close()


async def test_a_log_line_a_request_produced_is_followed(tmp_path: Path, browser: object) -> None:
    async with running_router(write_config(tmp_path, _models())) as router:
        assert (await router.client.post("/api/models/chat/load")).status_code == 200
        async with _open(browser, router) as page:
            await page.select_option("#log-model", "chat")
            await page.wait_for_function("document.querySelector('#logs').textContent.length > 0")
            assert (await router.client.post("/v1/chat/completions", json={
                "model": "chat", "messages": [{"role": "user", "content": "log me"}]})).status_code == 200
            await page.wait_for_function("document.querySelector('#logs').textContent"
                                         ".includes('POST /v1/chat/completions 200')")


async def test_chat_in_the_playground_streams_the_answer(tmp_path: Path, browser: object) -> None:
    async with running_router(write_config(tmp_path, _models())) as router:
        async with _open(browser, router) as page:
            await page.select_option("#pg-model", "chat")
            await page.fill("#chat-input", "hello from the playground")
            await page.click('[data-testid="chat-send"]')
            await page.wait_for_function("document.querySelector('#chat-log .msg.assistant .text')?.textContent"
                                         " === 'hello from the playground'")
            await page.screenshot(path=str(_shots(tmp_path) / "ui-playground.png"), full_page=True)
            await page.select_option("#pg-model", "other")
            await page.fill("#emb-input", "one\ntwo")
            await page.click("#emb-go")
            await page.wait_for_function("document.querySelector('#pg-out').textContent.includes('#1 ')")


async def test_rerank_and_transcribe_a_file_in_the_playground(tmp_path: Path, browser: object) -> None:
    documents = tmp_path / "docs.txt"
    documents.write_text("Paris is the capital of France.\nBananas are yellow.\n")
    audio = Path(__file__).parent / "data" / "espeak_john.flac"
    async with running_router(write_config(tmp_path, _media_models())) as router:
        async with _open(browser, router) as page:
            await page.select_option("#pg-model", "rr")
            await page.fill("#rr-query", "capital of France")
            await page.set_input_files("#rr-file", str(documents))
            await page.click("#rr-go")
            await page.wait_for_function("document.querySelector('#pg-out').textContent.includes('Bananas')")
            lines = (await page.text_content("#pg-out") or "").splitlines()
            assert len(lines) == 2 and all(float(line.split()[0]) >= 0 for line in lines)
            await page.select_option("#pg-model", "asr")
            await page.set_input_files("#tr-file", str(audio))
            await page.click("#tr-go")
            await page.wait_for_function("document.querySelector('#pg-out').textContent"
                                         ".startsWith('fake transcription of')")


async def test_a_reload_error_appears(tmp_path: Path, browser: object) -> None:
    config = write_config(tmp_path, _models())
    async with running_router(config) as router:
        async with _open(browser, router) as page:
            config.write_text(config.read_text().replace("health_interval_s: 1", "health_interval_s: soon"))
            await page.click("#reload")
            box = page.locator("#reload-result.bad")
            await box.wait_for()
            text = await box.text_content()
            assert "still serving the previous config" in (text or "") and "health_interval_s" in (text or "")
            await page.screenshot(path=str(_shots(tmp_path) / "ui-reload-error.png"))


async def test_with_an_admin_key_the_page_asks_for_it(tmp_path: Path, browser: object) -> None:
    config = write_config(tmp_path, _models(), router={"api_keys": ["sesame"]})
    async with running_router(config, api_key="sesame") as router:
        async with _open(browser, router, live=False) as page:
            await page.wait_for_selector("#key-dialog[open]")
            await page.fill("#key-input", "sesame")
            await page.click("#key-form button")
            await page.wait_for_selector(_row(page, "chat", "stopped"))
            assert "sesame" not in page.url
            assert await page.evaluate("sessionStorage.getItem('ovrouter-admin-key')") == "sesame"


async def test_a_tab_that_falls_behind_resyncs_and_shows_every_request(tmp_path: Path, browser: object) -> None:
    async with running_router(write_config(tmp_path, _models())) as router:
        assert (await router.client.post("/api/models/chat/load")).status_code == 200
        router.service.events.queue_size = 4  # a tiny queue: the burst below overflows it
        async with _open(browser, router) as page:
            for i in range(10):  # more than the queue holds, with no await between: this tab must resync
                router.service.events.publish("noise", {"i": i})
            body = {"model": "chat", "messages": [{"role": "user", "content": "burst"}]}
            replies = await asyncio.gather(*(router.client.post("/v1/chat/completions", json=body) for _ in range(20)))
            assert {r.status_code for r in replies} == {200}
            await page.wait_for_function("document.querySelectorAll('#requests tbody tr').length === 20")
            assert await page.evaluate("document.querySelector('#conn').textContent") == "live"
            assert await page.evaluate("window.ovrouter.resyncs") >= 1


async def test_cancel_a_request_in_flight_from_the_table(tmp_path: Path, browser: object) -> None:
    models = {"slow": fake_model(fake={"load_s": 0.05, "token_delay_s": 0.05})}
    async with running_router(write_config(tmp_path, models)) as router:
        assert (await router.client.post("/api/models/slow/load")).status_code == 200
        async with _open(browser, router) as page:
            words = "a b c d e [[stall]] f g h i j"  # half the words, then silence: only the cancel ends it
            body = {"model": "slow", "stream": True, "messages": [{"role": "user", "content": words}]}
            streaming = asyncio.create_task(router.client.post("/v1/chat/completions", json=body))
            await page.click('#requests button[data-testid="cancel"]')
            await page.wait_for_function("[...document.querySelectorAll('#requests tbody td')]"
                                         ".some((td) => td.textContent.includes('cancelled'))")
            reply = await asyncio.wait_for(streaming, 60)
            assert '"code": "request_cancelled"' in reply.text
            async with asyncio.timeout(60):
                while router.backend("slow").in_flight:
                    await asyncio.sleep(0.02)
