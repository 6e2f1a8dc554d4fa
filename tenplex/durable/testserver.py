"""moto's S3 server in a process of its own on loopback: the bucket of the durable tier's tests and of
``tenplex demo --elastic``'s ``evict:all`` event. Nothing here is for production.

May import: ``tenplex.errors``, ``tenplex.ports`` and the standard library (moto is started as
``python -m moto.server``, never imported here).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

from ..errors import TenplexError
from ..ports import free_port


class S3ServerError(TenplexError, RuntimeError):
    """moto's server did not start (its log says why)."""


def start_s3_server(env: dict[str, str] | None = None, log=subprocess.DEVNULL,
                    timeout: float = 60.0) -> tuple[subprocess.Popen, str]:
    """Start moto's S3 server on a free loopback port (``env``: extra environment, e.g. moto's
    ``INITIAL_NO_AUTH_ACTION_COUNT``); return the process and its endpoint once it accepts connections."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while not _accepts(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise S3ServerError(f"moto's S3 server did not start on port {port} (exit code {proc.returncode})")
        time.sleep(0.2)
    return proc, f"http://127.0.0.1:{port}"


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def create_bucket(endpoint: str, name: str) -> None:
    """Create bucket ``name`` on a server that checks no signatures (moto's default): one plain PUT."""
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{name}", method="PUT"), timeout=30).close()


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
