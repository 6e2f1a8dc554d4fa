"""How ``tenplex run`` counts restarts and drops failed devices, on torchrun's own agent.

May import: ``tenplex.elastic.faults`` and ``.devices``, ``tenplex.ops`` (its lines under ``--log-format
json``), torch's ``torch.distributed.elastic`` and
``torch.distributed.launcher`` (the agent and where torchrun builds it), and the standard library.

torchrun's agent restarts its workers after any failed worker and counts each restart against
``--max-restarts``; a membership change that arrives as failed workers (a peer left or died, so the
survivors' collectives failed) would count too, and the eleventh one would end a healthy job. The agent
here is torchrun's :class:`LocalElasticAgent` with two hooks:

* after the workers' state is read (``_monitor_workers``), the failed workers' exit codes are classified
  (:func:`tenplex.elastic.faults.of_exit`). A restart counts against ``--max-restarts`` only when one of
  them crashed; one in which every failure is a lost peer (75) or a device fault (76) is given back. Once
  one worker failed, torchrun stops the node's others (SIGTERM, SIGKILL after its grace) and reports them
  as failed too: a worker still starting up (no SIGTERM handler yet) or slow to stop exits -15 or -9. The
  agent records which workers were still running when torchrun stopped them (:func:`record_stops`), and
  their exits are not crashes of their own (:func:`failure_kinds`);
* before the workers (re)start (``_initialize_workers``), a device whose worker exited with a device fault,
  or that fails the health probe, is excluded and the node re-joins with one worker fewer per excluded
  device (:class:`~tenplex.elastic.devices.NodeDevices`). A node with no device left leaves the job as a
  planned leave would (:class:`NodeOutOfDevices`): the others go on without it.

A join needs no hook: torchrun restarts the workers for a waiting node without counting it.

In place (``tenplex run --in-place``: ``TENPLEX_IN_PLACE`` set, each node's torchrun alone) the workers form the
job's worlds themselves, and a device fault must not stop the node's other workers: a worker that exited with a
device fault while others of the node still run is dropped from torchrun's watch (:func:`drop_device_faults`) and
its device excluded; the others go on in the next world, which forms without it (it marked itself leaving). Its
exit is neither a restart nor a crash. When every worker of the node failed, the restart path above applies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException

from ..ops import logs
from . import faults
from .devices import NodeDevices, probe


class NodeOutOfDevices(SignalException):
    """Every device of this node failed: it leaves the job like a planned leave (the rendezvous stays open)."""

    def __init__(self, host: str, excluded: dict[str, str]):
        why = "; ".join(f"{d}: {w}" for d, w in excluded.items())
        super().__init__(f"host {host} has no healthy device left ({why})", signal.SIGTERM)


class TenplexAgent(LocalElasticAgent):
    """torchrun's agent, counting only crashes against ``--max-restarts`` and leaving failed devices out."""

    def __init__(self, *args, host: str, **kwargs):
        super().__init__(*args, **kwargs)
        # torchrun resolved --nproc-per-node (a number, "gpu", "auto") into local_world_size
        self.devices = NodeDevices.of_node(self._worker_group.spec.local_world_size, os.environ)
        self.host = host
        self.started_on: list[str] = []   # the device of each LOCAL_RANK of the running workers
        self.crashes = 0
        self.stopped_by_agent: set[int] = set()  # local ranks torchrun stopped when it closed the group
        self.in_place = os.environ.get("TENPLEX_IN_PLACE", "") not in ("", "0")  # set by tenplex run --in-place

    def _say(self, text: str) -> None:
        logs.line(f"tenplex run: host {self.host}: {text}", sys.stderr, logger=__name__)

    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        for device, why in probe(self.devices.healthy).items():
            if self.devices.exclude(device, why):
                self._say(f"device {device} failed its health probe ({why}); excluded")
        if not self.devices.healthy:
            raise NodeOutOfDevices(self.host, self.devices.excluded)
        # torchrun numbers the ranks from each node's local_world_size at every rendezvous: nodes may differ.
        worker_group.spec.local_world_size = len(self.devices.healthy)
        os.environ.update(self.devices.env())   # the agent's environment is the workers' (see launcher.run)
        self.started_on = list(self.devices.healthy)
        super()._initialize_workers(worker_group)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        pids = super()._start_workers(worker_group)
        self.stopped_by_agent = record_stops(self._pcontext)
        return pids

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        if self.in_place:
            for local_rank in drop_device_faults(self._pcontext):
                device = self.started_on[local_rank] if local_rank < len(self.started_on) else str(local_rank)
                self.devices.exclude(device, f"worker {local_rank} exited with a device fault")
                self._say(f"device {device} (local rank {local_rank}) had a device fault; excluded, the node's "
                          f"other workers go on in place ({len(self.devices.healthy)} device(s))")
        result = super()._monitor_workers(worker_group)
        if result.state not in (WorkerState.FAILED, WorkerState.UNHEALTHY) or not result.failures:
            return result
        codes = {f.local_rank: f.exitcode for f in result.failures.values()}
        kinds = failure_kinds(codes, self.stopped_by_agent)
        for local_rank, kind in sorted(kinds.items()):
            if kind == faults.DEVICE and local_rank < len(self.started_on):
                device = self.started_on[local_rank]
                if self.devices.exclude(device, f"worker {local_rank} exited with a device fault"):
                    self._say(f"device {device} (local rank {local_rank}) had a device fault; excluded, "
                              f"re-joining with {len(self.devices.healthy)} device(s)")
        if faults.CRASH in kinds.values():
            self.crashes += 1
            left = self._remaining_restarts  # torchrun's loop restarts (and takes one off) while any is left
            self._say(f"a worker crashed (exit codes {sorted(f.exitcode for f in result.failures.values())}); "
                      f"crash {self.crashes}, " + (f"restarting ({left - 1} restart(s) left after this one)" if left
                                                   else "no restart left: ending the job"))
        else:
            # torchrun's loop takes one restart off for this one: a membership change or a device fault is
            # not a crash, so give it back before it does.
            self._remaining_restarts += 1
            stopped = sorted(c for r, c in codes.items() if r not in kinds)
            also = f" ({len(stopped)} worker(s) stopped by the agent: exit codes {stopped})" if stopped else ""
            self._say(f"workers stopped: {', '.join(sorted(set(kinds.values())))}{also}; not counted as a restart")
        return result


