"""``tenplex run``'s restart accounting and device exclusion on real torchrun agents on loopback
(tenplex.elastic.restarts): membership changes and device faults are not restarts, crashes are; a worker with
a device fault is not started on that device again. The worker is ``tests/mp/membership_worker.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tenplex.elastic.nodes import Nodes

WORKER = str(Path(__file__).parent / "mp" / "membership_worker.py")


def _starts(folder: Path) -> list[dict]:
    path = folder / "starts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for(what: str, ready, nodes: Nodes | None = None, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline or (nodes is not None and "h0" not in nodes.running()):
            logs = "\n".join(p.read_text()[-3000:] for p in sorted(nodes.base.glob("agent-*.log"))) if nodes else ""
            pytest.fail(f"no {what}\n{logs}")
        time.sleep(0.1)


def _standalone(tmp_path: Path, nproc: int, max_restarts: int, *script: str,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    root = tmp_path / "h0"
    try:
        return subprocess.run([sys.executable, "-m", "tenplex.cli", "run", "--host", "h0", "--store-root", str(root),
                               "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
                               WORKER, str(tmp_path), *script], capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    finally:
        subprocess.run([sys.executable, "-m", "tenplex.cli", "store", "stop", "--store-root", str(root)],
                       capture_output=True, timeout=120)


def test_a_crash_loop_ends_the_job_after_max_restarts(tmp_path):
    done = _standalone(tmp_path, 1, 2, "crash")
    assert done.returncode != 0
    assert len(_starts(tmp_path)) == 3, done.stderr[-3000:]  # the first start and two restarts
    assert "a worker crashed (exit codes [1]); crash 1, restarting (1 restart(s) left after this one)" in done.stderr
    assert "a worker crashed (exit codes [1]); crash 3, no restart left: ending the job" in done.stderr


def test_a_device_fault_is_not_a_restart_and_its_device_is_left_out(tmp_path):
    # --max-restarts 0: a counted restart would end the job. Device 1 stays broken (TENPLEX_INJECT_DEVICE_FAULT).
    done = _standalone(tmp_path, 2, 0, "loop", "6", env={"TENPLEX_INJECT_DEVICE_FAULT": "h0/1@3"})
    assert done.returncode == 0, done.stderr[-3000:]
    starts = _starts(tmp_path)
    worlds = [(s["world"], s["rank"], s["device"], s["devices"]) for s in starts]
    assert sorted(worlds[:2]) == [(2, 0, "0", "0,1"), (2, 1, "1", "0,1")]
    assert worlds[2:] == [(1, 0, "0", "0")]   # the next world: one worker, never on device 1 again
    assert "device 1 (local rank 1) had a device fault; excluded, re-joining with 1 device(s)" in done.stderr
    assert "not counted as a restart" in done.stderr


def test_a_sibling_that_torchrun_stops_during_its_start_is_not_a_crash(tmp_path):
    """Issue 42 item 1: device 1's worker fails at its start while device 0's is still starting up (no SIGTERM
    handler yet): torchrun's SIGTERM kills that sibling (exit -15), which is not a crash of its own."""
    done = _standalone(tmp_path, 2, 0, "slow-start", "3", env={"TENPLEX_INJECT_DEVICE_FAULT": "h0/1@0"})
    assert done.returncode == 0, done.stderr[-3000:]
    starts = [(s["device"], s.get("world")) for s in _starts(tmp_path)]  # device 0's first start may not record
    assert starts.count(("1", None)) == 1 and starts[-2:] == [("0", None), ("0", 1)], starts
    assert "device 1 (local rank 1) had a device fault; excluded, re-joining with 1 device(s)" in done.stderr
    assert "workers stopped: device fault (1 worker(s) stopped by the agent: exit codes [-15]); not counted as a " \
           "restart" in done.stderr


def test_workers_stopped_by_the_agent_count_by_the_worker_that_failed_first():
    """The SIGKILL after torchrun's grace (-9) and a program's own exit on SIGTERM (1) are the agent's doing too;
    a stopped worker that reports its device is still a device fault; a crash of its own counts."""
    from tenplex.elastic.restarts import failure_kinds

    assert failure_kinds({0: -9, 1: 76}, {0}) == {1: "device fault"}
    assert failure_kinds({0: 1, 1: 75, 2: 76}, {0, 2}) == {1: "peer lost", 2: "device fault"}
    assert failure_kinds({0: -15, 1: 1}, {0}) == {1: "crash"}       # the first failure was a crash
    assert failure_kinds({0: -9}, set()) == {0: "crash"}             # killed, not by the agent: a crash
    assert failure_kinds({0: -15}, {0}) == {0: "crash"}              # nothing failed of its own: it counts


def test_a_node_whose_last_device_fails_leaves_the_job(tmp_path):
    done = _standalone(tmp_path, 1, 3, "loop", "6", env={"TENPLEX_INJECT_DEVICE_FAULT": "h0/0@1"})
    assert done.returncode == 1
    assert len(_starts(tmp_path)) == 1
    assert "tenplex run: host h0 has no healthy device left (0: worker 0 exited with a device fault); leaving " \
           "the job" in done.stderr


def test_membership_changes_beyond_max_restarts_do_not_end_the_job(tmp_path):
    """Two losses of h1 (kill, leave) and two rejoins under --max-restarts 1: h0's agent counts none (counted,
    the second loss would end the job)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with Nodes(tmp_path, 1, 2, ["--max-restarts", "1", WORKER, str(tmp_path), "loop"], env) as nodes:
        nodes.start_rendezvous()

        def world_of(size: int, after: float) -> bool:
            return sum(1 for s in _starts(tmp_path) if s["time"] > after and s["world"] == size) == size

        t = time.time()
        nodes.start("h0")
        nodes.start("h1")
        _wait_for("world of 2", lambda: world_of(2, t), nodes)
        for lose in (nodes.fail, nodes.leave):
            t = time.time()
            lose("h1")
            _wait_for("world of 1 after losing h1", lambda: world_of(1, t), nodes)  # noqa: B023
            nodes.agents["h1"].wait(180)
            t = time.time()
            nodes.start("h1")
            _wait_for("world of 2 after h1 rejoined", lambda: world_of(2, t), nodes)  # noqa: B023
        (tmp_path / "stop").touch()
        codes = nodes.wait(120)
    assert codes == {"h0": 0, "h1": 0}
    log = (tmp_path / "agent-h0.log").read_text()
    assert log.count("not counted as a restart") >= 2 and "a worker crashed" not in log
