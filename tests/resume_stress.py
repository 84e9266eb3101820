"""A randomized stress of stream resumption: many concurrent chat and completion streams on the fake
engine, a process hung (SIGSTOP) or killed at a random moment, and a rolling restart, a reload that
changes the model, an unload, an eviction under the memory budget (a request to a second model that
only fits once this one is gone) or a kill landing before, during or after the hang is found — one
or two of them a round. Every stitched text is checked against the unbroken answer: the same text
byte for byte, or a prefix of it ended by an error event — never a different text. A continuation
the fake engine refused (it answers 400 to a final message or prompt that is not the start of its
answer, where it would otherwise restart the answer) counts as garbled too: that error event hides
a wrong resume. Used by tests/test_router_resume_stress.py (a short run) and ``make stress`` (a long one).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.router_helpers import RunningRouter, fake_model, running_router, write_config

#: Words of the echoed texts: ASCII, accented, CJK and emoji (several UTF-8 bytes each).
VOCABULARY = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
              "quebec romeo sierra tango uniform victor whiskey xray yankee zulu naïve über ça 日本語 東京 "
              "😀 ünïcödé señor").split()
#: What may land beside the hang: nothing, a rolling restart, a reload that changes the process, an unload,
#: an eviction (a request to the other model, which fits only once this one is stopped), a kill -9 (of
#: whichever process is current then).
ACTIONS = ("none", "restart", "reload", "unload", "evict", "kill")
#: When the action lands: before the SIGSTOP, right after it, or once the hang is likely found.
WHENS = ("before", "during", "after")
#: The fault: a SIGSTOP held until the hang is found, one lifted after a moment, or none.
HANGS = ("hang", "hang", "brief stop", "no stop")
STREAM_BOUND_S = 90.0
#: A continuation the fake engine refused (modelserver/engines/fake.py's words, in the router's error event): the
#: router asked it to continue a text that is not the start of its answer — a resume that was not faithful.
REFUSED = "which cannot continue it"
#: Sizes under the budget: two processes of ``echo`` fit (a rolling change runs beside), ``echo`` and ``other`` not.
BUDGET_MB, ECHO_MB, OTHER_MB = 700, 300, 500


@dataclass
class Outcome:
    """One stream as its client saw it, and what the unbroken stream said."""

    expected: str
    chat: bool = True
    text: str = ""
    error: str | None = None
    message: str = ""  # the error's message
    dones: int = 0
    roles: int = 0
    status: int = 0
    ids: set[str] = field(default_factory=set)
    client_error: str | None = None

    def problem(self) -> str | None:
        """Why this outcome is wrong (None: exact, or a prefix ended by an error event)."""
        if self.client_error is not None:
            return f"the client failed: {self.client_error}"
        if self.status != 200:
            return None if self.error else f"status {self.status} without an error body"
        if self.dones != 1:
            return f"{self.dones} [DONE] events"
        if REFUSED in self.message:
            return f"GARBLED resume refused by the engine ({self.message}): got {self.text!r}"
        if self.roles != int(self.chat) or len(self.ids) > 1:
            return f"{self.roles} role deltas, ids {sorted(self.ids)}"
        if self.error is None and self.text != self.expected:
            return f"GARBLED: got {self.text!r}, unbroken {self.expected!r}"
        if self.error is not None and not self.expected.startswith(self.text):
            return f"GARBLED before an error ({self.error}): got {self.text!r}, unbroken {self.expected!r}"
        return None


@dataclass
class Figures:
    rounds: int = 0
    streams: int = 0
    exact: int = 0
    errors: int = 0
    problems: list[str] = field(default_factory=list)
    scenarios: dict[str, int] = field(default_factory=dict)
    codes: dict[str, int] = field(default_factory=dict)  # the error codes that ended streams
    resumed: int = 0  # streams the router resumed (its log's word for it)
    retried: int = 0  # requests it sent again before their answer began


class Resumes(logging.Handler):
    """Counts the router's resumes and retries as it logs them."""

    def __init__(self, figures: Figures) -> None:
        super().__init__(logging.WARNING)
        self.figures = figures

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.figures.resumed += "resuming the stream on a fresh process" in message
        self.figures.retried += "retrying once on a fresh process" in message


def path_of(body: dict[str, Any]) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


def body_of(rng: random.Random, stream: bool = True) -> dict[str, Any]:
    """A chat or a completion (its prompt ends with a newline: the fake continues it) whose echo is a random
    text; sometimes capped, sometimes with a stop string inside it (from a word's start, or mid-word)."""
    words = [rng.choice(VOCABULARY) for _ in range(rng.randint(12, 60))]
    text = " ".join(words)
    body: dict[str, Any] = {"model": "echo", "stream": stream}
    if rng.random() < 0.5:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text + "\n"
    roll = rng.random()
    if roll < 0.3:
        body["max_tokens"] = rng.randint(1, len(words) + 3)
    elif roll < 0.5:  # a stop string made of a word and the next: its first word is held back where it matches
        at = rng.randrange(1, len(words) - 1)
        stop = f"{words[at]} {words[at + 1]}"
        body["stop"] = [stop[rng.randrange(len(words[at])):]]  # sometimes from inside the word: held mid-word
    if rng.random() < 0.3:
        body["stream_options"] = {"include_usage": True}
    return body


