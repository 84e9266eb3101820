"""``make chaos``: a bounded soak of the router under faults, with mixed load, that fails on what must never happen.

Load: ``CLIENTS`` clients send streamed and non-streamed chat requests to several fake models
(and the real demo model unless ``--no-real``) for ``--seconds`` (default 120, at most 300).
Meanwhile a chaos loop, every ``--every`` seconds, picks one action against the *faulted*
models: ``kill -9`` of the model process, ``SIGSTOP`` for a few seconds then ``SIGCONT``,
a request carrying a fault marker (``[[fatal]]``, ``[[crash]]``, ``[[hang]]``, ``[[error]]``),
a config edit (a changed setting, a model added, the same removed, an invalid file then the
good one back), ``POST /api/models/NAME/unload`` and ``.../restart``. One model, ``calm``,
is never touched.

It prints requests ok / failed by cause per model, hung requests (no answer within
``HUNG_S``), cut streams (ended without ``[DONE]``) and streams ended by an error event, and
the processes left behind after the router's SIGTERM. Every answer of a fake model is checked
against the text an unbroken one gives (the echo of its words, ``max_tokens`` of them): a
different text is *garbled* (a resumed stream that repeated or lost words at the seam). Clean
requests that failed while a ``[[crash]]``, ``[[hang]]`` or ``[[fatal]]`` request to the same
model was in flight are counted as *failed beside a marker* (``--actions marker`` makes every
clean failure one). It exits 1 on any hung request, any cut stream without an error event,
any garbled answer, any failure of ``calm``, or an orphan process. Marker requests are the
poison: their own outcome is counted apart and never fails the run.

Each clean failure is listed with the time it was sent; ``--keep-logs DIR`` keeps the router's log
(procman's and the recovery path's lines) there, to find what happened to it.

Traffic goes to 127.0.0.1 only; every loop is bounded in count and time.
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

from bench.procs import Procs
from bench.realmodel import DEMO_GGUF
from bench.routerctl import Router, fake_model, router_config, start_router, write_config

log = logging.getLogger("chaos")

CLIENTS = 6
HUNG_S = 60.0
FAULTED = ("alpha", "beta")
#: The first error body seen per (model, status), printed with the figures.
SAMPLES: dict[tuple[str, int], str] = {}
MARKERS = ("[[fatal]]", "[[crash]]", "[[hang]]", "[[error]]", "[[suspect]]", "[[stall]]", "[[crash-mid]]",
           "[[fatal-mid]]", "[[abort]]")
#: The markers whose clean neighbours must all be served (the issue's target: 0 failed beside them).
BESIDE = ("[[crash]]", "[[hang]]", "[[fatal]]")
ACTIONS = ("kill", "stop", "marker", "marker", "edit", "unload", "restart")
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()
MAX_TOKENS = 12


@dataclass(slots=True)
class Tally:
    """What the clients saw, per model and cause."""

    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)  # (model, cause)
    poison: Counter[str] = field(default_factory=Counter)  # marker requests, by outcome
    actions: Counter[str] = field(default_factory=Counter)
    hung: list[str] = field(default_factory=list)
    cut: list[str] = field(default_factory=list)
    garbled: list[str] = field(default_factory=list)
    seconds: dict[tuple[str, str], list[float]] = field(default_factory=dict)  # (model, cause) -> durations
    markers: list[tuple[str, str, float, float]] = field(default_factory=list)  # (model, marker, start, end)
    failed: list[tuple[str, str, float, float]] = field(default_factory=list)  # clean: (model, cause, start, end)
    wall_offset: float = field(default_factory=lambda: time.time() - time.monotonic())  # monotonic -> wall clock

    def beside(self, kinds: tuple[str, ...] = BESIDE) -> list[tuple[str, str, float, float]]:
        """Clean failures while a marker request of ``kinds`` to the same model was in flight."""
        return [f for f in self.failed if any(m[0] == f[0] and m[1] in kinds and m[2] < f[3] and f[2] < m[3]
                                              for m in self.markers)]

    def add(self, model: str, cause: str, duration_s: float = 0.0) -> None:
        self.outcomes[(model, cause)] += 1
        self.seconds.setdefault((model, cause), []).append(duration_s)


def models(real: bool, wrapped: bool = True) -> dict[str, Any]:
    chosen: dict[str, Any] = {
        "alpha": fake_model(load_s=0.3, token_delay_s=0.01, stall_timeout_s=3),
        "beta": fake_model(load_s=0.3, token_delay_s=0.01, stall_timeout_s=3),
        "calm": fake_model(load_s=0.3, token_delay_s=0.01),
    }
    if wrapped:
        chosen["wrapped"] = wrapped_model()
    if real and DEMO_GGUF.exists():
        chosen["smollm2"] = {"task": "llm", "path": str(DEMO_GGUF), "save_ov_model": True, "max_concurrency": 4}
    return chosen


def wrapped_model() -> dict[str, Any]:
    """A fake model started through a shell (its server is the shell's child): the router's
    ``kill -9`` at the end must take the grandchild with it."""
    server = f"{sys.executable} -m modelserver --engine fake --name wrapped --uds ${{SOCKET}}"
    return {"command": ["sh", "-c", f"{server} & wait"], "preload": True}


def chat(model: str, text: str, stream: bool) -> dict[str, Any]:
    return {"model": model, "stream": stream, "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": text}]}


def unbroken(body: dict[str, Any]) -> str:
    """The fake engine's answer to ``body`` without faults: its words echoed, ``max_tokens`` of them."""
    return " ".join(body["messages"][-1]["content"].split()[: body["max_tokens"]])


async def one_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    """The cause of one request's outcome: ``ok``, ``garbled``, ``http <status>``, ``error event``, ``cut``,
    ``hung``, ``conn``. ``garbled``: a fake model's answer that is not the unbroken one."""
    try:
        async with asyncio.timeout(HUNG_S), session.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                raw = await resp.read()
                SAMPLES.setdefault((body["model"], resp.status), raw[:240].decode(errors="replace"))
                return f"http {resp.status}"
            if not body["stream"]:
                text = (await resp.json())["choices"][0]["message"]["content"]
            else:
                cause, text = await read_stream(resp, body["model"])
                if cause != "ok":
                    return cause
            if body["model"] != "smollm2" and text != unbroken(body):
                SAMPLES.setdefault((body["model"], -1), f"{text!r} where the unbroken answer is {unbroken(body)!r}")
                return "garbled"
            return "ok"
    except TimeoutError:
        return "hung"
    except (aiohttp.ClientError, ValueError):
        return "conn"


async def read_stream(resp: aiohttp.ClientResponse, model: str = "") -> tuple[str, str]:
    errored, text = False, ""
    async for raw in resp.content:
        line = raw.decode(errors="replace").strip()
        if line == "data: [DONE]":
            return ("error event" if errored else "ok"), text
        if line.startswith("data: ") and '"error"' in line:
            errored = True
            SAMPLES.setdefault((model, 0), line[6:246])  # the first error event per model, printed with the figures
        elif line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices") or ():
                text += (choice.get("delta") or {}).get("content") or ""
    return ("error event" if errored else "cut"), text


async def client_loop(session: aiohttp.ClientSession, url: str, names: list[str], until: float,
                      tally: Tally, rng: random.Random) -> None:
    while time.monotonic() < until:
        model = rng.choice(names)
        stream = rng.random() < 0.5
        started = time.monotonic()
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20)))
        cause = await one_request(session, url, chat(model, f"hello from a client {words}", stream))
        ended = time.monotonic()
        tally.add(model, cause, ended - started)
        if cause != "ok":
            tally.failed.append((model, cause, started, ended))
        if cause == "hung":
            tally.hung.append(f"{model} stream={stream}")
        if cause == "cut":
            tally.cut.append(f"{model} stream={stream}")
        if cause == "garbled":
            tally.garbled.append(f"{model} stream={stream}")


