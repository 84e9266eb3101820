"""One client request across the processes it may outlive: retry, resume, or name the poison.

:func:`forward` (called by ``router.path.proxy.forward``) sends the request to a leased process.
When that process dies under it — it exits, it is killed as hung, it answers
``X-Backend-Fatal: 1`` or a fatal error event mid-stream, or its stream stalls for
``stall_timeout_s`` while it still answers health probes — :func:`router.path.blame.verdict`
decides: a request with nothing sent yet is sent again to the fresh process, a stream
under way is resumed there (:mod:`router.path.resume`: the client's stream goes on, same ids,
no second role delta), a request that is the likely cause is answered naming itself
(``request_crashed_model``), and any other gets one short line. One retry or resume per
request (``max_resumes`` for streams); the fresh process is waited for within the
request's own bounds (the backend parks it while it restarts).

A stream is resumable when :func:`router.path.resume.plan` says so; everything else takes the
plain path of :func:`router.path.relay.relay`, chunk by chunk, unchanged.

**Suspects run one at a time.** The requests of a death shared by several (:func:`router.path.blame.suspect`)
take their second try through the model's *suspect lane* (:class:`router.state.lane.SuspectLane`), one at a
time, and new requests of the model wait while suspects are served, so a poison request's retry runs
alone: it takes nobody down with it and is the one named, and the innocent ones are served. The lane
is taken before the lease and given back when the suspect's answer begins (the response head; a
resumed stream's first event) — a poison request would have taken the process down before — or after
:func:`_lane_hold_s` at most (the time a hang needs to be found); a new request waits ``ORDINARY_WAIT_S``
at most (a poison that crashes shows at once; beside a hung one, a new request dies as a suspect and is
retried in turn).
Requests already running are never waited for. So a retry is not quite alone: resumed streams flow
beside it, and new requests come after ``ORDINARY_WAIT_S``. A suspect that dies in its turn having
produced nothing (:func:`_in_its_turn`) is named as if alone; one whose death was shared again goes
again (``SHARED_TRIES``); and a request its process never began (:func:`_unheard`: no heartbeat) is
innocent of that death and no suspect at all: it is sent again without taking a try (``MAX_UNHEARD``).

**Why the first attempt at this deadlocked** (2e0de90, reverted in 340df56; the soak's logs were not
kept, so this is read from the code). Its gate chained three waits. (1) A suspect waited for *every*
request running before it to end — a stream of any length, or a request parked behind a drain
(``drain_timeout_s``, 300 s by default) — while every new request of the model waited for the suspect:
the model's whole traffic stopped for as long as the longest of those. (2) A suspect held the gate to
the end of its answer, a whole resumed stream included. (3) A request awaited its process's restart
(``await backend.restart(...)``, after a fatal event or a stall) *inside* its lease and its turn at the
gate; procman answers a restart command only once the backend is settled and not draining
(``Backend._settling``), and a drain (an unload, a stop-first reload, the retiring process of a rolling
change) waits for every lease to end — so a restart naming a process already replaced while its
successor drained waited for the drain, the drain for the request's lease: a true cycle, broken only by
``drain_timeout_s``, with the gate holding the model's other requests behind it. The chaos soak's clients
give up after 60 s, and saw any of these as a deadlock. Now nothing awaits a command while holding a
lease (the restart is queued: procman takes it in before any later request, so the next attempt lands
on the fresh process, and the attempt's own lease waits for readiness); running requests are never
waited for; a suspect gives the lane back when its answer begins, or after a bound; and a new request
waits for the suspects a bounded time. Suspects wait for each other, new requests for the suspects,
neither holding a lease, and every wait ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from starlette.types import Send

from procman import Backend, BackendUnavailable, Lease, StartInterrupted
from procman.deaths import Death, external
from procman.process import exit_words
from router.edge.errors import BadGateway, GatewayTimeout, RouterError, ServiceUnavailable, unavailable
from router.edge.heartbeat import Watch
from router.edge.httpclient import UpstreamError, UpstreamHung, UpstreamTimeout
from router.edge.upstream import Upstream, UpstreamReply
from router.path.blame import suspect, verdict
from router.path.framing import Framing, framing_of, resumed_framing
from router.path.relay import DEATH_GRACE_S, RESPONSE_DROP, Relayed, cut_reason, relay
from router.path.request import ProxyRequest
from router.path.resume import OPENAI_RESUMER, Plan, Resumer, Streamed, StreamLog, fatal_event, finished, plan
from router.path.resume_anthropic import ANTHROPIC_RESUMER
from router.state.lane import Turn
from router.state.registry import Model

__all__ = ["DEATH_GRACE_S", "RequestCrashedModel", "forward"]

log = logging.getLogger(__name__)

_BACKGROUND: set[asyncio.Task[Any]] = set()
#: How long a new request waits while suspects are served: time for a poison request that crashes its
#: process at once to show (then its retry ran alone); a hang takes longer, and new requests go on beside it.
ORDINARY_WAIT_S = 5.0
#: Tries beyond a request's budget for deaths it shared with others (in the chaos mix a clean request can be
#: caught beside a second poison, or beside its own suspect's retry): each runs in the suspect lane.
SHARED_TRIES = 2
#: How many times a request is sent again after deaths of processes that never began on it (no heartbeat).
MAX_UNHEARD = 3
#: How many interrupted starts (an unload during a cold start) a request waits past before it gets the 503.
MAX_INTERRUPTED = 2
#: How a stream of each kind (router.path.resume.plan) is read back, continued and spliced.
RESUMERS: dict[str, Resumer] = {"chat": OPENAI_RESUMER, "completion": OPENAI_RESUMER, "responses": OPENAI_RESUMER,
                               "messages": ANTHROPIC_RESUMER}


#: The requests each process (by its lease's ``exited`` future) has in flight (:func:`_attempt`), for the models
#: whose processes send heartbeats (an attempt with a watch); one that died there stays listed
#: ``PEERS_LINGER_S`` for its peers' count (:func:`_begun_at_death`).
_ON: dict[asyncio.Future[Any], set[Job]] = {}
PEERS_LINGER_S = 30.0


class RequestCrashedModel(BadGateway):
    """This request is the likely cause of its process's death (a poison request)."""

    code = "request_crashed_model"


