"""nginx as the near-zero-overhead reference proxy: a generated config, on loopback, in a temp dir."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

from bench.procs import Procs, free_port, wait_http

__all__ = ["render_config", "start_nginx"]

log = logging.getLogger(__name__)

CONFIG = """\
{user}master_process off;
daemon off;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    upstream backend {{
        server {backend};
        keepalive 256;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def render_config(prefix: Path, port: int, backend: str) -> str:
    """One process (like the single router process), keep-alive upstream, unbuffered (for SSE).

    ``master_process off`` keeps nginx to the one process we spawned, so the bench's
    PR_SET_PDEATHSIG reaches it: a killed bench cannot leave an orphaned worker behind.
    """
    user = "user root;\n" if os.geteuid() == 0 else ""  # workers must read the temp dirs we own
    return CONFIG.format(user=user, prefix=prefix, port=port, backend=backend)


def start_nginx(procs: Procs, nginx: str, prefix: Path, backend: str) -> tuple[subprocess.Popen[bytes], int]:
    """nginx proxying 127.0.0.1:<free port> to ``backend`` (host:port); (process, port)."""
    prefix.mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = prefix / "nginx.conf"
    conf.write_text(render_config(prefix, port, backend))
    proc = procs.spawn("nginx", [nginx, "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(conf)])
    wait_http(f"http://127.0.0.1:{port}/health", proc, timeout_s=10)
    return proc, port
