"""The modes of ``tenplex bench goodput``: how each one runs the job on emulated nodes and suffers each event.

May import: ``tenplex.elastic.nodes`` (tenplex's agents), ``tenplex.ports``, ``tenplex.runtime.hosts`` (a store's
port file), ``tenplex.bench.goodput_trace`` and the standard library. No torch here: the training runs in the workers
(:mod:`tenplex.bench.goodput_worker`).

Each mode is one entry of :data:`MODES`: a class with ``LINGER_S`` (how long its processes may take to end after
the last step), ``start(host)``, ``leave(host)``, ``fail(host)``,
``gpufail(host, device)``, ``running()`` and ``close()``, and its configuration in words (``SETTINGS``: what
was set and why, the fairness record). A mode that does not exist yet is an entry with its reason. Every node
has :data:`~tenplex.bench.goodput_trace.DEVICES` workers; a node's processes die with it (a SIGKILL of its
process group; the workers ask the kernel to die with their agent). A GPU fault is the file
``FAULTS/HOST-DEVICE``: the worker on it raises the CUDA error of a failed device at its next step.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..elastic.nodes import Nodes
from ..ports import free_port
from ..runtime.hosts import await_store
from .goodput_trace import DEVICES

WORKER = Path(__file__).resolve().parent / "goodput_worker.py"
# torchrun elastic on loopback (ARCHITECTURE.md): a rendezvous store no agent owns, notice of a lost agent in
# about 3 s, a round that closes 2 s after the last node arrives (the defaults: 30 s; tenplex run sets the same),
# and no shared TCP store between the rendezvous and the workers (pytorch issue 135712).
RDZV_CONF = "is_host=false,keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=2"
TORCHFT_TIMEOUT_S = 5.0   # torchft's CPU example (train_ddp.py: ProcessGroupGloo(timeout=5 s))


class Unavailable:
    """A mode that cannot run here yet: its row says why."""

    def __init__(self, reason: str):
        self.reason = reason


class _Processes:
    """Processes in sessions of their own, by node: signals and kills, and whether any still runs."""

    def __init__(self, base: Path, env: dict[str, str]):
        self.base, self.env = base, env
        self.procs: dict[str, list[subprocess.Popen]] = {}

    def spawn(self, host: str, argv: list[str], env: dict[str, str], name: str) -> None:
        with open(self.base / f"{name}.log", "ab") as out:
            p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=dict(self.env, **env), start_new_session=True)
        self.procs.setdefault(host, []).append(p)

    def signal(self, host: str, sig: int) -> None:
        for p in self.procs.get(host, []):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    def kill(self, host: str) -> None:
        self.signal(host, signal.SIGKILL)
        for p in self.procs.get(host, []):
            p.wait()

    def running(self) -> list[str]:
        return [h for h, ps in self.procs.items() if any(p.poll() is None for p in ps)]

    def close(self) -> None:
        for host in list(self.procs):
            self.kill(host)


class TenplexRestart:
    """tenplex in its restart mode: ``tenplex run`` per node, ``tenplex.elastic.Job`` in the workers."""

    LINGER_S = 60.0  # the final save and the agents' exit

    SETTINGS = {
        "launcher": "tenplex run per node (torchrun's elastic agent inside), tenplex rendezvous serve",
        "saves": "Job's default: snapshots at the interval whose cost fits 5% of a step (staged in host memory, "
                 "committed and copied to another host in the background)",
        "leave": "SIGTERM: the ranks agree at the next step boundary, save, and the others go on without it",
        "gpu fault": "the worker exits with a device fault; its agent excludes the device and rejoins",
        "restore": "the newest version the survivors can assemble, from their stores and the copies",
    }

    RUN_OPTIONS: tuple[str, ...] = ()

    def __init__(self, base: Path, script: list[str], env: dict[str, str], max_nodes: int):
        self.nodes = Nodes(base, DEVICES, max_nodes, script, env, run_options=self.RUN_OPTIONS)
        self.nodes.start_rendezvous()

    def start(self, host: str) -> None:
        self.nodes.start(host)

    def leave(self, host: str) -> None:
        self.nodes.leave(host)

    def fail(self, host: str) -> None:
        self.nodes.fail(host)

    def gpufail(self, host: str, device: str) -> None:
        pass  # the worker raises by itself (the FAULTS file)

    def running(self) -> list[str]:
        return self.nodes.running()

    def close(self) -> None:
        self.nodes.close()


class TenplexInPlace(TenplexRestart):
    """tenplex in place: ``tenplex run --in-place`` per node; the workers' loop form lives through every change."""

    RUN_OPTIONS = ("--in-place",)
    SETTINGS = dict(
        TenplexRestart.SETTINGS,
        launcher="tenplex run --in-place per node (each node's own supervisor starts its workers: no torchrun, no "
                 "torch in the launcher), tenplex rendezvous serve (the worlds form on it); the same worker, its loop "
                 "form (for world in job.worlds(): with world: ...); TENPLEX_DEAD_AFTER default (2 s)",
        leave="SIGTERM: the ranks agree at the next step boundary, save, the leaver exits and the others form the "
              "next world in their processes",
        lost="the survivors see the peer's error in the collective (or its heartbeat stop for 2 s), form the "
             "next world in their processes and restore the newest committed snapshot",
        restore="the newest version: a survivor whose model still holds it keeps it (memory), the others read it "
                "from this host's store first",
        **{"gpu fault": "the worker exits with a device fault; its node's supervisor excludes the device, the "
                        "node's other worker goes on in the next world"},
    )