@dataclass(slots=True, eq=False)
class Job:
    """A client request and what happened to it so far."""

    model: Model
    req: ProxyRequest
    pool: Upstream
    send: Send
    plan: Plan | None
    tries: int = 0  # retries and resumes taken
    interrupted: int = 0  # starts it waited for that an unload interrupted
    unheard: int = 0  # deaths of processes that never began on it (no heartbeat): sent again, no try taken
    suspect: bool = False  # its last death was shared: its next try runs in the suspect lane
    leave_lane: Turn | None = None  # its turn in the suspect lane: gives it back early (a resumed stream flows)
    deaths: list[int] = field(default_factory=list)  # generations of the processes that died under it
    body: bytes = b""
    watch: Watch | None = None  # the current attempt's heartbeat watch (router/edge/heartbeat.py)
    log: StreamLog | None = None
    splice: Streamed | None = None
    head_sent: bool = False
    status: int = 0
    _lines: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.model.spec.name

    @property
    def beaten(self) -> bool:
        """A heartbeat came in this attempt (its watch is armed): the process began on the request."""
        return self.watch is not None and self.watch.armed

    @property
    def framing(self) -> Framing:
        return resumed_framing(self.req.path)

    def budget(self, shared: bool) -> int:
        """Tries a request has: one retry before anything is sent; ``max_resumes`` once a stream runs; and
        ``SHARED_TRIES`` more when its death was shared (a suspect: a poison neighbour's as likely)."""
        if self.head_sent:
            base = self.model.spec.max_resumes if self.plan is not None else 0
        else:
            base = 1 if self.model.spec.retry_on_fatal else 0
        return base + SHARED_TRIES if shared and base else base


async def forward(model: Model, req: ProxyRequest, pool: Upstream, send: Send) -> int:
    """Proxy ``req`` to ``model`` and relay the answer; returns the HTTP status the client got."""
    streamed = not req.retryable
    resumable = plan(req.path, req.body, model.spec.default_max_tokens, model.spec.launches_modelserver) \
        if streamed and model.spec.max_resumes > 0 else None
    job = Job(model, req, pool, send, resumable, body=req.body)
    async with model.limiter:
        while True:
            try:
                async with _lane(job):
                    async with model.backend.request() as lease:
                        result = await _attempt(job, lease)
            except BackendUnavailable as exc:
                if _cut_short(job, exc):
                    continue  # an unload cut short the start it waited for: as a request a moment later, start anew
                if not job.head_sent:
                    raise unavailable(model.spec.name, exc) from None
                return await _end_stream(job, f"model {job.name!r} could not be restarted", "model_unavailable")
            if result is not None:
                return result


