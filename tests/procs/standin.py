"""A tiny stand-in backend for procman's real-process tests (stdlib only).

    python standin.py (--port N [--host H] | --uds PATH) [--load-s S] [--ignore-term]
                      [--fail-if-exists FILE] [--grandchild]

GET /health: 503 for --load-s seconds, then 200. GET /pid: the pid. POST /crash: exit(3)
at once. POST /hang: the whole process stops (SIGSTOP), /health included; only SIGKILL
ends it. --fail-if-exists: exit 4 at start while FILE exists (a crash loop whose cause a
test removes). --ignore-term: SIGTERM is ignored. --grandchild: start a sleeping child in
the same process group and print its pid (a stop must kill the whole group).
"""

from __future__ import annotations

import argparse
import http.server
import os
import signal
import socketserver
import subprocess
import sys
import time
from pathlib import Path


class Handler(http.server.BaseHTTPRequestHandler):
    ready_at = 0.0

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path == "/health":
            self._send(200 if time.monotonic() >= self.ready_at else 503, b"ok")
        elif self.path == "/pid":
            self._send(200, str(os.getpid()).encode())
        else:
            self._send(404, b"no such path")

    def do_POST(self) -> None:  # noqa: N802
        if self.path == "/crash":
            print("crashing on request", flush=True)
            os._exit(3)
        elif self.path == "/hang":
            print("hanging on request", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            self._send(404, b"no such path")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def address_string(self) -> str:
        return "local"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        print("request:", format % args, flush=True)


class UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class TCPServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def main() -> None:
    parser = argparse.ArgumentParser()
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--port", type=int)
    where.add_argument("--uds")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--load-s", type=float, default=0.0)
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--fail-if-exists")
    parser.add_argument("--grandchild", action="store_true")
    args = parser.parse_args()
    print(f"standin pid={os.getpid()} starting", flush=True)
    if args.fail_if_exists and Path(args.fail_if_exists).exists():
        print(f"cannot start: {args.fail_if_exists} exists", flush=True)
        sys.exit(4)
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ignoring SIGTERM", flush=True)
    if args.grandchild:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(f"grandchild pid={child.pid}", flush=True)
    Handler.ready_at = time.monotonic() + args.load_s
    if args.uds:
        server: socketserver.BaseServer = UnixServer(args.uds, Handler)
    else:
        server = TCPServer((args.host, args.port), Handler)
    print("listening", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