async def read(client: httpx.AsyncClient, body: dict[str, Any], expected: str, delay_s: float = 0.0) -> Outcome:
    await asyncio.sleep(delay_s)
    out = Outcome(expected, chat="messages" in body)
    try:
        return await _read(client, body, out)
    except httpx.HTTPError as exc:  # a silence longer than the client's read timeout, a connection cut
        out.client_error = f"{type(exc).__name__} after {out.text!r}"
        return out


async def _read(client: httpx.AsyncClient, body: dict[str, Any], out: Outcome) -> Outcome:
    async with client.stream("POST", path_of(body), json=body) as response:
        out.status = response.status_code
        if response.status_code != 200:
            raw = await response.aread()
            with contextlib.suppress(ValueError, KeyError, TypeError):
                out.error = json.loads(raw)["error"]["code"]
                out.message = str(json.loads(raw)["error"]["message"])
            return out
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.dones += 1
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out.error = event["error"].get("code") or "error"
                out.message = str(event["error"].get("message"))
                continue
            out.ids.add(event["id"])
            for choice in event.get("choices") or ():
                delta = choice.get("delta") or {}
                out.roles += "role" in delta
                out.text += (delta.get("content") or "") if out.chat else (choice.get("text") or "")
    return out


async def unbroken(client: httpx.AsyncClient, body: dict[str, Any]) -> str:
    """The text of the same request, answered without faults (non-streamed: the same engine path's text)."""
    reply = await client.post(path_of(body), json={**body, "stream": False}, timeout=60)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    return str(choice["message"]["content"] if "messages" in body else choice["text"])


class Stress:
    def __init__(self, router: RunningRouter, config_path: Path, rng: random.Random, figures: Figures,
                 streams: int) -> None:
        self.router, self.config_path, self.rng, self.figures, self.streams = router, config_path, rng, figures, streams
        # idle connections dropped well before the server's keep-alive timeout (uvicorn's 5 s, httpx's default
        # expiry too): a request sent on a connection the server closes that moment fails with a ReadError
        self.client = httpx.AsyncClient(base_url=router.url, timeout=60, limits=httpx.Limits(keepalive_expiry=1.0))

    def found_s(self) -> float:
        """About when the probes (and the heartbeat watch, which waits as long) find a hang."""
        spec = self.router.service.registry.models["echo"].spec
        return spec.health_interval_s * spec.health_failures + spec.health_timeout_s

    def pid(self) -> int | None:
        backend = self.router.backend("echo")
        return backend.pid if backend.state.value == "ready" else None

    async def act(self, action: str, delay_s: float = 0.0) -> None:
        await asyncio.sleep(delay_s)
        client = self.client
        if action == "restart":  # rolling (the model's restart setting, unless a reload made it stop-first)
            await client.post("/api/models/echo/restart", timeout=120)
        elif action == "reload":  # a setting the engine reads: the process is replaced, rolling or stop-first
            data = yaml.safe_load(self.config_path.read_text())
            fake = data["models"]["echo"]["fake"]
            fake["load_s"] = max(0.02, fake["load_s"] + self.rng.choice([0.01, -0.01]))
            data["models"]["echo"]["restart"] = self.rng.choice(["rolling", "rolling", "stop-first"])
            self.config_path.write_text(yaml.safe_dump(data, sort_keys=False))
            await client.post("/api/reload", timeout=120)
        elif action == "unload":
            await client.post("/api/models/echo/unload", timeout=120)
        elif action == "evict":  # fits only once echo is stopped: evicted as soon as it is idle
            await client.post("/v1/completions", json={"model": "other", "prompt": "room"}, timeout=120)
        elif action == "kill":
            pid = self.pid()
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    async def round(self) -> None:
        rng, client = self.rng, self.client
        bodies = [body_of(rng) for _ in range(self.streams)]
        expected = await asyncio.gather(*(unbroken(client, b) for b in bodies))
        hang = rng.choice(HANGS)
        plans = [(rng.choice(ACTIONS), rng.choice(WHENS)) for _ in range(1 if rng.random() < 0.6 else 2)]
        if not self.figures.rounds:  # the first round (all of a short run) is the issue's: a rolling restart
            hang, plans = "hang", [("restart", "during")]  # lands on the stopped process before its hang is found
        scenario = f"{hang} + " + " & ".join(f"{action} {when}" for action, when in plans)
        self.figures.scenarios[scenario] = self.figures.scenarios.get(scenario, 0) + 1
        late = len(bodies) - len(bodies) // 3  # the last third starts after the stop: on the stopped process
        readers = []  # (retried before their first token) or, once the replacement serves, on the new one
        for b, e in zip(bodies[:late], expected[:late], strict=True):
            readers.append(asyncio.create_task(read(client, b, e)))
            await asyncio.sleep(rng.uniform(0, 0.05))  # staggered starts: cut points spread over the answers
        stopped: int | None = None
        actions: list[asyncio.Task[None]] = []
        try:
            await asyncio.sleep(rng.uniform(0, 0.4))
            actions += [asyncio.create_task(self.act(a)) for a, when in plans if when == "before"]
            await asyncio.sleep(rng.uniform(0, 0.3))
            if hang != "no stop" and (stopped := self.pid()) is not None:
                os.kill(stopped, signal.SIGSTOP)
                if hang == "brief stop":  # continued about when the probes (or the stall watch) give up on it
                    asyncio.get_running_loop().call_later(rng.uniform(0.5, 3.5), _cont, stopped)
            found_s = self.found_s()
            for action, when in plans:  # during: before the hang can be found; after: about when it is
                if when != "before":
                    delay = rng.uniform(0, found_s / 2) if when == "during" else rng.uniform(found_s / 2, found_s * 1.5)
                    actions.append(asyncio.create_task(self.act(action, delay)))
            for b, e in zip(bodies[late:], expected[late:], strict=True):
                readers.append(asyncio.create_task(read(client, b, e, rng.uniform(0, found_s * 1.5))))
            done, pending = await asyncio.wait(readers, timeout=STREAM_BOUND_S)
            await asyncio.wait(actions, timeout=STREAM_BOUND_S)
        finally:
            for task in actions:
                task.cancel()
            if stopped is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(stopped, signal.SIGCONT)  # a process never found hung goes on (nothing leaks)
        for task in pending:
            task.cancel()
        self.figures.rounds += 1
        for index, task in enumerate(readers):
            self.figures.streams += 1
            if task in pending:
                self.figures.problems.append(f"[{scenario}] stream {index} took over {STREAM_BOUND_S:g}s")
                continue
            self.count(scenario, index, bodies[index], task.result())

    def count(self, scenario: str, index: int, body: dict[str, Any], outcome: Outcome) -> None:
        problem = outcome.problem()
        if problem is not None:
            self.figures.problems.append(f"[{scenario}] stream {index} {json.dumps(body, ensure_ascii=False)}: "
                                         f"{problem}")
        elif outcome.error is None:
            self.figures.exact += 1
        else:
            self.figures.errors += 1
            code = str(outcome.error)
            self.figures.codes[code] = self.figures.codes.get(code, 0) + 1


