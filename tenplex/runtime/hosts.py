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

from ..errors import TenplexError


class HostError(TenplexError, RuntimeError):
    """A store process did not start (the message holds the end of its log)."""


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
            port_file.unlink(missing_ok=True)
            with open(log, "ab") as out:
                self._procs[host] = subprocess.Popen(
                    [sys.executable, "-m", "tenplex.cli.store", "serve", "--root", str(self.root(host)),
                     "--host", host, "--port", "0", "--port-file", str(port_file)],
                    stdout=out, stderr=subprocess.STDOUT)
            pending.append((host, port_file, log))
        deadline = time.monotonic() + self.start_timeout
        for host, port_file, log in pending:
            proc = self._procs[host]
            while not (port_file.exists() and port_file.read_text().strip()):
                if proc.poll() is not None or time.monotonic() > deadline:
                    why = f"exited with {proc.returncode}" if proc.poll() is not None else \
                        f"did not start within {self.start_timeout:.0f} s"
                    raise HostError(f"store process of host {host} {why}: {log.read_text()[-2000:]}")
                time.sleep(0.05)
            self.addresses[host] = f"127.0.0.1:{int(port_file.read_text())}"

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
