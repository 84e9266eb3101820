"""Kills every model's process group when the router dies, however it dies (``kill -9`` included).

``PR_SET_PDEATHSIG`` reaches only a direct child: the grandchildren of a shell-wrapped
``command:`` (``sh -c "server & wait"``, a launcher script) would outlive a killed router.
So while any model process runs, the router keeps one small process beside it (this
file, run as a script with no imports beyond the standard library): the router writes
``+PGID`` when it spawns a model and ``-PGID`` once that group is gone, on the watchdog's
stdin; when that pipe reaches end-of-file — the router closed it or the kernel did, because
the router died — the watchdog SIGKILLs every group still registered, then exits.

The watchdog runs in a session of its own (a Ctrl-C or a group kill meant for the router
or a model never reaches it) and the router closes the pipe as soon as no group is
registered, so an idle router keeps no watchdog. A process that leaves its group
(``setsid``, a double-forking daemon) is beyond its reach.
"""

from __future__ import annotations

import os
import signal
import sys


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # only the end of the pipe ends the watch
    groups: set[int] = set()
    for line in sys.stdin.buffer:
        sign, _, number = line.strip().decode("ascii", "replace").partition(" ")
        if number.isdigit() and sign in "+-":
            (groups.add if sign == "+" else groups.discard)(int(number))
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass  # gone already


if __name__ == "__main__":
    main()