def _cont(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def stress_config(tmp_path: Path, rng: random.Random) -> Path:
    """Fast probes (the issue's slower ones on some runs); a stall watch on some runs; a start that takes a
    moment on others (a rolling change then runs beside the hung process for a while, as in the issue's
    soak); a memory budget that holds two processes of ``echo`` (a rolling change) but not ``echo`` beside
    ``other`` (an eviction)."""
    fast_health = {"health_interval_s": 0.5, "health_timeout_s": 1, "health_failures": 2}
    if rng.random() < 0.3:  # the soak: a hang found seconds after a rolling change began beside it
        fast_health = {"health_interval_s": 2, "health_timeout_s": 2, "health_failures": 3}
    extra = {"stall_timeout_s": rng.choice([1.5, 3.0])} if rng.random() < 0.5 else {}
    if rng.random() < 0.7:  # a round's fault is a first failure; else they add up, and after max_retries the
        extra["stable_after_s"] = 1.0  # streams of a model left in backoff end with an error event
    fake = {"load_s": rng.choice([0.05, 0.5, 1.5]), "token_delay_s": rng.choice([0.02, 0.05])}
    model = fake_model(fake=fake, max_resumes=3, drain_timeout_s=30, memory_mb=ECHO_MB, restart="rolling",
                       **fast_health, **extra)
    other = fake_model(fake={"load_s": 0.05, "token_delay_s": 0.005}, memory_mb=OTHER_MB)
    return write_config(tmp_path, {"echo": model, "other": other},
                        router={"memory_budget": {"CPU": f"{BUDGET_MB}MiB"}})


async def run_stress(tmp_path: Path, seconds: float, seed: int, streams: int = 8) -> Figures:
    """Rounds of concurrent streams and faults for about ``seconds`` (one at least); the figures (problems
    listed)."""
    figures, rng = Figures(), random.Random(seed)
    path = stress_config(tmp_path, rng)
    counter, recovery = Resumes(figures), logging.getLogger("router.path.recovery")
    recovery.addHandler(counter)
    try:
        async with running_router(path) as router:
            stress = Stress(router, path, rng, figures, streams)
            async with stress.client:
                until = time.monotonic() + seconds
                while True:  # one round at least
                    await stress.round()
                    await wait_ready(stress.client)
                    if time.monotonic() >= until or figures.problems:
                        break
    finally:
        recovery.removeHandler(counter)
    return figures


async def wait_ready(client: httpx.AsyncClient, timeout_s: float = 60.0) -> None:
    """Between rounds: the model serves again (a hang found, a relaunch done, any retired process gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        reply = await client.post("/v1/chat/completions", json={"model": "echo", "messages": [
            {"role": "user", "content": "ready"}]}, timeout=timeout_s)
        if reply.status_code == 200:
            return
        assert time.monotonic() < deadline, reply.text
        await asyncio.sleep(0.2)