def _cut_short(job: Job, exc: BackendUnavailable) -> bool:
    """Whether the request waits for the next start: the one it waited for was interrupted by an unload or a
    stop-first change (not a shutdown), at most ``MAX_INTERRUPTED`` times (the operator may mean it)."""
    if not isinstance(exc, StartInterrupted) or exc.by in ("stop", "shutdown") or job.interrupted >= MAX_INTERRUPTED:
        return False
    job.interrupted += 1
    log.info("%s: a request's wait for a start was cut short (%s); it waits for the next start", job.name, exc.by)
    return True


async def _attempt(job: Job, lease: Lease) -> int | None:
    """One exchange with one process: the status relayed, or None to go again on a fresh process."""
    job.watch = _watch(job)
    if job.watch is None:  # no heartbeats: a death's count is the backend's in-flight count, no peers are read
        return await _exchange(job, lease)
    key = lease.exited  # the process itself (a generation number is only unique within one backend's life)
    _ON.setdefault(key, set()).add(job)
    died = False
    try:
        result = await _exchange(job, lease)
        died = result is None
        return result
    except BaseException:
        died = True
        raise
    finally:
        if died:  # its peers may hear of the death a moment later: it still counts among the begun for them
            asyncio.get_running_loop().call_later(PEERS_LINGER_S, _off, key, job)
        else:
            _off(key, job)


def _off(key: asyncio.Future[Any], job: Job) -> None:
    peers = _ON.get(key)
    if peers is not None:
        peers.discard(job)
        if not peers:
            del _ON[key]


def _begun_at_death(job: Job, lease: Lease, in_flight: int) -> int:
    """How many of the requests in flight in the process of ``lease`` when it died it had begun on (a
    heartbeat came, or the answer): the rest never reached the app, so they cannot have caused it. Those that
    died there count for ``PEERS_LINGER_S`` after (the backend's count drops as each leaves). ``in_flight`` as
    it is where the model's processes send no heartbeats (or this attempt had no watch: its peers are not listed)."""
    if not job.model.heard or job.watch is None:
        return in_flight
    return max(1, sum(1 for peer in _ON.get(lease.exited, ()) if _begun(peer)))


def _begun(job: Job) -> bool:
    return job.head_sent or job.beaten


async def _exchange(job: Job, lease: Lease) -> int | None:
    spec = job.model.spec
    try:
        resp = await job.pool.request(lease.address, job.req.method, spec.path_prefix + job.req.path,
                                      job.req.headers, job.body, spec.request_timeout_s, job.watch)
    except UpstreamHung as exc:  # its heartbeats stopped, or say its generation stands still
        log.warning("%s: %s; killing the process as hung", job.name, exc)
        return await _died(job, lease, exc.cause, str(exc))
    except UpstreamTimeout:
        return await _fail(job, GatewayTimeout(
            f"model {spec.name!r} sent no response within request_timeout_s={spec.request_timeout_s:g}s"))
    except UpstreamError as exc:
        return await _died(job, lease, None, str(exc))
    if job.beaten:
        job.model.heard = True  # this model's processes send heartbeats: silence from one now means something
    try:
        if resp.header(b"x-backend-fatal") == b"1":
            return await _died(job, lease, "fatal", await _detail(resp))
        if job.leave_lane is not None and not job.head_sent:  # it answered: a poison would have taken the
            job.leave_lane()  # process down first (a resumed stream gives the lane back at its first event)
        if job.plan is None:
            return await _relay(job, lease, resp)
        return await _relay_resumable(job, lease, resp)
    finally:
        resp.close()


