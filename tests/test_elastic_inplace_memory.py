"""Restore from memory (issue 36 item 3): a survivor of a change in place takes what it kept of the restored
version from its own tensors and reads only what it lacks, from this host's store or other hosts'. Two processes
(real gloo group, each host's real store served over gRPC) go through six changes of layout; each restore's bytes
by source are pinned and its state is compared bit for bit with an uninterrupted run's (tests/mp/memory_worker.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).parent / "mp" / "memory_worker.py"
FULL = (8 * 6 + 8) * 8 * 3   # w and b, float64, as parameters, exp_avg and exp_avg_sq
HALF = FULL // 2


def test_a_survivor_restores_what_it_kept_from_memory_and_reads_only_what_it_lacks(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(tmp_path), str(rank)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    reports = [json.loads(out.splitlines()[-1]) for out, _ in outs]
    for report in reports:
        assert all(report["equal"].values()), report["equal"]  # bit for bit, every case
        b = report["bytes"]
        assert b["A"] == {"memory": HALF, "this_host": 0, "other_hosts": HALF}  # tp=2 -> whole: only the lacking half
        assert report["read_through"]["A"]
        assert b["B"] == {"memory": FULL, "this_host": 0, "other_hosts": 0}     # pure data parallel: all kept
        assert b["C"] == {"memory": 0, "this_host": FULL, "other_hosts": 0}      # a kept tensor changed since
        assert b["D"] == {"memory": 0, "this_host": FULL, "other_hosts": 0}      # memory of another version
        assert b["E"] == {"memory": HALF, "this_host": 0, "other_hosts": 0}      # whole -> tp=2: all kept
        assert b["F"] == {"memory": HALF, "this_host": HALF, "other_hosts": 0}   # a DTensor's shard kept; v2 is
        # whole on each host: the other half from this host's store