class _OnProcesses:
    """A mode whose nodes are ``_Processes`` beside one server process (a rendezvous store, a lighthouse): a
    leave is a SIGTERM to the node's processes, a failure a SIGKILL."""

    procs: _Processes
    server: subprocess.Popen

    def leave(self, host: str) -> None:
        self.procs.signal(host, signal.SIGTERM)

    def fail(self, host: str) -> None:
        self.procs.kill(host)

    def running(self) -> list[str]:
        return self.procs.running()

    def close(self) -> None:
        self.procs.close()
        if self.server.poll() is None:
            self.server.terminate()
        self.server.wait()


class TorchrunDcp(_OnProcesses):
    """torchrun's elastic agent per node, DCP checkpoints on shared storage (see :mod:`.goodput_peers`)."""

    LINGER_S = 60.0

    SETTINGS = {
        "launcher": f"torchrun --nnodes 1:N --rdzv-backend c10d --rdzv-conf {RDZV_CONF} --max-restarts 100 "
                    f"with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and the store in a process of its own (tenplex "
                    f"rendezvous serve: a plain TCPStore), the settings that make torchrun elastic work on one "
                    f"machine (ARCHITECTURE.md); max-restarts high because membership changes count against it",
        "saves": "dcp.async_save every N steps with its own gloo group, N set by the first save's blocking "
                 "time for a 5% overhead; the previous save awaited before the next",
        "leave": "SIGTERM to the agent (it stops its workers); no save at the notice: a DCP save is collective "
                 "and the other ranks are not told",
        "gpu fault": "the node's agent is replaced by one with the working GPUs (what a scheduler's health "
                     "check does: torchrun restarts workers on the same GPUs)",
        "restore": "every worker restarts and loads the newest complete checkpoint (DDP: every rank reads it all)",
    }

    def __init__(self, base: Path, script: list[str], env: dict[str, str], max_nodes: int):
        self.base, self.script, self.max_nodes = base, script, max_nodes
        self.procs = _Processes(base, dict(env, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))
        self.devices: dict[str, list[str]] = {}
        port_file, log = base / "rendezvous.port", base / "rendezvous.log"
        with open(log, "ab") as out:
            self.server = subprocess.Popen([sys.executable, "-m", "tenplex.cli", "rendezvous", "serve", "--port", "0",
                                           "--port-file", str(port_file)], stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        self.endpoint = await_store(self.server, "rendezvous", port_file, time.monotonic() + 120, log)

    def start(self, host: str, devices: list[str] | None = None) -> None:
        self.devices[host] = devices or [str(d) for d in range(DEVICES)]
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", f"1:{self.max_nodes}",
                "--nproc-per-node", str(len(self.devices[host])), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", self.endpoint, "--rdzv-id", "goodput", "--rdzv-conf", RDZV_CONF,
                "--max-restarts", "100", "--monitor-interval", "0.5", *self.script]
        self.procs.spawn(host, argv, {"GOODPUT_HOST": host, "GOODPUT_DEVICES": ",".join(self.devices[host])},
                         f"agent-{host}-{len(self.procs.procs.get(host, []))}")

    def gpufail(self, host: str, device: str) -> None:
        self.procs.kill(host)
        self.start(host, [d for d in self.devices[host] if d != device])



