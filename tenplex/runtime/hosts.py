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


STORE_COMMAND = (sys.executable, "-m", "tenplex.cli.store")  # the store-only CLI module: what store hosts run


def spawn_store(root: str | os.PathLike, host: str, port_file: Path, *args: str, stdout=subprocess.DEVNULL,
                env: dict[str, str] | None = None, command: tuple[str, ...] = STORE_COMMAND,
                detached: bool = False) -> subprocess.Popen:
    """Start ``tenplex store serve`` for ``host`` on a free port (``--port 0``), reporting it in ``port_file``.

    ``args`` go to ``serve`` after the defaults (``--bind``, ``--token-file``, …);
    :func:`await_store` waits until it serves. Start several, then wait for them:
    they come up in parallel. ``detached`` starts it in a session of its own, so
    that it outlives its starter's process group (``tenplex run``: a node's
    store keeps serving its shards after the node's agent left). The store gets
    ``OPENBLAS_NUM_THREADS=1`` unless ``env`` (or, without it, this environment) sets it.
    """
    port_file.unlink(missing_ok=True)
    env = dict(os.environ if env is None else env)
    # a store does no linear algebra: without this, OpenBLAS's threads spin for a while after numpy loads
    # (about 0.1 s of CPU per start, measured, taken from the job on a busy host)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return subprocess.Popen([*command, "serve", "--root", str(root), "--host", host, "--port", "0",
                             "--port-file", str(port_file), *args], stdout=stdout, stderr=subprocess.STDOUT, env=env,
                            stdin=subprocess.DEVNULL if detached else None, start_new_session=detached)


def await_store(proc: subprocess.Popen, host: str, port_file: Path, deadline: float,
                log: Path | None = None) -> str:
    """The loopback address of a store started by :func:`spawn_store`, once its port file is written.

    Raises HostError, with the end of ``log``, when the process exits or
    ``deadline`` (``time.monotonic()``) passes; the process is then killed.
    """
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            why = f"exited with {proc.returncode}" if proc.poll() is not None else "did not start in time"
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            tail = log.read_text(errors="replace")[-2000:] if log is not None and log.exists() else ""
            raise HostError(f"store process of host {host} {why}: {tail}")
        time.sleep(0.05)
    return f"127.0.0.1:{int(port_file.read_text())}"


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
            with open(log, "ab") as out:
                self._procs[host] = spawn_store(self.root(host), host, port_file, stdout=out)
            pending.append((host, port_file, log))
        deadline = time.monotonic() + self.start_timeout
        for host, port_file, log in pending:
            self.addresses[host] = await_store(self._procs[host], host, port_file, deadline, log)

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