def _watch(job: Job) -> Watch | None:
    """The heartbeat watch of one attempt (router/edge/heartbeat.py): for the model servers the router launches,
    while health probes are on; silent as long as the probes need to call it hung."""
    spec = job.model.spec
    if not spec.launches_modelserver or spec.health_interval_s <= 0:
        return None
    return Watch.for_probes(spec.health_interval_s, spec.health_timeout_s, spec.health_failures,
                            spec.stall_timeout_s)


async def _relay(job: Job, lease: Lease, resp: UpstreamReply) -> int:
    """The plain path: chunk by chunk; a chat, completion or Messages stream cut short is told what was seen."""
    return await relay(job.model, resp, job.send, lease, framing=framing_of(job.req.path), grace_s=DEATH_GRACE_S)


async def _relay_resumable(job: Job, lease: Lease, resp: UpstreamReply) -> int | None:
    """Relay a stream whole event by whole event, watching for a death, a fatal event or a stall."""
    spec = job.model.spec
    if not job.head_sent:
        if resp.status != 200 or not (resp.header(b"content-type") or b"").startswith(b"text/event-stream"):
            return await _relay(job, lease, resp)
        headers = [(k, v) for k, v in resp.raw_headers if k.decode("latin-1") not in RESPONSE_DROP]
        await job.send({"type": "http.response.start", "status": 200, "headers": headers})
        job.head_sent, job.status, job.log = True, 200, StreamLog(job.framing)
    elif resp.status != 200:  # the continuation was refused: end the stream with its reason
        return await _end_stream(job, f"model {job.name!r} could not continue the answer: {await _detail(resp)}",
                                 "backend_error")
    stall_s = min(spec.stall_timeout_s, spec.stream_idle_timeout_s)
    try:
        async for chunk in resp.iter_chunks(stall_s):
            if fatal_event(chunk):
                cut = chunk.find(job.framing.error_starts)
                await _relay_chunk(job, chunk[:cut] if cut > 0 else b"")
                return await _died(job, lease, "fatal", "a fatal engine error mid-stream")
            await _relay_chunk(job, chunk)
            if job.leave_lane is not None:  # the continuation flows: the next suspect need not wait for its end
                job.leave_lane()
    except UpstreamTimeout:
        if spec.stall_timeout_s >= spec.stream_idle_timeout_s:
            return await _end_stream(job, f"model {job.name!r} sent nothing for stream_idle_timeout_s="
                                     f"{spec.stream_idle_timeout_s:g}s", "backend_error")
        log.warning("%s: a stream got no token for stall_timeout_s=%gs; killing the process as hung",
                    job.name, spec.stall_timeout_s)
        return await _died(job, lease, "stall", f"a stream got no token for stall_timeout_s={spec.stall_timeout_s:g}s")
    except UpstreamError as exc:
        return await _died(job, lease, None, str(exc))
    tail = job.splice.rest() if job.splice is not None else job.log.rest() if job.log is not None else b""
    if not _finished(job, tail):  # closed without [DONE]: a death (resumed), or a cut by a live process
        return await _died(job, lease, None, "the stream ended without [DONE]")
    await job.send({"type": "http.response.body", "body": tail})
    return job.status


def _finished(job: Job, tail: bytes) -> bool:
    assert job.plan is not None  # StreamLog holds the closing [DONE] back until the stream ended cleanly
    return finished(job.plan.kind, tail, job.log.sent if job.log is not None else [])


async def _relay_chunk(job: Job, chunk: bytes) -> None:
    assert job.log is not None
    if job.splice is not None:
        out = job.splice.feed(chunk)
        if out:
            job.log.sent.append(out)
    else:
        out = job.log.cut(chunk)
    if out:
        await job.send({"type": "http.response.body", "body": out, "more_body": True})


