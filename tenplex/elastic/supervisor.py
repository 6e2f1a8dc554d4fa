"""``tenplex run --in-place``'s local supervisor: this node's workers, started and watched without torchrun.

May import: ``tenplex.elastic.faults`` and ``.devices``, ``tenplex.ports``, ``tenplex.ops`` (its lines under
``--log-format json``) and the standard library. No torch: the launcher starts the workers without importing
it (measured, issue 37: torchrun's parser, agent and local rendezvous took 7 s of a node's start at load 3, 10 s
at load 10).

In place, torchrun's only job on a node was local supervision (:mod:`.inplace_launch`); this does the same for
a node's workers, one per device slot (``--nproc-per-node``), all started at once:

* the environment torchrun ``--standalone`` gives them (``LOCAL_RANK``, ``RANK``, ``LOCAL_WORLD_SIZE``,
  ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of this node alone, ``TORCHELASTIC_RESTART_COUNT``…), and
  ``TENPLEX_DEVICES``: every slot's device, so that ``LOCAL_RANK`` keeps naming the same device when a worker
  is restarted after another's device was excluded;
* a crashed worker is restarted alone (its siblings go on; the worlds form without it, then with it again),
  counted against ``--max-restarts``; once more crashes than that, the node's workers are stopped and
  ``tenplex run`` exits 1. A worker that exited as a lost peer (75) is restarted without counting;
* a worker that exited with a device fault (76) is not restarted: its device is excluded
  (:class:`~tenplex.elastic.devices.NodeDevices`), and so is a device that fails the health probe before a
  (re)start. A node with no device left exits 1: it leaves the job;
* SIGTERM or SIGINT is a planned leave: it reaches every worker (they save at their next step boundary and
  exit), and ``tenplex run`` exits 0 once they did (SIGKILL after ``grace`` seconds, as torchrun's 30);
* every worker exited 0: the node is done, exit 0.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading

from ..ops import logs
from ..ports import free_port
from . import faults
from .devices import NodeDevices, probe

POLL_S = 0.1        # how often the workers' exits are checked (torchrun's --monitor-interval default)
GRACE_S = 30.0      # a leaving worker's time to save and exit before SIGKILL (torchrun's close() default)


class Supervisor:
    """This node's workers: ``command`` once per device slot (``nproc``), restarted and stopped as above."""

    def __init__(self, host: str, nproc: int, max_restarts: int, command: list[str], *, run_id: str = "none",
                 local_addr: str = "127.0.0.1", grace: float = GRACE_S):
        self.host, self.max_restarts, self.command, self.grace = host, max_restarts, command, grace
        self.devices = NodeDevices.of_node(nproc, os.environ)
        self.slots = list(self.devices.devices)          # LOCAL_RANK i runs on slots[i], for good
        self.workers: dict[int, subprocess.Popen] = {}
        self.restarts = 0                                 # restarts so far (TORCHELASTIC_RESTART_COUNT)
        self.crashes = 0
        self._base = self._base_env(run_id, local_addr)
        self._woken = threading.Event()
        self._signal: int | None = None

    def _say(self, text: str, level: int = logging.INFO) -> None:
        logs.line(f"tenplex run: host {self.host}: {text}", sys.stderr, level, __name__)

    def _base_env(self, run_id: str, local_addr: str) -> dict[str, str]:
        env = {"GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "MASTER_ADDR": local_addr,
               "MASTER_PORT": str(free_port(local_addr)), "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
               "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "False",
               "TENPLEX_DEVICES": ",".join(self.slots)}
        if self.devices.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.slots)
        if len(self.slots) > 1 and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = "1"  # as torchrun: several workers must not each take every core
        return env

    def _env(self, slot: int) -> dict[str, str]:
        size = str(len(self.devices.healthy))  # the node's workers from now on: a joiner's siblings to wait for
        return {**os.environ, **self._base, "LOCAL_RANK": str(slot), "RANK": str(slot), "ROLE_RANK": str(slot),
                "LOCAL_WORLD_SIZE": size, "WORLD_SIZE": size, "ROLE_WORLD_SIZE": size,
                "TORCHELASTIC_RESTART_COUNT": str(self.restarts)}

    def _healthy(self, slots: list[int]) -> list[int]:
        """``slots`` whose devices pass the health probe (the others are excluded)."""
        for device, why in probe([self.slots[s] for s in slots]).items():
            if self.devices.exclude(device, why):
                self._say(f"device {device} failed its health probe ({why}); excluded")
        return [s for s in slots if self.slots[s] in self.devices.healthy]

    def _start(self, slots: list[int]) -> None:
        for slot in self._healthy(slots):
            # A session of its own, as torchrun's workers: a signal to the node's group reaches them once, by us.
            self.workers[slot] = subprocess.Popen(self.command, env=self._env(slot), start_new_session=True)

    def _on_signal(self, signum: int, frame) -> None:
        self._signal = signum
        self._woken.set()

    def run(self) -> int:
        """Start the workers and supervise them; the exit code of ``tenplex run``."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self._start(list(range(len(self.slots))))
            while True:
                if self._signal is not None:
                    return self._leave()
                code = self._check()
                if code is not None:
                    return code
                self._woken.wait(POLL_S)
        finally:
            self._stop_all(signal.SIGKILL, 0.0)  # nothing outlives its supervisor (they die with it anyway)
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _check(self) -> int | None:
        """Handle the workers that exited since the last check; an exit code once the node is done."""
        for slot, proc in sorted(self.workers.items()):
            code = proc.poll()
            if code is None:
                continue
            del self.workers[slot]
            if code != 0 and self._failed(slot, code):
                return 1
        if self.workers:
            return None
        if not self.devices.healthy:
            self._say(f"no healthy device left ({self.devices.excluded}); leaving the job", logging.ERROR)
            return 1
        return 0

    def _failed(self, slot: int, code: int) -> bool:
        """React to the worker on ``slot`` exiting with ``code``; whether the node must end (restarts used up)."""
        kind, device = faults.of_exit(code), self.slots[slot]
        if kind == faults.DEVICE:
            self.devices.exclude(device, f"worker {slot} exited with a device fault")
            self._say(f"device {device} (local rank {slot}) had a device fault; excluded, the node's other "
                      f"workers go on in place ({len(self.devices.healthy)} device(s))")
            return False
        if kind == faults.CRASH:
            self.crashes += 1
            if self.crashes > self.max_restarts:
                self._say(f"worker {slot} crashed (exit code {code}); crash {self.crashes}, no restart left: "
                          f"ending the job", logging.ERROR)
                self._stop_all(signal.SIGTERM, self.grace)
                return True
            self._say(f"worker {slot} crashed (exit code {code}); crash {self.crashes}, restarting it alone "
                      f"({self.max_restarts - self.crashes} restart(s) left after this one)")
        else:
            self._say(f"worker {slot} stopped: {kind} (exit code {code}); restarting it, not counted as a restart")
        self.restarts += 1
        self._start([slot])
        return False

    def _leave(self) -> int:
        name = signal.Signals(self._signal or signal.SIGTERM).name
        self._say(f"{name}: a planned leave; the workers save at their next step boundary")
        self._stop_all(signal.SIGTERM, self.grace)
        logs.line(f"tenplex run: host {self.host} left the job ({name})", sys.stderr, logger=__name__)
        return 0

    def _stop_all(self, sig: int, grace: float) -> None:
        """Send ``sig`` to every running worker; SIGKILL those still running ``grace`` seconds later."""
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.send_signal(sig)
        for proc in self.workers.values():
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.workers.clear()
