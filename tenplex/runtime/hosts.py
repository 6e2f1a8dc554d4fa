"""Simulated hosts: one ``tenplex store serve`` process per host, each on a free loopback port.

May import: the standard library and ``tenplex.errors`` (the store runs in its own process).

Every host gets its own store directory ``BASE/HOST``; the server reports the
port it bound (``--port 0``) through a port file, so no two runs race for a port.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from ..errors import TenplexError


class HostError(TenplexError, RuntimeError):
    """A store process did not start (the message holds the end of its log)."""


def start_store(root: Path, host: str, port_file: Path, log: Path, extra_args: Sequence[str] = (),
                detached: bool = False) -> subprocess.Popen:
    """Start ``tenplex store serve`` for ``root`` on a free port (reported in ``port_file``), logging to ``log``.

    ``detached`` starts it in a session of its own, so that it outlives the
    process group of its starter (``tenplex run``: a node's store keeps serving
    its shards after the node's agent left).
    """
    port_file.unlink(missing_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "tenplex.cli.store", "serve", "--root", str(root), "--host", host,
                                 "--port", "0", "--port-file", str(port_file), *extra_args],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=detached)


def wait_for_port(proc: subprocess.Popen, what: str, port_file: Path, log: Path, deadline: float) -> int:
    """The port ``proc`` wrote to ``port_file``; HostError with the end of ``log`` if it exits or ``deadline`` passes."""
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            why = f"exited with {proc.returncode}" if proc.poll() is not None else "did not start in time"
            raise HostError(f"{what} {why}: {log.read_text()[-2000:] if log.exists() else ''}")
        time.sleep(0.05)
    return int(port_file.read_text())


class Hosts:
    """Store processes of the simulated hosts under ``base``; use as a context manager."""

    def __init__(self, base: str | os.PathLike, start_timeout: float = 120.0):
        self.base = Path(base)
        self.start_timeout = start_timeout
        self._procs: dict[str, subprocess.Popen] = {}
        self.addresses: dict[str, str] = {}

    def root(self, host: str) -> Path:
        return self.base / host

    def start(self, *hosts: str) -> None:
        """Start the store of each host not yet running; returns once all of them serve."""
        pending = []
        for host in hosts:
            if host in self._procs:
                continue
            self.root(host).mkdir(parents=True, exist_ok=True)
            port_file, log = self.base / f".{host}.port", self.base / f".{host}.log"
            self._procs[host] = start_store(self.root(host), host, port_file, log)
            pending.append((host, port_file, log))
        deadline = time.monotonic() + self.start_timeout
        for host, port_file, log in pending:
            port = wait_for_port(self._procs[host], f"store process of host {host}", port_file, log, deadline)
            self.addresses[host] = f"127.0.0.1:{port}"

    def stop(self) -> None:
        """Terminate every store process (SIGKILL after 10 s)."""
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
