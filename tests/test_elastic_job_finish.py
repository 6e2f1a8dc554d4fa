"""Issue 42, items 2 and 3: ``Job.finish`` saves only what is not committed yet, and ``Job.restore`` closes the
``Checkpointer`` of an earlier restore. One real single-rank gloo world per case, in a subprocess (a Job joins the
process group and ``finish`` leaves it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, sys
import torch
import tenplex.elastic

saves = []
job = tenplex.elastic.Job(global_batch=2, max_tp=1, save_every=int(sys.argv[2]),
                          on_save=lambda info: saves.append(info["why"]))
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
job.restore(model, optimizer)
case, out = sys.argv[1], {}
for _ in range(3):
    job.step_done()
if case == "saved_at_the_last_step":
    job.save()  # a blocking save of step 3, after the snapshot of step 2: nothing is left for finish
elif case == "restored_twice":
    first = job._tracked["checkpointer"]
    out["restored"] = job.restore(model, optimizer)  # the snapshot of step 3 settles first: it is the newest
    out["first_closed"] = first._snapshots._closed
job.finish()
out["saves"] = saves
print(json.dumps(out), flush=True)
"""


def _run(tmp_path, case: str, save_every: int) -> dict:
    from tenplex.runtime.launch import free_port

    env = dict(os.environ, TENPLEX_STORE_ROOT=str(tmp_path / "h0"), TENPLEX_HOST="h0", RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               OMP_NUM_THREADS="1")
    for var in ("TENPLEX_MAX_TP", "TENPLEX_PP", "TENPLEX_PINNED", "TENPLEX_SAVE_INTERVAL", "TENPLEX_REPLICAS"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, case, str(save_every)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case, save_every, saves", [
    ("saved_at_the_last_step", 2, ["snapshot", "requested"]),  # the newest snapshot is older: still no save
    ("unsaved", 0, ["final"]),                                 # the last step is saved once, by finish
])
def test_finish_saves_only_a_step_not_committed_yet(tmp_path, case, save_every, saves):
    assert _run(tmp_path, case, save_every)["saves"] == saves


def test_a_second_restore_closes_the_first_checkpointer(tmp_path):
    out = _run(tmp_path, "restored_twice", 1)
    assert out["first_closed"] is True
    assert out["restored"] == 3
    assert out["saves"] == ["snapshot"] * 3  # the snapshot of step 3 is committed: finish saves nothing more
