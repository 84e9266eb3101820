"""Recovery times under the faults of the fault-tolerance issue, from the client's side (fake engine).

Episodes, each on a fresh router with one fake model (health every ``--health-interval``
seconds, ``--health-failures`` failed probes mean hung):

- ``hang``: a non-streamed ``[[hang]]`` request at t0, an innocent request 1 s later; prints when
  each was answered (status, code) and t(next success): a probe sends requests back to back
  from t0 + 1 s until one succeeds;
- ``sigstop``: the model process is SIGSTOPped at t0 with a stream in flight (SIGCONT never
  comes; the supervisor must kill it); the stream's outcome and t(next success);
- ``kill -9``: the model process is SIGKILLed at t0 with a stream in flight; the stream's
  outcome (resumed to ``[DONE]`` or cut) and t(next success);
- ``crash``: a non-streamed ``[[crash]]`` (a poison request) at t0 and an innocent request
  0.5 s later: their answers (the innocent one must not get a 503);
- ``hang alone``: a non-streamed ``[[hang]]`` request alone at t0: when it was named the cause;
- ``sigstop plain``: the model process is SIGSTOPped at t0 under a lone non-streamed request (SIGCONT never
  comes): the request's answer (retried on a fresh process: the stop was not its doing).

Each episode also prints ``found_by``: the model's ``last_error`` (which watcher killed the process).

``python -m bench.faultrecovery`` — bounded: every request has a 60 s deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.procs import Procs
from bench.routerctl import Router, fake_model, router_config, start_router

log = logging.getLogger("faultrecovery")

DEADLINE_S = 60.0
WORDS = " ".join(f"w{i}" for i in range(60))


def chat(text: str, stream: bool = False) -> dict[str, Any]:
    return {"model": "fake", "stream": stream, "messages": [{"role": "user", "content": text}]}


async def ask(session: aiohttp.ClientSession, url: str, body: dict[str, Any], t0: float) -> str:
    """``<status> <code-or-outcome> at <s since t0>``."""
    try:
        async with asyncio.timeout(DEADLINE_S), session.post(url + "/v1/chat/completions", json=body) as resp:
            if not body["stream"] or resp.status != 200:
                data = await resp.json(content_type=None)
                code = data.get("error", {}).get("code") if isinstance(data, dict) and "error" in data else "ok"
                return f"{resp.status} {code} at {time.monotonic() - t0:.2f}s"
            text, done, error = "", 0, None
            async for raw in resp.content:
                line = raw.decode(errors="replace").strip()
                if line == "data: [DONE]":
                    done += 1
                elif line.startswith("data: {") and '"error"' in line:
                    error = line[:120]
                elif line.startswith("data: {") and '"content"' in line:
                    text += line.split('"content":"', 1)[1].split('"', 1)[0]
            whole = text.split() == WORDS.split()
            outcome = f"stream {'complete' if whole else 'INCOMPLETE'} [DONE]x{done}"
            outcome += f" error={error}" if error else ""
            return f"{resp.status} {outcome} at {time.monotonic() - t0:.2f}s"
    except TimeoutError:
        return f"HUNG (no answer within {DEADLINE_S:g}s)"


async def next_success(session: aiohttp.ClientSession, url: str, t0: float, start_after_s: float) -> float:
    await asyncio.sleep(max(0.0, t0 + start_after_s - time.monotonic()))
    while time.monotonic() - t0 < DEADLINE_S:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with asyncio.timeout(DEADLINE_S), session.post(url + "/v1/chat/completions",
                                                                 json=chat("probe")) as resp:
                await resp.read()
                if resp.status == 200:
                    return time.monotonic() - t0
        await asyncio.sleep(0.05)
    return float("nan")


async def episode(router: Router, fault: str) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        await ask(session, router.url, chat("warm"), time.monotonic())
        pid = router.pid("fake")
        t0 = time.monotonic()
        result: dict[str, Any] = {"fault": fault, "pid": pid}
        if fault == "hang alone":
            result.update(poison=await ask(session, router.url, chat("poison [[hang]]"), t0))
            probe = asyncio.create_task(next_success(session, router.url, t0, 0.0))
        elif fault == "sigstop plain":
            request = asyncio.create_task(ask(session, router.url, chat(WORDS), t0))
            await asyncio.sleep(0.3)  # the request is under way (60 words, 0.02 s apart)
            t0 = time.monotonic()
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            result.update(request=await request)
            probe = asyncio.create_task(next_success(session, router.url, t0, 0.0))
        elif fault in ("hang", "crash"):
            marker = "[[hang]]" if fault == "hang" else "[[crash]]"
            poison = asyncio.create_task(ask(session, router.url, chat(f"poison {marker}"), t0))
            await asyncio.sleep(1.0 if fault == "hang" else 0.5)
            innocent = asyncio.create_task(ask(session, router.url, chat("innocent"), t0))
            probe = asyncio.create_task(next_success(session, router.url, t0, 1.0))
            result.update(poison=await poison, innocent=await innocent)
        else:
            stream = asyncio.create_task(ask(session, router.url, chat(WORDS, stream=True), t0))
            await asyncio.sleep(0.3)  # the stream is under way
            t0 = time.monotonic()
            assert pid is not None
            os.kill(pid, signal.SIGSTOP if fault == "sigstop" else signal.SIGKILL)
            probe = asyncio.create_task(next_success(session, router.url, t0, 0.0))
            result.update(stream=await stream)
        result["next_success_s"] = round(await probe, 2)
        result["new_pid"] = router.pid("fake")
        result["found_by"] = repr((router.models().get("fake") or {}).get("last_error"))
        if fault.startswith("sigstop") and pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.faultrecovery", description=__doc__.splitlines()[0])
    parser.add_argument("--health-interval", type=float, default=1.0)
    parser.add_argument("--health-failures", type=int, default=2)
    parser.add_argument("--faults", default="hang,hang alone,sigstop,sigstop plain,kill -9,crash")
    parser.add_argument("--keep", type=Path, help="copy each episode's router log here")
    parser.add_argument("--shipped-probes", action="store_true",
                        help="the shipped probe defaults (health_interval_s, health_timeout_s, health_failures)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    defaults: dict[str, Any] = {"request_timeout_s": 50}
    if args.shipped_probes:
        print("fake model: load_s 0.3, token_delay_s 0.02; the shipped probe defaults")
    else:
        defaults.update({"health_interval_s": args.health_interval, "health_failures": args.health_failures,
                         "health_timeout_s": 1.0})
        print(f"fake model: load_s 0.3, token_delay_s 0.02; health every {args.health_interval:g}s, "
              f"{args.health_failures} failures = hung")
    for fault in args.faults.split(","):
        with tempfile.TemporaryDirectory(prefix="ovrouter-faults-") as tmp, Procs(Path(tmp) / "logs") as procs:
            config = router_config(Path(tmp) / "state", {"fake": fake_model(load_s=0.3, token_delay_s=0.02,
                                                                            preload=True)}, defaults)
            router = start_router(procs, Path(tmp), config)
            deadline = time.monotonic() + 30
            while router.state("fake") != "ready" and time.monotonic() < deadline:
                time.sleep(0.05)
            result = asyncio.run(episode(router, fault))
            print("  ".join(f"{k}={v}" for k, v in result.items()))
            procs.stop(router.proc, timeout_s=30)
            if args.keep is not None:
                args.keep.mkdir(parents=True, exist_ok=True)
                for log_file in [*(Path(tmp) / "logs").glob("*"), *(Path(tmp) / "state" / "logs").glob("*.log")]:
                    (args.keep / f"{fault.replace(' ', '')}-{log_file.name}").write_bytes(log_file.read_bytes())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
