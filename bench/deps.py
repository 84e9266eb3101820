"""Find (and, when allowed, install) the external load tools: ``wrk`` and ``nginx``.

``python -m bench.deps --install`` is the ``make bench-deps`` step: it runs
``apt-get update`` and ``apt-get install -y wrk nginx-light`` for what is missing, as
root only, and never fails the build — the bench falls back to its own asyncio load
generator and skips the nginx reference, saying so in the report. The smoke test never
calls this.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Tools", "detect", "install_missing", "main"]

log = logging.getLogger(__name__)

PACKAGES = {"wrk": "wrk", "nginx": "nginx-light"}
NGINX_CANDIDATES = ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx")
POLICY_RC = Path("/usr/sbin/policy-rc.d")


@dataclass(frozen=True, slots=True)
class Tools:
    """Paths of the external tools found on this machine (None when absent)."""

    wrk: str | None
    nginx: str | None


def _which(name: str) -> str | None:
    found = shutil.which(name)
    if found or name != "nginx":
        return found
    return next((c for c in NGINX_CANDIDATES if os.access(c, os.X_OK)), None)


def detect() -> Tools:
    return Tools(wrk=_which("wrk"), nginx=_which("nginx"))


def _apt(*args: str) -> bool:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        done = subprocess.run(["apt-get", *args], env=env, capture_output=True, text=True, timeout=600, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("apt-get %s failed: %s", " ".join(args), exc)
        return False
    if done.returncode != 0:
        log.warning("apt-get %s exited %d: %s", " ".join(args), done.returncode, done.stderr.strip()[-400:])
    return done.returncode == 0


def install_missing() -> Tools:
    """apt-get install what is missing; never starts the nginx system service."""
    tools = detect()
    missing = [PACKAGES[name] for name in PACKAGES if getattr(tools, name) is None]
    if not missing:
        return tools
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        log.warning("cannot install %s (needs root and apt-get)", " ".join(missing))
        return tools
    own_policy = not POLICY_RC.exists()
    if own_policy:  # keep the package's post-install from starting a system nginx on port 80
        POLICY_RC.write_text("#!/bin/sh\nexit 101\n")
        POLICY_RC.chmod(0o755)
    try:
        if _apt("update", "-q"):
            _apt("install", "-y", "-q", "--no-install-recommends", *missing)
    finally:
        if own_policy:
            POLICY_RC.unlink(missing_ok=True)
    return detect()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.deps", description=__doc__.splitlines()[0])
    parser.add_argument("--install", action="store_true", help="apt-get install wrk and nginx-light when missing")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    tools = install_missing() if args.install else detect()
    print(f"wrk:   {tools.wrk or 'missing -> the asyncio load generator is used'}")
    print(f"nginx: {tools.nginx or 'missing -> the nginx reference is skipped'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
