"""What the in-place end-to-end tests share: a real rendezvous store served from a thread, simulated nodes of
`tenplex run --in-place` (each in its own process group, as a node's processes are), waiting on a worker's JSON
lines (never a fixed sleep), and the teardown (SIGKILL whatever still runs, stop the server and the stores)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tenplex.elastic import rendezvous
from tenplex.elastic.launcher import stop_store


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(path: Path, predicate, procs, timeout: float = 240) -> dict:
    """The first JSON line of ``path`` that ``predicate`` accepts; fails at once when one of ``procs`` ended."""
    deadline = time.monotonic() + timeout
    while True:
        hit = next((d for d in lines(path) if predicate(d)), None)
        if hit is not None:
            return hit
        assert time.monotonic() < deadline, f"timed out waiting in {path}: {lines(path)[-3:]}"
        assert all(p.poll() is None for p in procs), [p.poll() for p in procs]
        time.sleep(0.05)


class RendezvousThread:
    """The job's rendezvous store, served from a thread of the test process on a free loopback port."""

    def __init__(self):
        self._stop, ports = threading.Event(), []
        server = threading.Thread(target=rendezvous.serve, kwargs={"stop": self._stop, "ready": ports.append},
                                  daemon=True)
        server.start()
        while not ports:
            server.join(0.05)
        self.endpoint = f"127.0.0.1:{ports[0]}"

    def stop(self) -> None:
        self._stop.set()


class InPlaceNodes(RendezvousThread):
    """Nodes of one job (``tenplex run --in-place``, one worker each, ``--nnodes 2``) whose stores live under
    ``tmp_path/HOST``; each node's output goes to ``tmp_path/OUT.log``."""

    def __init__(self, tmp_path: Path, job: str, worker: Path):
        super().__init__()
        self.tmp_path, self.job, self.worker = tmp_path, job, worker
        # a busy machine can starve a heartbeat for a second or two: a dead node is noticed after 5 s still here
        self.env = dict(os.environ, OMP_NUM_THREADS="1", TENPLEX_DEAD_AFTER="5")
        self.procs: list[subprocess.Popen] = []

    def node(self, host: str, out: Path, *options: str, nnodes: int = 2, per_node: int = 1) -> subprocess.Popen:
        """Start node ``host`` of ``per_node`` workers, which write under ``out`` (created), in a job of at least
        ``nnodes`` nodes; ``options`` go to ``tenplex run``."""
        out.mkdir()
        log = open(self.log(out), "wb")
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", "tenplex.cli", "run", "--in-place", "--host", host, "--store-root",
             str(self.tmp_path / host), "--nnodes", str(nnodes), "--nproc-per-node", str(per_node), *options,
             "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.job, str(self.worker), str(out)],
            env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))  # a node: its own group
        return self.procs[-1]

    def log(self, out: Path) -> Path:
        return self.tmp_path / f"{out.name}.log"

    def tail(self, out: Path) -> str:
        return self.log(out).read_text()[-3000:]

    def close(self, hosts: tuple[str, ...] = ("h0", "h1")) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        self.stop()
        for host in hosts:
            stop_store(self.tmp_path / host)