def signal_model(router: Router, name: str, sig: signal.Signals) -> bool:
    return signal_pid(router.pid(name), sig)


def signal_pid(pid: int | None, sig: signal.Signals) -> bool:
    """Send ``sig`` to ``pid``; False when there is none or it is gone."""
    if pid is None:
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
        return True
    return False


class Chaos:
    """The chaos loop's actions; each returns quickly except SIGSTOP (held a few seconds)."""

    def __init__(self, router: Router, config: dict[str, Any], session: aiohttp.ClientSession, tally: Tally,
                 rng: random.Random) -> None:
        self.router, self.config, self.session, self.tally, self.rng = router, config, session, tally, rng
        self.pending: set[asyncio.Task[None]] = set()
        self.markers: tuple[str, ...] = MARKERS
        self.actions: tuple[str, ...] = ACTIONS

    async def act(self) -> None:
        action = self.rng.choice(self.actions)
        target = self.rng.choice(FAULTED)
        self.tally.actions[action] += 1
        log.info("chaos: %s %s", action, target)
        try:
            await getattr(self, action)(target)
        except OSError as exc:  # an /api call past its 30 s (TimeoutError) or refused: counted, the run goes on
            log.warning("chaos: %s %s failed: %r", action, target, exc)
            self.tally.actions[f"{action} failed"] += 1

    async def kill(self, name: str) -> None:
        await asyncio.to_thread(signal_model, self.router, name, signal.SIGKILL)

    async def stop(self, name: str) -> None:
        pid = await asyncio.to_thread(self.router.pid, name)
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(self.rng.uniform(1.0, 6.0))
            os.kill(pid, signal.SIGCONT)

    async def marker(self, name: str) -> None:
        marker = self.rng.choice(self.markers)
        body = chat(name, f"poison {marker}", self.rng.random() < 0.5)

        async def send() -> None:
            started = time.monotonic()
            self.tally.poison[await one_request(self.session, self.router.url, body)] += 1
            self.tally.markers.append((name, marker, started, time.monotonic()))

        task = asyncio.create_task(send())
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def edit(self, name: str) -> None:
        kind = self.rng.choice(["change", "add", "remove", "invalid"])
        path = self.router.config_path
        if kind == "change":
            self.config["models"][name]["fake"]["token_delay_s"] = self.rng.choice([0.005, 0.01, 0.02])
        elif kind == "add":
            self.config["models"]["extra"] = fake_model(load_s=0.2)
        elif kind == "remove":
            self.config["models"].pop("extra", None)
        if kind == "invalid":
            path.write_text("models: {broken: [", encoding="utf-8")
            await asyncio.sleep(1.5)
        write_config(path, self.config)

    async def unload(self, name: str) -> None:
        await asyncio.to_thread(self.router.post, f"/api/models/{name}/unload", None, 30)

    async def restart(self, name: str) -> None:
        await asyncio.to_thread(self.router.post, f"/api/models/{name}/restart", None, 30)


