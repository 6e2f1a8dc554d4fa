"""A world re-formed in place on the device (issue 36 item 6): one process destroys its one-rank group and forms
a new one of the same backend (NCCL on CUDA), keeping the model's device allocations; a model rebuilt on the new
group restores the saved state bit for bit on the device and trains on with the losses of an uninterrupted run.
The CUDA case skips without a GPU, as in CI; ``scripts/gpu-check`` runs it on one. The CPU case (gloo) runs the
same worker here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("mp") / "cuda_inplace_worker.py"
CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("device,backend", [
    ("cpu", "gloo"),
    pytest.param("cuda", "nccl", marks=pytest.mark.skipif(not CUDA, reason="no CUDA device"))])
def test_a_one_rank_world_is_destroyed_and_formed_again_in_the_same_process(tmp_path, device, backend):
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp_path), device, backend], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["left"] == [0, 0, 0]                      # no process group outlives its world
    assert report["kept_in_place"] is True                  # the old world's allocations stayed where they were
    assert report["restored_step"] == 2 and report["restored_bit_for_bit"] is True
    assert report["devices"] == [device]
    for loss, reference in zip(report["losses"], report["reference"], strict=True):
        assert loss == pytest.approx(reference, rel=1e-5)
