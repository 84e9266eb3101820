"""``python -m modelserver --spare``: a model server past its imports, waiting for its assignment.

The router's process manager keeps one ahead of need (``router.spare_interpreters``,
:mod:`procman.spare`), so that a cold start pays the model's own load and not the
interpreter's start and imports. A spare imports what every start imports (the server's
modules, uvicorn with uvloop and httptools) and what the engines it may become import
(``--warm ENGINE:TASK,...``, the pairs of the models the router's config holds; without it,
``openvino:llm``): each one's engine module (openvino and openvino_genai for the OpenVINO
engines) and the modules its load imports later (:data:`LOAD_IMPORTS`). Then it prints
:data:`SPARE_READY` and blocks reading one line on stdin: a JSON object
``{"argv": [...], "env": {...}, "cwd": "..."}``, the command line, environment and folder
a fresh ``python -m modelserver`` would have been started with. It takes them (the whole
environment replaced, the folder changed, stdin pointed at ``/dev/null``) and runs exactly
what ``python -m modelserver`` runs; its start marks begin at the assignment, and ``ps`` shows
that command line from then on (``setproctitle``).

End of input (the router stopped, retired the spare, or died) exits 0 at once; so does a
line that is not an assignment for ``python -m modelserver`` (status 2, with the reason).
"""

from __future__ import annotations

import importlib
import json
import os
import shlex
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import setproctitle

from modelserver import startup

__all__ = ["DEFAULT_WARM", "LOAD_IMPORTS", "SPARE_FLAG", "SPARE_READY", "WARM_FLAG", "main", "parse_warm",
           "warm_imports", "warm_modules"]

#: ``python -m modelserver --spare`` (``procman.spare`` and ``router.state.launch`` spell the same flag).
SPARE_FLAG = "--spare"
#: ``--warm openvino:llm,openvino:embeddings``: the (engine, task) pairs a spare may become (``router.state.launch``).
WARM_FLAG = "--warm"
#: What a spare warms when told nothing.
DEFAULT_WARM = ("openvino:llm",)
#: Modules an engine's load imports by itself, after its module (measured on a spare: ``-X importtime`` of a load):
#: every OpenVINO pipeline's construction imports openvino_tokenizers (20-35 ms, with the GIL held), and the
#: embeddings and rerank engines count tokens with the ``tokenizers`` library (12-16 ms).
LOAD_IMPORTS: dict[tuple[str, str], tuple[str, ...]] = {
    ("openvino", "llm"): ("openvino_tokenizers",),
    ("openvino", "embeddings"): ("openvino_tokenizers", "tokenizers"),
    ("openvino", "rerank"): ("openvino_tokenizers", "tokenizers"),
    ("openvino", "transcription"): ("openvino_tokenizers",),
    ("openvino", "speech"): ("openvino_tokenizers",),
    ("openvino", "vlm"): ("openvino_tokenizers",),
}
#: The line a spare prints once its imports are done (``procman.spare.SPARE_READY``, the same text).
SPARE_READY = "ovrouter-spare-ready"
#: ``argv[1:3]`` of every command a spare can become.
MODULE_ARGS = ["-m", "modelserver"]


def warm_modules(pairs: Iterable[str]) -> list[str]:
    """The modules to import ahead for ``engine:task`` pairs, in order, each once; unknown pairs name none."""
    from modelserver.engines import ENGINES

    found: list[str] = []
    for pair in pairs:
        engine, _, task = pair.partition(":")
        target = ENGINES.get((engine, task))
        if target is None:
            sys.stderr.write(f"modelserver --spare: no engine {engine!r} for task {task!r}; nothing warmed for it\n")
            continue
        for module in (target.partition(":")[0], *LOAD_IMPORTS.get((engine, task), ())):
            if module not in found:
                found.append(module)
    return found


def warm_imports(pairs: Sequence[str] = DEFAULT_WARM) -> None:
    """What a start imports before its engine builds anything: the server's modules, then the engine modules of
    ``pairs`` (the OpenVINO ones import openvino and openvino_genai: the bulk of a start's imports) and what
    their loads import later. A module that cannot be imported is left to the start itself (its error is the
    start's to report)."""
    import uvicorn.lifespan.on  # noqa: F401 - what uvicorn.Config(lifespan="on", http=JsonErrorsProtocol, loop="uvloop") loads
    import uvicorn.loops.uvloop  # noqa: F401
    import uvicorn.protocols.http.httptools_impl  # noqa: F401

    import modelserver.app  # noqa: F401
    import modelserver.cli  # noqa: F401
    import modelserver.httpproto  # noqa: F401

    for module in warm_modules(pairs):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            sys.stderr.write(f"modelserver --spare: cannot import {module} ahead ({exc})\n")


def parse_warm(argv: Sequence[str]) -> tuple[str, ...]:
    """The pairs of ``--warm A,B`` in ``argv`` (what follows ``--spare``); :data:`DEFAULT_WARM` without it."""
    if len(argv) == 2 and argv[0] == WARM_FLAG:
        return tuple(pair for pair in argv[1].split(",") if pair)
    if argv:
        raise ValueError(f"expected nothing or {WARM_FLAG} ENGINE:TASK,... after {SPARE_FLAG}, got {list(argv)}")
    return DEFAULT_WARM


def _assignment(line: bytes) -> tuple[list[str], dict[str, str], str | None]:
    data: Any = json.loads(line)
    argv, env, cwd = data.get("argv"), data.get("env"), data.get("cwd")
    if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv) and argv[1:3] == MODULE_ARGS):
        raise ValueError(f"argv: expected [python, -m, modelserver, ...], got {argv!r}")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise ValueError("env: expected an object of strings")
    if cwd is not None and not isinstance(cwd, str):
        raise ValueError(f"cwd: expected a string or null, got {cwd!r}")
    return argv, env, cwd


def _take(argv: list[str], env: dict[str, str], cwd: str | None) -> None:
    # ps, top and pgrep -f show the model's own command line, not "--spare --warm ...": the process is that model's
    # now. Before the environment is replaced: setproctitle finds the process's argv through the environment's.
    setproctitle.setproctitle(shlex.join(argv))
    if cwd is not None:
        os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # as a fresh start has it; the router's end of the pipe is closed next
    os.close(devnull)
    sys.argv = [sys.argv[0], *argv[3:]]


def main(argv: Sequence[str] = ()) -> int:
    """Run a spare; ``argv`` is what follows ``--spare`` on the command line."""
    try:
        pairs = parse_warm(argv)
    except ValueError as exc:
        sys.stderr.write(f"modelserver --spare: {exc}\n")
        return 2
    warm_imports(pairs)
    sys.stdout.write(SPARE_READY + "\n")
    sys.stdout.flush()
    line = sys.stdin.buffer.readline()
    if not line.strip():
        return 0  # retired, or the router is gone
    try:
        argv, env, cwd = _assignment(line)
    except ValueError as exc:
        sys.stderr.write(f"modelserver --spare: not an assignment: {exc}\n")
        return 2
    _take(argv, env, cwd)
    startup.restart()  # the start marks of a fresh process, from now
    startup.fault_log()
    from modelserver.cli import main as serve

    return serve(argv[3:])
