"""Issue 42, items 2 and 3: ``Job.finish`` saves only what is not committed yet, and ``Job.restore`` closes the
``Checkpointer`` of an earlier restore. Each case is a real single-rank gloo world, one after the other in one
subprocess (a Job joins the process group, ``finish`` leaves it), with a store root of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, os, sys
import torch
import tenplex.elastic
from tenplex.ports import free_port


def run(case, save_every):
    os.environ["MASTER_PORT"] = str(free_port())  # a world of its own
    saves = []
    job = tenplex.elastic.Job(global_batch=2, max_tp=1, save_every=save_every,
                              on_save=lambda info: saves.append(info["why"]),
                              checkpointer_options={"store_root": os.path.join(sys.argv[1], case)})
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    job.restore(model, optimizer)
    out = {"case": case}
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


for case, save_every in (("saved_at_the_last_step", 2), ("unsaved", 0), ("restored_twice", 1)):
    run(case, save_every)
"""


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, dict]:
    env = dict(os.environ, TENPLEX_HOST="h0", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    for var in ("TENPLEX_MAX_TP", "TENPLEX_PP", "TENPLEX_PINNED", "TENPLEX_SAVE_INTERVAL", "TENPLEX_REPLICAS"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path_factory.mktemp("roots"))], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {doc["case"]: doc for doc in map(json.loads, proc.stdout.strip().splitlines())}


@pytest.mark.parametrize("case, saves", [
    ("saved_at_the_last_step", ["snapshot", "requested"]),  # the newest snapshot is older: still no final save
    ("unsaved", ["final"]),                                 # the last step is saved once, by finish
])
def test_finish_saves_only_a_step_not_committed_yet(cases, case, saves):
    assert cases[case]["saves"] == saves


def test_a_second_restore_closes_the_first_checkpointer(cases):
    out = cases["restored_twice"]
    assert out["first_closed"] is True
    assert out["restored"] == 3
    assert out["saves"] == ["snapshot"] * 3  # the snapshot of step 3 is committed: finish saves nothing more