def _await_port(server: subprocess.Popen, port: int, deadline: float, log: Path) -> None:
    """Wait until ``server`` accepts connections on loopback ``port`` (every mode's service serves before the
    clock starts: see :mod:`.goodput_run`)."""
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the lighthouse did not serve on port {port}: "
                                   f"{log.read_text(errors='replace')[-2000:]}") from None
            time.sleep(0.05)


class Torchft(_OnProcesses):
    """torchft: a lighthouse, and one replica group (one process) per GPU (see :mod:`.goodput_peers`)."""

    # A torchft job has no end of its own: a replica that joins after the others finished would train from step 0
    # alone. The job is over at its last step.
    LINGER_S = 0.0

    SETTINGS = {
        "launcher": "torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000 (its "
                    "README's example); one process per GPU, each its own replica group (train_ddp.py: 'for DDP "
                    "we can use replica groups of size 1'), started directly: a replica is never restarted in "
                    "this trace (a failed GPU stays failed, a killed node is gone, a join is a new node)",
        "saves": "none: a replica that joins heals from a live peer (PGTransport), as torchft intends for "
                 "data-parallel churn; the trace never loses every replica",
        "leave": "SIGTERM to the node's replicas (torchft has no notice: they exit, the others drop the step)",
        "gpu fault": "the replica on that GPU exits; the others drop the step and go on",
        "timeouts": f"ProcessGroupGloo(timeout={TORCHFT_TIMEOUT_S:g} s) as in train_ddp.py's CPU branch, "
                    f"Manager(timeout=30 s)",
    }

    def __init__(self, base: Path, script: list[str], env: dict[str, str], max_nodes: int):
        self.script = script
        self.procs = _Processes(base, env)
        port = free_port()
        self.lighthouse = f"http://127.0.0.1:{port}"
        with open(base / "lighthouse.log", "ab") as out:
            self.server = subprocess.Popen(
                [str(Path(sys.executable).parent / "torchft_lighthouse"), "--bind", f"127.0.0.1:{port}",
                 "--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        _await_port(self.server, port, time.monotonic() + 120, base / "lighthouse.log")

    def start(self, host: str) -> None:
        for d in range(DEVICES):
            self.procs.spawn(host, [*self.script, "--lighthouse", self.lighthouse],
                             {"GOODPUT_HOST": host, "GOODPUT_DEVICE": str(d)}, f"replica-{host}-{d}")

    def gpufail(self, host: str, device: str) -> None:
        pass  # the replica raises by itself (the FAULTS file)


# The job a mode trains, by its worker mode: (its uninterrupted run's worker mode, its global batch). Every mode trains
# the DDP job but the tp job's (goodput_tp: the GPT under DTensor tp, its batch divisible by every dp up to 7).
JOBS = {"tenplex-inplace-tp": ("reference-tp", 420)}


def job_of(worker_mode: str, ddp_batch: int) -> tuple[str, int]:
    """(reference worker mode, global batch) of the job that ``worker_mode`` trains."""
    return JOBS.get(worker_mode, ("reference", ddp_batch))


# name -> (class, worker mode, what it is) or Unavailable. Adding a mode is one entry here.
MODES: dict[str, tuple[Any, str, str] | Unavailable] = {
    "tenplex": (TenplexRestart, "tenplex", "tenplex, restart mode: a new world per change, state from the stores"),
    "tenplex-inplace": (TenplexInPlace, "tenplex-inplace",
                        "tenplex in place: the survivors keep their processes, a new world per change"),
    "tenplex-inplace-tp": (TenplexInPlace, "tenplex-inplace-tp",
                           "tenplex in place, a tp job (the GPT under DTensor: tp=2 on even worlds, tp=1 on odd "
                           "ones): each change rebuilds the model on a new mesh in the same process"),
    "torchrun-dcp": (TorchrunDcp, "dcp", "torchrun's elastic agent + PyTorch Distributed Checkpoint"),
    "torchft": (Torchft, "torchft", "torchft: Manager + lighthouse, per-step quorum, live recovery"),
}