def record_stops(pcontext: Any) -> set[int]:
    """The local ranks that torchrun's process context ``pcontext`` stops when it closes (still running then),
    filled in as it closes: it SIGTERMs them, and SIGKILLs them after its grace, once another worker failed
    (or when the agent stops the group). Only for scripts (a ``SubprocessContext``); else stays empty."""
    stopped: set[int] = set()
    handlers = getattr(pcontext, "subprocess_handlers", None)
    if handlers is None:
        return stopped
    close = pcontext._close

    def closing(*args, **kwargs):
        stopped.update(rank for rank, handler in handlers.items() if handler.proc.poll() is None)
        return close(*args, **kwargs)

    pcontext._close = closing
    return stopped


def drop_device_faults(pcontext: Any) -> list[int]:
    """The local ranks of torchrun's process context ``pcontext`` that exited with a device fault while others
    still run, taken off its watch: torchrun stops every worker once one failed, and in place the others must go
    on. Only for scripts (a ``SubprocessContext``, whose running ranks it tracks); else none."""
    running, handlers = getattr(pcontext, "_running_local_ranks", None), getattr(pcontext, "subprocess_handlers", {})
    if not running or not handlers:
        return []
    codes = {rank: handlers[rank].proc.poll() for rank in running}
    faulted = [rank for rank, code in codes.items() if code == faults.EXIT_DEVICE_FAULT]
    if not faulted or all(code is not None for code in codes.values()):
        return []  # none, or nobody left running: the restart path decides (NodeOutOfDevices for the last device)
    running.difference_update(faulted)
    return sorted(faulted)


def failure_kinds(codes: dict[int, int], stopped: set[int]) -> dict[int, str]:
    """{local rank: fault kind} of the failed workers (``codes``: their exit codes) that count: a worker the
    agent stopped (``stopped``) because another failed did not crash of its own, whatever its code (-15, -9,
    or 1 from a program's own handler); it still reports a device fault or a lost peer. When only stopped
    workers failed, every failure counts."""
    kinds = {rank: faults.of_exit(code) for rank, code in codes.items()}
    own = {rank: kind for rank, kind in kinds.items() if rank not in stopped or kind != faults.CRASH}
    return own or kinds


@contextlib.contextmanager
def tenplex_agent(host: str):
    """Make torchrun's ``launch_agent`` build a :class:`TenplexAgent` while this context is open (it builds
    ``LocalElasticAgent`` by its module-level name and takes no agent class)."""
    from torch.distributed.launcher import api

    def build(*args, **kwargs) -> TenplexAgent:
        return TenplexAgent(*args, host=host, **kwargs)

    original = api.LocalElasticAgent
    api.LocalElasticAgent = build  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        api.LocalElasticAgent = original  # type: ignore[misc]