async def soak(router: Router, config: dict[str, Any], seconds: float, every_s: float, seed: int,
               markers: tuple[str, ...] = MARKERS, actions: tuple[str, ...] = ACTIONS) -> Tally:
    rng, tally = random.Random(seed), Tally()
    names = [name for name in config["models"] if name != "extra"]
    until = time.monotonic() + seconds
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        chaos = Chaos(router, config, session, tally, rng)
        chaos.markers, chaos.actions = markers, actions
        clients = [asyncio.create_task(client_loop(session, router.url, names, until, tally,
                                                   random.Random(seed + i))) for i in range(CLIENTS)]
        while time.monotonic() < until - every_s:
            await asyncio.sleep(every_s)
            await chaos.act()
        await asyncio.gather(*clients, *chaos.pending)
    return tally


def model_processes(state_dir: Path) -> list[psutil.Process]:
    """Processes whose command line names this run's state directory (model servers, wrappers)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "environ"]):
        with contextlib.suppress(psutil.Error):
            text = " ".join(proc.info["cmdline"] or []) + json.dumps(proc.info.get("environ") or {})
            if str(state_dir) in text and proc.pid != os.getpid():
                found.append(proc)
    return found


def report(tally: Tally, orphans: list[psutil.Process], seconds: float) -> list[str]:
    """Print the figures; the list of reasons the run fails (empty: passed)."""
    print(f"\nchaos soak: {seconds:.0f} s, {CLIENTS} clients; actions: {dict(tally.actions)}")
    print(f"{'model':<10} {'cause':<14} {'requests':>8} {'median s':>9} {'max s':>7}")
    for (model, cause), count in sorted(tally.outcomes.items()):
        times = sorted(tally.seconds.get((model, cause), [0.0]))
        print(f"{model:<10} {cause:<14} {count:>8} {times[len(times) // 2]:>9.3f} {times[-1]:>7.2f}")
    print(f"poison (marker) requests: {dict(tally.poison)}")
    for (model, status), sample in sorted(SAMPLES.items()):
        what = {0: "error event", -1: "garbled answer"}.get(status, str(status))
        print(f"  first {what} of {model}: {sample}")
    print(f"hung: {len(tally.hung)}  cut streams without an error event: {len(tally.cut)}  orphans: {len(orphans)}")
    beside = tally.beside()
    print(f"garbled answers: {len(tally.garbled)}  clean requests failed beside {'/'.join(BESIDE)}: {len(beside)} "
          f"(of {len(tally.failed)} clean failures; {Counter(f[1] for f in beside)})")
    for model, cause, start, end in sorted(tally.failed, key=lambda f: f[2]):
        at = time.strftime("%H:%M:%S", time.localtime(start + tally.wall_offset))
        print(f"  clean failure: {model} {cause} sent {at} after {end - start:.1f} s"
              f"{' (beside a marker)' if (model, cause, start, end) in beside else ''}")
    reasons = []
    if tally.garbled:
        reasons.append(f"{len(tally.garbled)} garbled answer(s): {tally.garbled[:5]}")
    if tally.hung or tally.poison.get("hung"):
        reasons.append(f"{len(tally.hung) + tally.poison.get('hung', 0)} hung request(s): {tally.hung[:5]}")
    if tally.cut:
        reasons.append(f"{len(tally.cut)} cut stream(s) without an error event: {tally.cut[:5]}")
    calm_failed = sum(count for (model, cause), count in tally.outcomes.items() if model == "calm" and cause != "ok")
    if calm_failed:
        reasons.append(f"{calm_failed} failed request(s) to the untouched model `calm`")
    if orphans:
        reasons.append(f"orphan processes: {[(p.pid, p.info['cmdline'][:4]) for p in orphans]}")
    return reasons


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="soak length (at most 300)")
    parser.add_argument("--every", type=float, default=2.0, help="seconds between chaos actions")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--no-real", action="store_true", help="fake models only (no real demo model)")
    parser.add_argument("--kill-router", action="store_true", help="end with kill -9 of the router, not SIGTERM")
    parser.add_argument("--markers", help="comma-separated fault markers to send (default: all of them)")
    parser.add_argument("--no-wrapped", action="store_true", help="leave out the shell-wrapped command: model")
    parser.add_argument("--actions", help=f"comma-separated chaos actions (default: {','.join(sorted(set(ACTIONS)))})")
    parser.add_argument("--keep-logs", type=Path, help="copy the router's and model servers' logs here at the end")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    seconds = min(args.seconds, 300.0)
    with tempfile.TemporaryDirectory(prefix="ovrouter-chaos-") as tmp, Procs(Path(tmp) / "logs") as procs:
        state_dir = Path(tmp) / "state"
        config = router_config(state_dir, models(not args.no_real, not args.no_wrapped),
                               {"health_interval_s": 1, "health_failures": 2, "request_timeout_s": 50})
        router = start_router(procs, Path(tmp), config)
        markers = tuple(m.strip() for m in args.markers.split(",")) if args.markers else MARKERS
        actions = tuple(a.strip() for a in args.actions.split(",")) if args.actions else ACTIONS
        tally = asyncio.run(soak(router, config, seconds, args.every, args.seed, markers, actions))
        if args.kill_router:
            router.proc.kill()  # kill -9: no shutdown, only PDEATHSIG and the watchdog clean up
            router.proc.wait(10)
        else:
            procs.stop(router.proc, timeout_s=30)
        orphans = reap_orphans(state_dir)
        reasons = report(tally, orphans, seconds)
        keep_logs(Path(tmp), args.keep_logs)
    return verdict("chaos", reasons)


def keep_logs(tmp: Path, into: Path | None) -> None:
    """Copy the run's logs (the router's, with every model server's lines) to ``into``, for reading the failures."""
    if into is not None:
        shutil.copytree(tmp / "logs", into, dirs_exist_ok=True)
        print(f"logs kept in {into}")


def reap_orphans(state_dir: Path) -> list[psutil.Process]:
    """The model processes left after the router went (killed now); call once the router has exited."""
    time.sleep(1.0)  # a moment for the kernel to deliver PDEATHSIG to the last children
    orphans = model_processes(state_dir)
    for proc in orphans:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return orphans


def verdict(name: str, reasons: list[str]) -> int:
    """Print each reason the run fails and the verdict; the exit status."""
    for reason in reasons:
        print(f"FAIL: {reason}")
    print(f"{name}: " + ("FAILED" if reasons else "passed"))
    return 1 if reasons else 0


if __name__ == "__main__":
    sys.exit(main())
