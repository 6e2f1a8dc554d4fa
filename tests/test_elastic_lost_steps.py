"""Lost steps: each host's progress record, the furthest step the hosts' records know, and a real two-rank job
(one rank per host, gloo) killed between two saves, then restarted: it counts the steps it lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tenplex.elastic import progress
from tenplex.elastic.progress import Progress, ProgressRecord
from tenplex.ports import free_port

WORKER = Path(__file__).parent / "mp" / "lost_worker.py"


def test_the_record_is_replaced_atomically_and_skipped_when_unchanged(tmp_path):
    record = ProgressRecord(tmp_path, "world-a", generation=1, lost_total=0)
    assert progress.read(tmp_path) is None  # a fresh (or wiped) store root holds none
    record.write(5)
    assert json.loads((tmp_path / progress.FILE).read_text()) == {
        "format": "tenplex.progress/1", "step": 5, "world": "world-a", "generation": 1, "lost_total": 0}
    (tmp_path / progress.FILE).write_text("changed behind its back")
    record.write(5)  # unchanged: not written again
    assert (tmp_path / progress.FILE).read_text() == "changed behind its back"
    assert progress.read(tmp_path) is None  # unreadable: it counts nothing
    record.write(6)
    assert progress.read(tmp_path) == Progress(6, "world-a", 1, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [progress.FILE]  # nothing left aside


def test_the_furthest_step_of_two_hosts_and_the_steps_lost(tmp_path):
    h0, h1 = tmp_path / "h0", tmp_path / "h1"
    h0.mkdir(), h1.mkdir()
    ProgressRecord(h0, "w1", 1, 0).write(9)
    ProgressRecord(h1, "w1", 1, 0).write(10)  # h0's rank died a boundary earlier
    found = progress.furthest([progress.read(h0), progress.read(h1)])
    assert found == Progress(10, "w1", 1, 0)
    assert progress.lost_steps(found, 8) == 2
    assert progress.lost_steps(found, 10) == 0  # the furthest step was saved
    assert progress.lost_steps(None, 8) == 0    # a fresh job, or every root wiped
    assert progress.furthest([None, None]) is None
    # The next world restored 8 (2 lost, 2 in all) on h1 only and finished step 9; h0 sat it out. Its old
    # record (step 10) was counted already: the newest generation wins, so restoring 9 loses nothing more.
    ProgressRecord(h1, "w2", 2, 2).write(9)
    found = progress.furthest([progress.read(h0), progress.read(h1)])
    assert found == Progress(9, "w2", 2, 2) and progress.lost_steps(found, 9) == 0


def _start(tmp_path: Path, steps: int) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(2):
        host = f"h{rank}"
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", TENPLEX_HOST=host,
                   TENPLEX_STORE_ROOT=str(tmp_path / host))
        log = open(tmp_path / f"rank{rank}.log", "a")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(tmp_path), str(steps)], env=env,
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def _train_and_kill(tmp_path: Path, steps: int) -> list[dict]:
    for done in tmp_path.glob("trained-r*"):
        done.unlink()
    procs = _start(tmp_path, steps)
    try:
        deadline = time.monotonic() + 180
        while not all((tmp_path / f"trained-r{r}").exists() for r in range(2)):
            assert all(p.poll() is None for p in procs), (tmp_path / "rank0.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"the ranks did not train {steps} steps"
            time.sleep(0.1)
    finally:
        for p in procs:  # a host failure: no final save, no stopping save
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return [json.loads((tmp_path / f"restored-r{r}.json").read_text()) for r in range(2)]


def _record(result: dict) -> tuple[int, int, int]:
    return result["record"]["step"], result["record"]["generation"], result["record"]["lost_total"]


def test_a_killed_job_counts_the_steps_since_its_last_save(tmp_path):
    first = _train_and_kill(tmp_path, 7)  # saves at step 4; steps 5-7 are lost
    zero = {"lost_steps": 0, "lost_steps_total": 0}
    for r in first:  # a fresh job loses nothing
        assert {k: r[k] for k in ("step", "lost_steps", "lost_steps_total", "cost", "metrics")} == {
            "step": 0, **zero, "cost": zero,
            "metrics": {"tenplex_job_lost_steps_total": 0, "tenplex_job_last_lost_steps": 0}}
        assert _record(r) == (0, 1, 0)
    for host in ("h0", "h1"):
        assert progress.read(tmp_path / host).step == 7
    (tmp_path / "h1" / progress.FILE).unlink()  # h1's record is gone: h0's, gathered, tells both ranks
    second = _train_and_kill(tmp_path, 6)  # restores 4: 7 - 4 = 3 lost; finishes step 6, saves nothing
    lost = {"lost_steps": 3, "lost_steps_total": 3}
    for r in second:
        assert {k: r[k] for k in ("step", "lost_steps", "lost_steps_total", "cost", "metrics")} == {
            "step": 4, **lost, "cost": lost,
            "metrics": {"tenplex_job_lost_steps_total": 3, "tenplex_job_last_lost_steps": 3}}
        assert _record(r) == (4, 2, 3)  # the new world's record starts at the restored step
    for host in ("h0", "h1"):
        found = progress.read(tmp_path / host)
        assert (found.step, found.generation, found.lost_total) == (6, 2, 3)