async def _died(job: Job, lease: Lease, cause: str | None, detail: str) -> int | None:
    """The process behind ``lease`` failed this request; decide between going again and answering."""
    backend = job.model.backend  # the lease names its process: a replaced one draining is killed as hung too
    in_flight = _begun_at_death(job, lease, backend.in_flight_of(lease.generation))
    local = cause in ("fatal", "stall", "hang")  # the router saw it: it kills the process (a restart)
    if local:
        stopped = cause == "hang" and backend.stopped(lease.generation)  # SIGSTOP: silenced from outside, as
        # kill -9 is; its requests are not to blame (asked before the restart below kills it)
        death = Death(cause, -signal.SIGSTOP if stopped else None, in_flight)  # type: ignore[arg-type]
    else:
        await asyncio.wait({lease.exited}, timeout=DEATH_GRACE_S)
        if not lease.exited.done():
            return await _fail(job, BadGateway(await _alive_words(job, lease)))
        death = _death_of(backend, lease, in_flight)
        if job.model.heard:  # the requests it had begun on: the rest are no suspects
            death = dataclasses.replace(death, in_flight=in_flight)
    job.deaths.append(lease.generation)
    unheard = _unheard(job)  # its process never began on it (no heartbeat): innocent, and no suspect
    if _in_its_turn(job) and not external(death):  # a suspect's retry died before its answer began, while it
        death = dataclasses.replace(death, in_flight=1)  # held the lane: whoever ran beside it came after
    choice = "again" if unheard else verdict(death, second=job.tries > 0, streaming=job.head_sent)
    shared = suspect(death) and not unheard
    # A second death (a suspect's, maybe a neighbour's doing) or the poison's: not the model's failing, so
    # no failure toward the backoff — said with the restart itself, so the count never reaches max_retries
    # before the forgiving comes (procman gives up relaunching the moment it does).
    not_the_models = not unheard and (choice == "blame" or bool(job.tries and not external(death)))
    if local:  # queued now: the next attempt lands on the fresh process; never awaited inside a lease
        why = None if cause == "fatal" else detail  # what it saw, for last_error
        _background(backend.restart("fatal" if cause == "fatal" else "hang", generation=lease.generation, why=why,
                                    blamed=not_the_models))  # (a drain would wait for the lease, the answer for it)
    if not_the_models:
        backend.forgive(job.deaths)
    if unheard and job.unheard < MAX_UNHEARD and _prepare_again(job):
        job.unheard += 1  # never begun: sending it again is as safe as the first time, and takes no try
        job.suspect = False
        log.warning("%s: the process died before it began on a request (%s: %s); sending it to a fresh process",
                    job.name, death.cause, detail)
        return None
    if choice == "again" and job.tries < job.budget(shared) and _prepare_again(job):
        job.tries += 1
        job.suspect = shared
        log.warning("%s: the process died under a request (%s, %s: %s); %s on a fresh process%s", job.name,
                    death.cause, exit_words(death.code), detail,
                    "resuming the stream" if job.head_sent else "retrying once",
                    ", one suspect at a time" if job.suspect else "")
        return None
    if choice == "blame":
        log.warning("%s: the request is the likely cause of its process's death (%s: %s); not sent again",
                    job.name, death.cause, detail)
        return await _fail(job, RequestCrashedModel(_blame_message(job, death)))
    if death.cause == "fatal":
        return await _fail(job, ServiceUnavailable(
            f"model {job.name!r} hit an unrecoverable engine error and is being restarted: {detail}",
            retry_after_s=2.0))
    return await _fail(job, BadGateway(_death_message(job, death)))


@asynccontextmanager
async def _lane(job: Job) -> AsyncIterator[None]:
    """A suspect's turn in the model's suspect lane; an ordinary request first waits for the suspects: a new
    one ``ORDINARY_WAIT_S`` at most, one that a death sent again as long as a suspect may hold the lane (it
    would likely die beside a poison's retry otherwise, as it just did)."""
    lane = job.model.suspects
    if not job.suspect:
        await lane.ordinary(_lane_hold_s(job) if job.tries or job.unheard else ORDINARY_WAIT_S)
        yield
        return
    async with lane.suspect(_lane_hold_s(job)) as leave:
        job.leave_lane = leave
        try:
            yield
        finally:
            job.leave_lane = None


def _in_its_turn(job: Job) -> bool:
    """Whether the request is a suspect's retry that still holds the lane and had produced nothing (its
    heartbeats showed no progress): the one request the process took on since the last death, silent from
    its start — what ran beside it is a stream whose answer flowed, or an ordinary request that waited
    ``ORDINARY_WAIT_S`` for it — so a death now is its doing, as if it were alone. A holder whose generation
    advanced is not judged so (a poison beside a long answer may have done it)."""
    watch = job.watch
    turn = job.leave_lane
    return (job.suspect and turn is not None and turn.held and not job.head_sent and job.model.heard
            and watch is not None and not watch.progress)


