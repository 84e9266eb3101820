"""``python -m modelserver --spare``: a model server past its imports, waiting for its assignment.

The router's process manager keeps one ahead of need (``router.spare_interpreters``,
:mod:`procman.spare`), so that a cold start pays the model's own load and not the
interpreter's start and imports. A spare imports what every start imports (the server's
modules, uvicorn with uvloop and httptools, openvino and openvino_genai through the llm
engine), prints :data:`SPARE_READY`, then blocks reading one line on stdin: a JSON object
``{"argv": [...], "env": {...}, "cwd": "..."}``, the command line, environment and folder
a fresh ``python -m modelserver`` would have been started with. It takes them (the whole
environment replaced, the folder changed, stdin pointed at ``/dev/null``) and runs exactly
what ``python -m modelserver`` runs; its start marks begin at the assignment.

End of input (the router stopped, retired the spare, or died) exits 0 at once; so does a
line that is not an assignment for ``python -m modelserver`` (status 2, with the reason).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from modelserver import startup

__all__ = ["SPARE_FLAG", "SPARE_READY", "main", "warm_imports"]

#: ``python -m modelserver --spare`` (``procman.spare`` and ``router.state.launch`` spell the same flag).
SPARE_FLAG = "--spare"
#: The line a spare prints once its imports are done (``procman.spare.SPARE_READY``, the same text).
SPARE_READY = "ovrouter-spare-ready"
#: ``argv[1:3]`` of every command a spare can become.
MODULE_ARGS = ["-m", "modelserver"]


def warm_imports() -> None:
    """What a start of any model imports before its engine builds anything (the llm engine's OpenVINO
    included: openvino_genai is the bulk of a start's imports)."""
    import uvicorn.lifespan.on  # noqa: F401 - what uvicorn.Config(lifespan="on", http="httptools", loop="uvloop") loads
    import uvicorn.loops.uvloop  # noqa: F401
    import uvicorn.protocols.http.httptools_impl  # noqa: F401

    import modelserver.app  # noqa: F401
    import modelserver.cli  # noqa: F401
    import modelserver.engines.llm  # noqa: F401 - openvino, openvino_genai


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
    if cwd is not None:
        os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # as a fresh start has it; the router's end of the pipe is closed next
    os.close(devnull)
    sys.argv = [sys.argv[0], *argv[3:]]


def main() -> int:
    warm_imports()
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
