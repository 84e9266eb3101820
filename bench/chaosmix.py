"""``python -m bench.chaosmix``: faults in *combination* under mixed load, with the answers' shapes, the router's
views and the processes left checked after each.

``make chaos`` (bench/chaos.py) fires one action at a time at chat traffic. This soak runs episodes that put two
things on the same model at once, over chat, completions and embeddings (streamed and not) from ``CLIENTS``
clients to fake models and, unless ``--no-real``, the demo SmolLM2:

========================  ==============================================================================
episode                   what it does
========================  ==============================================================================
stop-edit                 SIGSTOP a model's process, change its config (a rolling change), SIGCONT later
kill-roll                 change a model's config and ``kill -9`` its old or its new process mid-change
unload-stream             long streams to a model, then ``POST /api/models/NAME/unload`` under them
remove-stream             add a model, stream from it, remove it from config.yaml under the streams
stop-spare                SIGSTOP the spare interpreter(s), then cold-start a model
invalid-yaml              config.yaml made invalid YAML under load, then good again
kill-emb                  ``kill -9`` or SIGSTOP (1-12 s) of the embeddings model under embeddings requests
stop-unload               SIGSTOP a model's process, then unload it
edit-unload               change a model's options and unload it at once
flip                      remove a model under its streams and add it back at once
restart-stop-new          ``POST .../restart``, SIGSTOP whatever new process appears
marker-edit               a ``[[crash]]``/``[[hang]]``/``[[fatal]]`` request, and a config change of the model
kill-starting             ``kill -9`` or SIGSTOP of a model's process while it starts, requests waiting
remove-starting           remove a model from config.yaml while it starts, requests waiting; add it back
supervisor-edit           change only router/supervisor settings of a loaded model: its pid must stay
storm                     unload, restart, load, a config change and a ``kill -9`` of one model at once
real-fault                ``kill -9``, SIGSTOP, unload or restart of SmolLM2 under its streams
retask                    a model's ``task`` flips between llm and embeddings under its requests
========================  ==============================================================================

After each episode it waits (bounded) for the models to settle and checks that ``/v1/models`` lists exactly
the configured models, that each READY model's pid is a live, unstopped process, that at most one process serves
each model, and that ``/v1/models``' status agrees with ``/api/models``. Every non-2xx answer must be the JSON
error shape ``{"error": {"message", "type", "code"}}`` and no body may hold a traceback. The run ends with a
``kill -9`` of the router (``--sigterm``: SIGTERM), and every process the router ever had as a descendant must
be gone within a few seconds.

It exits 1 on a hung request, a malformed error, a traceback in a body, a cut stream without an error event, a
garbled answer, a failure of ``calm``, a view that stays untrue, a model that does not settle, or a survivor.
Loopback only; bounded by ``--seconds`` (at most 600).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from bench.chaos import signal_pid
from bench.procs import Procs
from bench.realmodel import DEMO_GGUF
from bench.routerctl import Router, fake_model, router_config, start_router, write_config

log = logging.getLogger("chaosmix")

CLIENTS = 6
HUNG_S = 75.0
SETTLE_S = 60.0
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()
EDITABLE = ("alpha", "beta", "slow")


@dataclass(slots=True)
class Tally:
    outcomes: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # (model, kind, cause)
    episodes: Counter[str] = field(default_factory=Counter)
    failed_in: Counter[tuple[str, str]] = field(default_factory=Counter)  # (episode, cause) of requests not ok
    problems: list[str] = field(default_factory=list)
    samples: dict[tuple[str, str], str] = field(default_factory=dict)
    seen_pids: dict[int, float] = field(default_factory=dict)  # pid -> create_time of every router descendant

    def problem(self, text: str) -> None:
        log.error("PROBLEM: %s", text)
        self.problems.append(f"{time.strftime('%H:%M:%S')} {text}")


def base_models(real: bool) -> dict[str, Any]:
    chosen: dict[str, Any] = {
        "alpha": fake_model(load_s=0.3, token_delay_s=0.01, stall_timeout_s=3),
        "beta": fake_model(load_s=0.3, token_delay_s=0.01, stall_timeout_s=3),
        "slow": fake_model(load_s=0.3, token_delay_s=0.05, stall_timeout_s=3),
        "calm": fake_model(load_s=0.3, token_delay_s=0.01),
        "emb": {"task": "embeddings", "engine": "fake", "fake": {"load_s": 0.3}},
    }
    if real and DEMO_GGUF.exists():
        chosen["smollm2"] = {"task": "llm", "path": str(DEMO_GGUF), "save_ov_model": True, "max_concurrency": 4}
    return chosen


def error_ok(raw: bytes) -> str | None:
    """None when ``raw`` is the documented error shape; else what is wrong with it."""
    if b"Traceback" in raw:
        return "traceback in body"
    try:
        body = json.loads(raw)
    except ValueError:
        return "not JSON"
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or not {"message", "type", "code"} <= err.keys():
        return "not {error: {message, type, code}}"
    if not isinstance(err["message"], str) or not err["message"] or "\n" in err["message"]:
        return "message empty or not one line"
    return None


def request_for(model: str, kind: str, rng: random.Random, max_tokens: int = 12) -> tuple[str, dict[str, Any], str]:
    """(path, body, the unbroken answer of a fake model or "")."""
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20)))
    text = f"hello from a client {words}"
    expect = " ".join(text.split()[:max_tokens])
    if kind == "emb":
        return "/v1/embeddings", {"model": model, "input": [text, words]}, ""
    stream = kind.endswith("-s")
    if kind.startswith("chat"):
        return "/v1/chat/completions", {"model": model, "stream": stream, "max_tokens": max_tokens,
                                        "messages": [{"role": "user", "content": text}]}, expect
    # a prompt ending with a newline: the fake engine continues a resumed one faithfully (modelserver/engines/fake.py)
    return "/v1/completions", {"model": model, "stream": stream, "max_tokens": max_tokens, "prompt": text + "\n"}, \
        expect


async def one(session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any], tally: Tally,
              expect: str) -> str:
    """The cause of one request's outcome: ``ok``, ``http N``, ``error event``, ``cut``, ``hung``, ``conn``,
    ``garbled``, ``bad error`` (a body not of the documented shape)."""
    model = body["model"]
    try:
        async with asyncio.timeout(HUNG_S), session.post(url + path, json=body) as resp:
            raw = await resp.read() if resp.status != 200 or not body.get("stream") else b""
            if resp.status != 200:
                wrong = error_ok(raw)
                tally.samples.setdefault((model, str(resp.status)), raw[:200].decode(errors="replace"))
                if wrong:
                    tally.problem(f"{model} {path} {resp.status}: {wrong}: {raw[:300]!r}")
                    return "bad error"
                return f"http {resp.status}"
            if body.get("stream"):
                cause, text = await read_stream(resp, tally, model)
                if cause != "ok":
                    return cause
            else:
                data = json.loads(raw)
                if path.endswith("embeddings"):
                    return "ok" if len(data["data"]) == len(body["input"]) else "garbled"
                choice = data["choices"][0]
                text = choice["message"]["content"] if "message" in choice else choice["text"]
            if expect and model != "smollm2" and text.split() != expect.split():
                tally.samples.setdefault((model, "garbled"), f"{text!r} != {expect!r}")
                return "garbled"
            return "ok"
    except TimeoutError:
        return "hung"
    except (aiohttp.ClientError, ValueError, KeyError) as exc:
        tally.samples.setdefault((model, "conn"), repr(exc)[:200])
        return "conn"


async def read_stream(resp: aiohttp.ClientResponse, tally: Tally, model: str) -> tuple[str, str]:
    errored, text = False, ""
    async for raw in resp.content:
        line = raw.decode(errors="replace").strip()
        if line == "data: [DONE]":
            return ("error event" if errored else "ok"), text
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[6:])
        if "error" in event:
            errored = True
            wrong = error_ok(line[6:].encode())
            tally.samples.setdefault((model, "error event"), line[6:206])
            if wrong:
                tally.problem(f"{model} stream error event: {wrong}: {line[:300]}")
            continue
        for choice in event.get("choices") or ():
            text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
    return ("error event" if errored else "cut"), text


KINDS = ("chat", "chat-s", "compl", "compl-s")


class Soak:
    def __init__(self, router: Router, config: dict[str, Any], session: aiohttp.ClientSession, tally: Tally,
                 rng: random.Random, state_dir: Path) -> None:
        self.router, self.config, self.session, self.tally, self.rng = router, config, session, tally, rng
        self.state_dir = state_dir
        self.removed: dict[str, float] = {}  # model -> when it last left the config (404s expected meanwhile)
        self.pending: set[asyncio.Task[Any]] = set()
        self.adding: set[str] = set()  # in config.yaml, not yet in /v1/models: clients leave them alone
        self.episode = "warm-up"  # the episode under way (or the last one), for the failures' report

    # ---- load -------------------------------------------------------------------------------------------------

    async def send(self, model: str, kind: str, max_tokens: int = 12) -> str:
        path, body, expect = request_for(model, kind, self.rng, max_tokens)
        started = time.monotonic()
        cause = await one(self.session, self.router.url, path, body, self.tally, expect)
        if cause == "http 404" and (model in self.removed or model not in self.config["models"]):
            cause = "404 (removed)"
        if cause == "http 400" and model == "shifty":
            cause = "400 (retasked)"
        if self.episode == "finale (kill -9)" and cause in ("conn", "cut"):
            cause = "router killed"
        self.tally.outcomes[(model, kind, cause)] += 1
        if cause != "ok":
            self.tally.failed_in[(self.episode, cause)] += 1
        calm_failed = model == "calm" and cause not in ("ok", "router killed")
        if cause in ("hung", "cut", "garbled", "bad error") or calm_failed:
            self.tally.problem(f"{model} {kind} {cause} after {time.monotonic() - started:.1f} s in {self.episode}")
        return cause

    async def client(self, until: float, seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < until:
            names = [n for n in self.config["models"] if n not in self.adding]
            model = rng.choice(names)
            kind = "emb" if self.config["models"].get(model, {}).get("task") == "embeddings" else rng.choice(KINDS)
            await self.send(model, kind)

    def background(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)
        return task

    # ---- helpers ----------------------------------------------------------------------------------------------

    async def api_models(self) -> dict[str, dict[str, Any]]:
        return await asyncio.to_thread(self.router.models)

    async def pid(self, name: str) -> int | None:
        row = (await self.api_models()).get(name)
        return int(row["pid"]) if row and row.get("pid") else None

    async def spare_pids(self) -> set[int]:
        status = await asyncio.to_thread(self.router.get, "/api/status")
        return {s["pid"] for s in (status.get("spares") or {}).get("spares", [])}

    def descendants(self) -> list[psutil.Process]:
        try:
            kids = psutil.Process(self.router.proc.pid).children(recursive=True)
        except psutil.Error:
            return []
        for kid in kids:
            with contextlib.suppress(psutil.Error):
                self.tally.seen_pids.setdefault(kid.pid, kid.create_time())
        return kids

    def model_pids(self, name: str) -> list[int]:
        """Live processes serving ``name``: those listening on its socket (``sockets/NAME-GEN.sock``), a spare that
        became it included (its environment in /proc is still the spare's)."""
        found = []
        for kid in self.descendants():
            with contextlib.suppress(psutil.Error):
                if kid.status() == psutil.STATUS_ZOMBIE:
                    continue
                for conn in kid.net_connections(kind="unix"):
                    sock = Path(conn.laddr).name if isinstance(conn.laddr, str) else ""
                    if sock.endswith(".sock") and sock[: -len(".sock")].rsplit("-", 1)[0] == name:
                        found.append(kid.pid)
                        break
        return found

    async def signal(self, pid: int | None, sig: signal.Signals) -> bool:
        return signal_pid(pid, sig)

    async def write(self) -> None:
        await asyncio.to_thread(write_config, self.router.config_path, self.config)

    def change(self, name: str) -> None:
        fake = self.config["models"][name]["fake"]
        fake["token_delay_s"] = self.rng.choice([0.005, 0.01, 0.02, 0.03]) if name != "slow" else \
            self.rng.choice([0.04, 0.05, 0.06])
        fake["load_s"] = self.rng.choice([0.2, 0.3, 0.5])
        options = self.rng.choice([None, 200, 400])  # a model's options (the fake counts words)
        if options is None:
            self.config["models"][name].pop("options", None)
        else:
            self.config["models"][name]["options"] = {"context_length": options}

    async def load(self, name: str) -> None:
        with contextlib.suppress(OSError):
            await asyncio.to_thread(self.router.post, f"/api/models/{name}/load", None, 60)

    async def post(self, path: str) -> tuple[int, Any]:
        try:
            return await asyncio.to_thread(self.router.post, path, None, 60)
        except OSError as exc:
            self.tally.problem(f"POST {path}: {exc!r} (no answer in 60 s)")
            return 0, None

    async def streams(self, name: str, count: int, max_tokens: int = 60) -> list[asyncio.Task[str]]:
        tasks = [self.background(self.send(name, self.rng.choice(("chat-s", "compl-s")), max_tokens))
                 for _ in range(count)]
        await asyncio.sleep(self.rng.uniform(0.8, 2.0))
        return tasks

    # ---- episodes ---------------------------------------------------------------------------------------------

    async def stopped_under_streams(self) -> tuple[str, int | None]:
        """An editable model loaded, two streams started on it, then its process SIGSTOPped: (name, pid)."""
        name = self.rng.choice(EDITABLE)
        await self.load(name)
        await self.streams(name, 2, 30)
        pid = await self.pid(name)
        await self.signal(pid, signal.SIGSTOP)
        return name, pid

    async def stop_edit(self) -> None:
        name, pid = await self.stopped_under_streams()
        self.change(name)
        await self.write()
        await asyncio.sleep(self.rng.uniform(1.0, 5.0))
        await self.signal(pid, signal.SIGCONT)

    async def kill_roll(self) -> None:
        name = self.rng.choice(EDITABLE)
        await self.load(name)
        old = await self.pid(name)
        await self.streams(name, 2, 30)
        self.change(name)
        await self.write()
        victim = None
        for _ in range(100):
            others = [p for p in self.model_pids(name) if p != old]
            if others:
                victim = self.rng.choice([old, others[0]])
                break
            await asyncio.sleep(0.05)
        await self.signal(victim or old, signal.SIGKILL)

    async def unload_stream(self) -> None:
        name = self.rng.choice(("slow", "alpha", "smollm2" if "smollm2" in self.config["models"] else "slow"))
        await self.load(name)
        await self.streams(name, 3, 60)
        await self.post(f"/api/models/{name}/unload")

    async def remove_stream(self) -> None:
        self.config["models"]["extra"] = fake_model(load_s=0.2, token_delay_s=0.05)
        self.removed.pop("extra", None)
        self.adding.add("extra")
        await self.write()
        await self.settled_config()
        self.adding.discard("extra")
        await self.streams("extra", 3, 60)
        self.removed["extra"] = time.monotonic()
        del self.config["models"]["extra"]
        await self.write()

    async def flip(self) -> None:
        name = self.rng.choice(("alpha", "beta"))
        await self.load(name)
        await self.streams(name, 3, 40)
        saved = self.config["models"].pop(name)
        self.removed[name] = time.monotonic()
        await self.write()
        await asyncio.sleep(self.rng.uniform(0.0, 1.5))
        self.config["models"][name] = saved
        await self.write()
        await self.settled_config()
        self.removed.pop(name, None)

    async def stop_spare(self) -> None:
        spares = await self.spare_pids()
        for pid in spares:
            await self.signal(pid, signal.SIGSTOP)
        name = self.rng.choice(("alpha", "beta", "emb"))
        await self.post(f"/api/models/{name}/unload")
        kind = "emb" if name == "emb" else "chat"
        await asyncio.gather(*(self.send(name, kind) for _ in range(2)))
        for pid in spares:  # a spare still waiting resumes; one the router killed is gone
            await self.signal(pid, signal.SIGCONT)

    async def invalid_yaml(self) -> None:
        self.router.config_path.write_text("models: {broken: [\n  - : :\n", encoding="utf-8")
        await asyncio.sleep(1.5)
        status = await asyncio.to_thread(self.router.get, "/api/status")
        if (status.get("last_reload") or {}).get("ok") is not False:
            self.tally.problem(f"invalid config.yaml not reported: {status.get('last_reload')}")
        await asyncio.gather(*(self.send(n, "chat") for n in ("calm", "alpha")))
        await self.write()

    async def kill_emb(self) -> None:
        """``kill -9``, or a SIGSTOP long enough (or not) for the hang to be found, of the embeddings model."""
        await self.load("emb")
        tasks = [self.background(self.send("emb", "emb")) for _ in range(4)]
        await asyncio.sleep(0.05)
        pid = await self.pid("emb")
        if self.rng.random() < 0.5:
            await self.signal(pid, signal.SIGKILL)
        else:
            await self.signal(pid, signal.SIGSTOP)
            tasks += [self.background(self.send("emb", "emb")) for _ in range(2)]
            await asyncio.sleep(self.rng.uniform(1.0, 12.0))
            await self.signal(pid, signal.SIGCONT)
        await asyncio.gather(*tasks)

    async def stop_unload(self) -> None:
        name, pid = await self.stopped_under_streams()
        started = time.monotonic()
        await self.post(f"/api/models/{name}/unload")
        log.info("unload of a stopped %s took %.1f s", name, time.monotonic() - started)
        await self.signal(pid, signal.SIGCONT)

    async def edit_unload(self) -> None:
        name = self.rng.choice(EDITABLE)
        await self.load(name)
        await self.streams(name, 2, 30)
        self.change(name)
        await self.write()
        await asyncio.sleep(self.rng.uniform(0.0, 0.6))
        await self.post(f"/api/models/{name}/unload")

    async def restart_stop_new(self) -> None:
        name = self.rng.choice(EDITABLE)
        await self.load(name)
        old = await self.pid(name)
        await self.streams(name, 2, 30)
        restart = self.background(self.post(f"/api/models/{name}/restart"))
        for _ in range(200):
            others = [p for p in self.model_pids(name) if p != old]
            if others:
                await self.signal(others[0], signal.SIGSTOP)
                break
            await asyncio.sleep(0.02)
        await restart

    async def marker_edit(self) -> None:
        name = self.rng.choice(("alpha", "beta"))
        marker = self.rng.choice(("[[crash]]", "[[hang]]", "[[fatal]]", "[[crash-mid]]"))
        body = {"model": name, "stream": self.rng.random() < 0.5, "max_tokens": 12,
                "messages": [{"role": "user", "content": f"poison {marker}"}]}

        async def poison() -> None:
            cause = await one(self.session, self.router.url, "/v1/chat/completions", body, self.tally, "")
            self.tally.outcomes[(name, "poison", cause)] += 1
            if cause in ("hung", "cut", "bad error"):
                self.tally.problem(f"poison {marker} to {name}: {cause}")

        self.background(poison())
        await self.streams(name, 2, 20)
        self.change(name)
        await self.write()

    async def kill_starting(self) -> None:
        name = self.rng.choice(EDITABLE)
        await self.post(f"/api/models/{name}/unload")
        tasks = [self.background(self.send(name, self.rng.choice(KINDS))) for _ in range(3)]
        for _ in range(300):
            pids = self.model_pids(name)
            if pids:
                await self.signal(pids[0], self.rng.choice([signal.SIGKILL, signal.SIGSTOP]))
                break
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        for pid in pids:
            await self.signal(pid, signal.SIGCONT)

    async def remove_starting(self) -> None:
        name = self.rng.choice(("alpha", "beta"))
        await self.post(f"/api/models/{name}/unload")
        tasks = [self.background(self.send(name, self.rng.choice(KINDS))) for _ in range(3)]
        await asyncio.sleep(self.rng.uniform(0.05, 0.4))
        saved = self.config["models"].pop(name)
        self.removed[name] = time.monotonic()
        await self.write()
        await asyncio.gather(*tasks)
        await self.settled_config()
        self.config["models"][name] = saved
        await self.write()
        await self.settled_config()
        self.removed.pop(name, None)

    async def supervisor_edit(self) -> None:
        """A change of router/supervisor-only settings must leave the process alone (same pid)."""
        name = self.rng.choice(EDITABLE)
        await self.load(name)
        if (await self.api_models())[name].get("rolling_error"):
            return  # a rolling change whose new process failed: the process runs the old spec, the next reload retries
        before = await self.pid(name)
        await self.streams(name, 2, 20)
        model = self.config["models"][name]
        model["max_concurrency"] = self.rng.choice([4, 8, 16])
        model["idle_timeout_s"] = self.rng.choice([0, 600])
        model["aliases"] = self.rng.choice([[], [f"{name}-alias"]])
        await self.write()
        await asyncio.sleep(1.5)
        after = await self.pid(name)
        if before is not None and after is not None and before != after:
            self.tally.problem(f"{name}: supervisor-only edit changed pid {before} -> {after}")

    async def storm(self) -> None:
        """Unload, restart, a config change and a kill of one model, all at once."""
        name = self.rng.choice(EDITABLE)
        await self.load(name)
        await self.streams(name, 2, 30)
        pid = await self.pid(name)
        self.change(name)
        jobs = [self.post(f"/api/models/{name}/unload"), self.post(f"/api/models/{name}/restart"), self.write(),
                self.signal(pid, signal.SIGKILL), self.post(f"/api/models/{name}/load")]
        self.rng.shuffle(jobs)
        await asyncio.gather(*jobs)

    async def real_fault(self) -> None:
        """The demo model (never faulted by ``make chaos``): kill -9, SIGSTOP or an unload under its streams."""
        name = "smollm2" if "smollm2" in self.config["models"] else "slow"
        await self.load(name)
        await self.streams(name, 3, 40)
        pid = await self.pid(name)
        action = self.rng.choice(("kill", "stop", "unload", "restart"))
        log.info("real_fault: %s %s pid=%s", action, name, pid)
        if action == "kill":
            await self.signal(pid, signal.SIGKILL)
        elif action == "stop":
            await self.signal(pid, signal.SIGSTOP)
            await asyncio.sleep(self.rng.uniform(1.0, 15.0))  # past the probes' 4-6 s or not
            await self.signal(pid, signal.SIGCONT)
        else:
            await self.post(f"/api/models/{name}/{action}")

    async def finale(self, kill: bool) -> None:
        """The router goes (``kill -9``, or SIGTERM) in the middle of things: cold starts with requests waiting, a
        spare SIGSTOPped, a rolling change and streams under way."""
        for pid in await self.spare_pids():
            await self.signal(pid, signal.SIGSTOP)
        for name in ("alpha", "beta"):
            await self.post(f"/api/models/{name}/unload")
        busy = [self.background(self.send(name, kind, 40)) for name in ("alpha", "beta", "slow", "emb", "calm")
                for kind in (("emb",) if name == "emb" else ("chat-s", "compl"))]
        self.change("slow")
        await self.write()
        await asyncio.sleep(self.rng.uniform(0.1, 1.0))
        self.descendants()
        log.info("finale: %s the router with %d requests under way", "kill -9" if kill else "SIGTERM", len(busy))
        self.episode = "finale (kill -9)" if kill else "finale (SIGTERM)"
        self.router.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        await asyncio.to_thread(self.router.proc.wait, 60)
        await asyncio.gather(*busy, return_exceptions=True)

    async def retask(self) -> None:
        """A model whose ``task`` flips between llm and embeddings under its own requests (a 400 naming the task for
        a request of the other kind is clean; a 5xx or a hang is not)."""
        was = self.config["models"].get("shifty", {}).get("task")
        self.config["models"]["shifty"] = {"task": "embeddings" if was == "llm" else "llm", "engine": "fake",
                                           "fake": {"load_s": 0.2, "token_delay_s": 0.03}}
        self.removed.pop("shifty", None)
        kinds = ("emb",) if was == "embeddings" else ("chat-s", "compl")
        tasks = [self.background(self.send("shifty", self.rng.choice(kinds), 30)) for _ in range(3)] if was else []
        if was is None:
            self.adding.add("shifty")
        await asyncio.sleep(self.rng.uniform(0.0, 0.5))
        await self.write()
        await asyncio.gather(*tasks)
        if was is None:
            await self.settled_config()
            self.adding.discard("shifty")

    EPISODES = ("stop_edit", "kill_roll", "unload_stream", "remove_stream", "flip", "stop_spare", "invalid_yaml",
                "kill_emb", "stop_unload", "edit_unload", "restart_stop_new", "marker_edit",
                "kill_starting", "remove_starting", "supervisor_edit", "storm", "real_fault", "retask")

    # ---- checks -----------------------------------------------------------------------------------------------

    async def settled_config(self) -> None:
        """Wait until /v1/models lists exactly the configured models."""
        want = set(self.config["models"])
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            listed = {m["id"] for m in (await asyncio.to_thread(self.router.get, "/v1/models"))["data"]}
            if listed == want:
                return
            await asyncio.sleep(0.2)
        self.tally.problem(f"/v1/models lists {sorted(listed)}, config has {sorted(want)}")

    async def check(self, episode: str) -> None:
        await self.settled_config()
        deadline = time.monotonic() + SETTLE_S
        while True:
            wrong = await self.untrue()
            if not wrong:
                return
            if time.monotonic() > deadline:
                self.tally.problem(f"after {episode}, not settled in {SETTLE_S:.0f} s: {wrong}")
                return
            await asyncio.sleep(0.5)

    async def untrue(self) -> list[str]:
        rows = await self.api_models()
        status = await asyncio.to_thread(self.router.get, "/api/status")
        states = {name: str(row["state"]).lower() for name, row in rows.items()}
        if status["models"] != states:  # two reads a moment apart: a start may fall between (settled: equal)
            return [f"/api/status models {status['models']} != /api/models {states}"]
        listed = {m["id"]: m for m in (await asyncio.to_thread(self.router.get, "/v1/models"))["data"]}
        wrong = []
        for name, row in rows.items():
            state = str(row["state"]).lower()
            if state in ("starting", "stopping", "waiting"):
                wrong.append(f"{name} {state}")
                continue
            pids = await asyncio.to_thread(self.model_pids, name)
            if state == "ready":
                pid = row.get("pid")
                try:
                    status = psutil.Process(pid).status()
                except (psutil.Error, TypeError, ValueError):
                    status = "gone"
                if status in ("gone", psutil.STATUS_ZOMBIE, psutil.STATUS_STOPPED):
                    wrong.append(f"{name} ready with pid {pid} {status}")
                if pids and pids != [pid]:
                    wrong.append(f"{name} ready pid {pid}, processes {pids}")
            elif state in ("stopped", "backoff") and pids:
                wrong.append(f"{name} {state} with processes {pids}")
            value = ((listed.get(name) or {}).get("status") or {}).get("value")
            expected = {"ready": "loaded", "stopped": "unloaded"}.get(state)
            if expected and value != expected:
                wrong.append(f"{name} {state} but /v1/models says {value}")
        spares = await self.spare_pids()
        for pid in spares:
            with contextlib.suppress(psutil.Error):
                if psutil.Process(pid).status() == psutil.STATUS_STOPPED:
                    wrong.append(f"spare {pid} listed while stopped")
        # every process the router has is a READY model's, a listed spare's or the watchdog: anything else is a
        # replacement under way (a rolling change's new process, an old one draining) or a leak
        owned = spares | {int(row["pid"]) for row in rows.values() if row.get("pid")}
        strays = []
        for kid in await asyncio.to_thread(self.descendants):
            with contextlib.suppress(psutil.Error):
                watchdog = any(part.endswith("watchdog.py") for part in kid.cmdline())  # procman's, for a kill -9
                if kid.pid not in owned and not watchdog and kid.status() != psutil.STATUS_ZOMBIE:
                    strays.append(f"{kid.pid} {' '.join(kid.cmdline()[2:6])}")
        if strays:
            wrong.append(f"processes neither a model's nor a spare: {strays}")
        return wrong


async def run(router: Router, config: dict[str, Any], seconds: float, seed: int, state_dir: Path,
              only: tuple[str, ...], kill_router: bool) -> Tally:
    rng, tally = random.Random(seed), Tally()
    until = time.monotonic() + seconds
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        soak = Soak(router, config, session, tally, rng, state_dir)
        clients = [asyncio.create_task(soak.client(until, seed + i)) for i in range(CLIENTS)]
        episodes = only or Soak.EPISODES
        while time.monotonic() < until - 10:
            episode = rng.choice(episodes)
            tally.episodes[episode] += 1
            soak.episode = episode
            log.info("episode %s", episode)
            started = time.monotonic()
            try:
                await asyncio.wait_for(getattr(soak, episode)(), 90)
            except TimeoutError:
                tally.problem(f"episode {episode} did not end in 90 s")
            await asyncio.gather(*list(soak.pending))
            await soak.check(episode)
            log.info("episode %s done in %.1f s", episode, time.monotonic() - started)
        await asyncio.gather(*clients, *list(soak.pending))
        await soak.finale(kill_router)
    return tally


def survivors(seen: dict[int, float]) -> list[str]:
    left = []
    for pid, created in seen.items():
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid} {' '.join(proc.cmdline()[:6])}")
    return left


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaosmix", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=180.0, help="soak length (at most 600)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-real", action="store_true", help="fake models only")
    parser.add_argument("--sigterm", action="store_true", help="end with SIGTERM of the router, not kill -9")
    parser.add_argument("--only", help="comma-separated episodes (default: all)")
    parser.add_argument("--keep-logs", type=Path, help="copy the router's log here at the end")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    only = tuple(e.strip().replace("-", "_") for e in args.only.split(",")) if args.only else ()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ovrouter-chaosmix-") as tmp, Procs(Path(tmp) / "logs") as procs:
        state_dir = Path(tmp) / "state"
        config = router_config(state_dir, base_models(not args.no_real),
                               {"health_interval_s": 1, "health_failures": 2, "request_timeout_s": 50})
        router = start_router(procs, Path(tmp), config)
        tally = asyncio.run(run(router, config, min(args.seconds, 600.0), args.seed, state_dir, only,
                                not args.sigterm))
        procs.stop(router.proc, timeout_s=30)  # after a kill -9 only reaps it
        deadline = time.monotonic() + 5
        while (left := survivors(tally.seen_pids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for line in left:
            tally.problem(f"survived the router: {line}")
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(line.split()[0]), signal.SIGKILL)
        log_text = (Path(tmp) / "logs" / "router.log").read_text(errors="replace")
        tracebacks = log_text.count("Traceback")
        if args.keep_logs:
            args.keep_logs.mkdir(parents=True, exist_ok=True)
            (args.keep_logs / "router.log").write_text(log_text)
            with contextlib.suppress(OSError):  # the model servers' own logs (procman keeps them in state_dir/logs)
                shutil.copytree(state_dir / "logs", args.keep_logs / "models", dirs_exist_ok=True)
    print_report(tally, time.monotonic() - started, tracebacks)
    return 1 if tally.problems else 0


def print_report(tally: Tally, wall_s: float, tracebacks: int) -> None:
    print(f"\nchaosmix: {wall_s:.0f} s wall, {CLIENTS} clients; episodes {dict(tally.episodes)}")
    print(f"router descendants seen: {len(tally.seen_pids)}; tracebacks in the router's log: {tracebacks}")
    by_cause: Counter[str] = Counter()
    for (model, kind, cause), count in sorted(tally.outcomes.items()):
        by_cause[cause] += count
        if cause != "ok":
            print(f"  {model:<8} {kind:<8} {cause:<14} {count}")
    print(f"requests by outcome: {dict(by_cause)}")
    print(f"requests not ok, by the episode under way: {dict(tally.failed_in)}")
    for (model, what), sample in sorted(tally.samples.items()):
        print(f"  first {what} of {model}: {sample}")
    for problem in tally.problems:
        print(f"PROBLEM {problem}")
    print("chaosmix: " + ("FAILED" if tally.problems else "passed"))


if __name__ == "__main__":
    sys.exit(main())
