"""The example GPT ``Trainer`` in a world whose policy leaves a rank idle (issue 36): three real gloo ranks, h0/0
alone on its node and two on h1, ``max_tp=2``: tp=2 on h1, rank 0 idle. The Trainer's DeviceMesh spans the training
ranks (global ranks 1 and 2) only, the idle rank builds nothing and ends when they finish, and the job trains bit
for bit as the same configuration does in a world of two ranks where nobody idles (the same losses, parameters and
Adam moments)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from tenplex.runtime.launch import run_job

WORKER = Path(__file__).parent / "mp" / "gpt_idle_worker.py"
STEPS = 3


def _run(tmp_path: Path, name: str, devices: list[str]) -> tuple[list[dict], dict[str, torch.Tensor]]:
    out = tmp_path / name
    out.mkdir()
    roots = {h: tmp_path / name / h for h in {d.split("/")[0] for d in devices}}
    run_job([sys.executable, str(WORKER), str(out), str(STEPS)], devices, roots, {}, out / "logs", timeout=300)
    ranks = [json.loads((out / f"r{r}.json").read_text()) for r in range(len(devices))]
    return ranks, load_file(str(out / "state.safetensors"))


def test_the_trainer_builds_its_mesh_over_the_training_ranks_and_trains_as_without_an_idle_rank(tmp_path):
    ranks, state = _run(tmp_path, "idle", ["h0/0", "h1/0", "h1/1"])
    alone, want = _run(tmp_path, "all", ["h0/0", "h0/1"])
    assert ranks[0] == {"rank": 0, "idle": True, "degrees": "dp=1,tp=2,pp=1", "ranks": [1, 2]}  # it exited idle
    for r in (1, 2):
        assert not ranks[r]["idle"] and ranks[r]["group"] == 2
        assert ranks[r]["mesh"] == [[[1, 2]]]                     # (pp, dp, tp) global ranks: rank 0 is not in it
        assert ranks[r]["coords"] == alone[r - 1]["coords"] == {"pp": 0, "dp": 0, "tp": r - 1}
        assert ranks[r]["losses"] == alone[r - 1]["losses"]       # every training rank reports the global loss
    assert [a["mesh"] for a in alone] == [[[[0, 1]]]] * 2 and [a["group"] for a in alone] == [None, None]
    assert state.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(state[name], value), name
