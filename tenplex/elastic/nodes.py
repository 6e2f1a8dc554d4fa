"""Simulated nodes on this machine: a ``tenplex rendezvous serve`` process and one ``tenplex run`` per node.

May import: ``tenplex.runtime.hosts``, ``tenplex.elastic.dataview`` (the nodes' dataset views),
``tenplex.cluster`` (the emulated cluster: its type, its
control host and its hosts' link device), ``tenplex.errors`` and the standard library (no torch: the
demo's driver only starts, signals and kills processes).

Each node is a ``tenplex run`` agent in a process group of its own, with its
own store root ``BASE/HOST``. What happens to a node:

* ``leave``: SIGTERM to the agent, as a scheduler or ``kubectl delete`` would;
  its workers save with the others at their next step boundary and exit;
* ``fail``: SIGKILL to the node's whole process group (the agent; its workers
  die with it through ``PR_SET_PDEATHSIG``, see :mod:`tenplex.elastic.entry`)
  and to its store process: everything on the host is gone at once;
* ``partition`` (only with a ``cluster``): the node's link is cut, its
  processes keep running (see :meth:`Nodes.partition`);
* ``evict_all``: every node fails at once and its store root is deleted: the
  job's state survives only in its bucket (see :mod:`tenplex.elastic.evict`).

With an :class:`~tenplex.cluster.EmulatedCluster`, every node runs
inside its host's network namespace, with a link of its own: its agent, its
store (bound to the host's address, so with a token) and its workers
(``GLOO_SOCKET_IFNAME`` and torchrun's ``--local-addr`` put their process
group on that link). The rendezvous store runs in the cluster's control
namespace, which every host reaches through the bridge.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ..runtime.hosts import HostError, await_store
from .launcher import alive

if TYPE_CHECKING:
    from ..cluster import EmulatedCluster

# A cut-off agent's rendezvous calls hang without a reset; torch's default read timeout (60 s) would keep it
# waiting that long after each of them before it gives up and exits.
LINKED_RDZV_CONF = "read_timeout=10"


class Nodes:
    """The rendezvous store and the agents of one job under ``base``; a context manager that cleans up all."""

    def __init__(self, base: Path, nproc_per_node: int, max_nodes: int, script: Sequence[str],
                 env: dict[str, str] | None = None, cluster: "EmulatedCluster | None" = None,
                 dataset: Path | None = None, run_options: Sequence[str] = (), min_nodes: int = 1):
        self.run_options = list(run_options)  # more options of tenplex run for every node (e.g. --in-place)
        self.min_nodes = min_nodes  # --nnodes MIN: in place, how many nodes the first world waits for
        self.base, self.nproc, self.max_nodes, self.script = base, nproc_per_node, max_nodes, list(script)
        self.dataset = dataset  # each node mounts its view of it at view(host) (tenplex run --data-mount)
        self.env = dict(os.environ if env is None else env)
        self.cluster = cluster
        self.agents: dict[str, subprocess.Popen] = {}
        self.partitioned: set[str] = set()
        self.rendezvous: subprocess.Popen | None = None
        self.endpoint = ""
        self.rdzv_id = "demo"  # a new one after evict_all: the nodes started then form a new job
        self.token_file = self.base / "token"
        if cluster is not None:  # the stores bind the hosts' addresses, not loopback: they need a token
            self.token_file.touch(mode=0o600)
            self.token_file.write_text(secrets.token_hex(16))

    def _popen(self, host: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """``argv`` on ``host``: in its network namespace with a cluster, else right here."""
        if self.cluster is None:
            return subprocess.Popen(argv, **kwargs)
        return self.cluster.popen(host, argv, **kwargs)

    def start_rendezvous(self, timeout: float = 120.0) -> str:
        from ..cluster import CONTROL

        port_file, log = self.base / "rendezvous.port", self.base / "rendezvous.log"
        argv = [sys.executable, "-m", "tenplex.cli", "rendezvous", "serve", "--port", "0",
                "--port-file", str(port_file)]
        if self.cluster is not None:
            # TCPStore has no authentication: only the hosts of this run's private network reach it.
            argv += ["--bind", self.cluster.address(CONTROL), "--allow-unauthenticated"]
        with open(log, "ab") as out:
            self.rendezvous = self._popen(CONTROL, argv, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        # await_store waits for any port file: the rendezvous store reports its port the same way.
        self.endpoint = await_store(self.rendezvous, "rendezvous", port_file, time.monotonic() + timeout, log)
        if self.cluster is not None:
            self.endpoint = f"{self.cluster.address(CONTROL)}:{self.endpoint.rsplit(':', 1)[1]}"
        return self.endpoint

    def root(self, host: str) -> Path:
        return self.base / host

    def view(self, host: str) -> Path:
        """Where ``host`` mounts the job's dataset view (with ``dataset``)."""
        return self.base / f"view-{host}"

    def log(self, host: str) -> Path:
        return self.base / f"agent-{host}.log"

    def start(self, host: str) -> None:
        """Start ``tenplex run`` for ``host`` (a new agent; its store is started or reused)."""
        if host in self.agents and self.agents[host].poll() is None:
            raise HostError(f"node {host} is already running")
        argv = [sys.executable, "-m", "tenplex.cli", "run", *self.run_options, "--host", host,
                "--store-root", str(self.root(host)), "--nnodes", f"{self.min_nodes}:{self.max_nodes}",
                "--nproc-per-node", str(self.nproc),
                "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.rdzv_id]
        if self.dataset is not None:
            argv += ["--dataset", str(self.dataset), "--data-mount", str(self.view(host))]
        env = self.env
        if self.cluster is not None:
            from ..cluster import HOST_DEVICE

            address = self.cluster.address(host)
            argv += ["--store-bind", address, "--token-file", str(self.token_file), "--local-addr", address,
                     "--rdzv-conf", LINKED_RDZV_CONF]
            env = dict(env, GLOO_SOCKET_IFNAME=HOST_DEVICE)  # the host's link, not loopback
        with open(self.log(host), "ab") as out:
            self.agents[host] = self._popen(host, [*argv, *self.script], stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env, start_new_session=True)

    def leave(self, host: str) -> None:
        """A planned leave: SIGTERM to the node's agent."""
        self.agents[host].send_signal(signal.SIGTERM)

    def fail(self, host: str) -> None:
        """A host failure: SIGKILL to the node's process group, its store and its view's server, without warning."""
        agent = self.agents[host]
        try:
            os.killpg(agent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        store = self.store_pid(host)
        if store is not None and alive(store):
            os.kill(store, signal.SIGKILL)
        if self.dataset is not None:  # and the server of its dataset view (close() detaches the dead mount)
            from .dataview import server_pid

            view = server_pid(self.view(host))
            if view is not None and alive(view):
                os.kill(view, signal.SIGKILL)
        agent.wait()

    def evict_all(self) -> list[str]:
        """The whole job is lost: every running node fails and its store root (every local copy) is deleted; the
        nodes started afterwards rendezvous as a new job. Returns the evicted nodes."""
        hosts = self.running()
        for host in hosts:  # every process group first: no node may outlive the others long enough to go on alone
            try:
                os.killpg(self.agents[host].pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for host in hosts:
            self.fail(host)
            shutil.rmtree(self.root(host))
        self.rdzv_id = f"demo-{len(self.agents)}"
        return hosts

    def partition(self, host: str) -> None:
        """Cut the node's link: its agent, store and workers keep running, but no packet gets in or out and no
        connection is reset. Its workers' collectives time out (the job's ``timeout``), its agent's
        rendezvous calls time out (``LINKED_RDZV_CONF``), and it exits with an error."""
        if self.cluster is None:
            raise HostError(f"cannot partition {host}: the nodes run on loopback, without links of their own")
        self.cluster.cut(host)
        self.partitioned.add(host)

    def store_pid(self, host: str) -> int | None:
        pid_file = self.root(host) / ".tenplex-store.pid"
        return int(pid_file.read_text()) if pid_file.exists() else None

    def running(self) -> list[str]:
        return [h for h, p in self.agents.items() if p.poll() is None]

    def wait(self, timeout: float) -> dict[str, int | None]:
        """Wait for every agent to exit; their exit codes (None: still running at the timeout)."""
        deadline = time.monotonic() + timeout
        for agent in self.agents.values():
            try:
                agent.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return {h: p.poll() for h, p in self.agents.items()}

    def close(self) -> None:
        """Kill every agent's process group, every store and the rendezvous; wait for all of them."""
        for agent in self.agents.values():
            if agent.poll() is None:
                try:
                    os.killpg(agent.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            agent.wait()
        pids = [self.store_pid(h) for h in self.agents]
        if self.rendezvous is not None:
            pids.append(self.rendezvous.pid)
        for pid in pids:
            if pid is not None and alive(pid):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for pid in pids:
            while pid is not None and alive(pid):
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                time.sleep(0.05)
        if self.rendezvous is not None:
            self.rendezvous.wait()
        if self.dataset is not None:
            from .dataview import unmount_views

            unmount_views([self.view(h) for h in self.agents])

    def __enter__(self) -> "Nodes":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