def _unheard(job: Job) -> bool:
    """Whether the process died before it began on this request: no heartbeat came, from a model whose
    processes send them (the first one goes before the request's body is read)."""
    if job.watch is None or job.head_sent:
        return False
    if job.beaten:
        job.model.heard = True
        return False
    return job.model.heard


def _lane_hold_s(job: Job) -> float:
    """How long a suspect keeps the lane at most (it gives it back as soon as its answer begins): time for a
    poison request to show — a crash at once, a hang once every probe failed — then the next suspect goes."""
    spec = job.model.spec
    probes = spec.health_failures * (spec.health_interval_s + spec.health_timeout_s) if spec.health_interval_s else 0
    return min(probes + 10.0, 120.0)


def _death_of(backend: Backend, lease: Lease, in_flight: int) -> Death:
    """How the process behind ``lease`` ended, as the backend saw it (or as the lease tells)."""
    known = backend.death(lease.generation)
    if known is not None:
        return known
    code = None
    if lease.exited.done() and not lease.exited.cancelled() and lease.exited.exception() is None:
        code = int(lease.exited.result())
    return Death("crash", code, in_flight)


def _prepare_again(job: Job) -> bool:
    """Set the next attempt's body: the same request, or the continuation of the stream; False when done."""
    if not job.head_sent:
        job.body = job.req.body
        return True
    assert job.plan is not None and job.log is not None
    resumer = RESUMERS[job.plan.kind]
    seen = resumer.progress(job.log)
    if seen.done or seen.finish is not None:
        return False  # the answer was complete: nothing to resume
    rest = resumer.continuation(job.plan, seen)
    if rest is None:
        return False
    job.body = json.dumps(rest).encode()
    job.splice = resumer.splice(seen)
    return True


def _blame_message(job: Job, death: Death) -> str:
    what = {"hang": "hung", "crash": "crashed", "fatal": "failed fatally", "stall": "stalled"}[death.cause]
    again = " again on the retry" if job.tries else " while handling this request and no other"
    return (f"model {job.name!r} {what}{again}; this request is the likely cause and is not retried "
            "(the model was restarted)")


def _death_message(job: Job, death: Death) -> str:
    what = {"hang": "hung", "crash": "died", "fatal": "failed fatally", "stall": "stalled"}[death.cause]
    how = f": its process {exit_words(death.code)}" if death.cause == "crash" and death.code is not None else ""
    return f"model {job.name!r} {what} while handling the request{how}; it is being restarted, retry the request"


async def _alive_words(job: Job, lease: Lease) -> str:
    """The connection broke but the process runs on: say so (a stream: how far it got), restart nothing."""
    if not job.head_sent:
        return f"model {job.name!r} could not be reached; retry the request"
    chunks = sum(event.count(b"data:") for event in job.log.sent) if job.log is not None else 0
    return await cut_reason(job.model, lease, chunks, grace_s=0.0)


async def _fail(job: Job, error: RouterError) -> int:
    """Answer ``error``: as the response when nothing was sent, else as the stream's last event."""
    if not job.head_sent:
        raise error
    return await _end_stream(job, error.message, error.code, error.status)


async def _end_stream(job: Job, message: str, code: str, status: int = 502) -> int:
    await job.send({"type": "http.response.body", "body": job.framing.error(message, code, status), "more_body": True})
    await job.send({"type": "http.response.body", "body": b""})
    raise Relayed(job.status)


async def _detail(resp: UpstreamReply) -> str:
    try:
        body = await resp.read(idle_timeout_s=5.0)
    except UpstreamError:
        return "no detail"
    try:
        return str(json.loads(body)["error"]["message"]).splitlines()[0][:300]
    except (ValueError, KeyError, TypeError, IndexError):
        return body[:300].decode("utf-8", "replace").splitlines()[0] if body else "no detail"


def _background(coro: Any) -> None:
    task = asyncio.ensure_future(coro)
    _BACKGROUND.add(task)  # the loop keeps only a weak reference to a task
    task.add_done_callback(_background_done)


def _background_done(task: asyncio.Task[Any]) -> None:
    _BACKGROUND.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.warning("background restart failed: %s", task.exception())
