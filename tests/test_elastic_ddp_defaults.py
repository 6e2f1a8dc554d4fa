"""Issue 26, item 6: a plain DDP script under ``tenplex.elastic.Job``'s defaults. Two real gloo ranks on one node:
the default ``max_tp`` gives tp=2, which would train every sample twice per step, so ``job.restore`` stops both ranks
with one line naming ``max_tp=1``; with ``max_tp=1`` the same script is dp=2 (each rank its own share of a batch);
a model that is parallel (a DTensor parameter) passes under tp=2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
import tenplex.elastic
from torch.nn.parallel import DistributedDataParallel as DDP
from tenplex.errors import ConfigError
from tenplex.integration.process_group import init_process_group, leave_process_group

init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=int(sys.argv[2]), world_size=2)
kind = sys.argv[3]
job = tenplex.elastic.Job(global_batch=4, **({"max_tp": 1} if kind == "dp" else {}))
if kind == "dtensor":
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    model = torch.nn.Linear(8, 8)
    mesh = init_device_mesh("cpu", (2,))
    model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))
else:
    model = DDP(torch.nn.Linear(8, 8)).module
try:
    step = job.restore(model, torch.optim.SGD(model.parameters(), lr=0.1))
    print(json.dumps({"degrees": job.choice.degrees(), "coords": job.coords, "step": step,
                      "group": None if job.group is None else dist.get_world_size(job.group)}), flush=True)
except ConfigError as e:
    print(json.dumps({"error": str(e)}), flush=True)
leave_process_group()
"""


def _run(tmp_path, kind: str) -> list[dict]:
    import json

    ranks = []
    for rank in range(2):
        env = dict(os.environ, TENPLEX_STORE_ROOT=str(tmp_path / "h0"), TENPLEX_HOST="h0", LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
        for var in ("TENPLEX_MAX_TP", "TENPLEX_PP", "TENPLEX_PINNED"):  # the defaults, whatever the caller's shell
            env.pop(var, None)
        ranks.append(subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path / "rendezvous"), str(rank), kind],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    for rank, (_, err) in zip(ranks, outputs):
        assert rank.returncode == 0, err[-3000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


def test_plain_ddp_under_the_default_max_tp_stops_with_one_line_naming_max_tp_1(tmp_path):
    results = _run(tmp_path, "ddp")
    assert len({r["error"] for r in results}) == 1  # the same decision on both ranks (a collective)
    error = results[0]["error"]
    assert "\n" not in error and "pass max_tp=1 to Job" in error
    assert error.startswith("the policy chose dp=1,tp=2,pp=1 for 2 ranks, but every rank holds the same full model")
    assert "each sample would be trained 2 times per step" in error


@pytest.mark.parametrize("kind, degrees, coords", [
    ("dp", "dp=2,tp=1,pp=1", [{"pp": 0, "dp": 0, "tp": 0}, {"pp": 0, "dp": 1, "tp": 0}]),  # each rank its share
    ("dtensor", "dp=1,tp=2,pp=1", [{"pp": 0, "dp": 0, "tp": 0}, {"pp": 0, "dp": 0, "tp": 1}]),  # parallel: allowed
])
def test_max_tp_1_or_a_parallel_model_restores(tmp_path, kind, degrees, coords):
    results = _run(tmp_path, kind)
    assert [r.get("error") for r in results] == [None, None]
    assert [r["degrees"] for r in results] == [degrees, degrees] and [r["coords"] for r in results] == coords
    assert [r["step"] for r in results] == [0, 0]
    assert [r["group"] for r in results] == [None, None]  # no rank idle: job.group is None, the default group
