"""Save under one configuration and restore under another with the state on a device, bit for bit.

Real multi-process jobs (``tests/mp/cuda_worker.py``) build the reference GPT
with Adam's state, save with tenplex into a real store, restore into a fresh model under
another configuration, and dump every piece they held; the test assembles the
saved tensors and checks every restored piece against them, bit for bit, and
that the restored state lives on the job's device. Cases:

* two ranks, DTensor tensor parallelism (tp=2) to FSDP2 (dp=2), gloo: on CPU,
  and on CUDA where present (two ranks share one GPU; NCCL needs a GPU per
  rank, gloo carries CUDA tensors);
* one rank under NCCL on CUDA, saved and restored as it was.

The CUDA cases skip without a GPU, as in CI; ``scripts/gpu-check`` runs them on one.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tenplex.box import Box
from tenplex.runtime.launch import run_spec_job

WORKER = Path(__file__).with_name("mp") / "cuda_worker.py"
CUDA = torch.cuda.is_available()
MODEL = {"vocab": 40, "seq": 8, "hidden": 32, "heads": 4, "layers": 2, "ffn": 64}
# id: (device, backend, old, new, ranks, train): two ranks fill Adam's moments without a training step (gloo may
# lack CUDA versions of the collectives it needs); the CPU case runs that same path here.
CASES = {
    "cpu-gloo-tp2-to-fsdp2": ("cpu", "gloo", "tp=2", "dp=2,fsdp=1", 2, False),
    "cuda-gloo-tp2-to-fsdp2": ("cuda", "gloo", "tp=2", "dp=2,fsdp=1", 2, False),
    "cuda-nccl-single": ("cuda", "nccl", "dp=1", "dp=1", 1, True),
}


def pieces(path: Path) -> dict[tuple[str, Box], torch.Tensor]:
    result = {}
    for key, value in load_file(str(path)).items():
        name, offsets, lengths = key.split("@")
        result[(name, Box(tuple(ast.literal_eval(offsets)), tuple(ast.literal_eval(lengths))))] = value
    return result


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.skipif(c.startswith("cuda") and not CUDA,
                                                                            reason="no CUDA device"))
                                  for c in CASES])
def test_restore_under_another_configuration_is_bit_for_bit_on_the_device(tmp_path, case):
    device, backend, old, new, ranks, train = CASES[case]
    spec = {"device": device, "backend": backend, "old": old, "new": new, "model": MODEL, "train": train,
            "root": str(tmp_path / "store"), "out": str(tmp_path)}
    run_spec_job([sys.executable, str(WORKER)], spec, tmp_path / "spec.json", [f"h0/{r}" for r in range(ranks)],
                 {"h0": tmp_path / "store"}, {}, tmp_path / "logs", timeout=300)
    reports = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(ranks)]
    shapes = {name: tuple(shape) for report in reports for name, shape in report["shapes"].items()}
    saved: dict[str, torch.Tensor] = {}  # the full tensors, assembled from every rank's saved pieces
    for r in range(ranks):
        for (name, box), value in pieces(tmp_path / f"saved_r{r}.safetensors").items():
            full = saved.setdefault(name, torch.full(shapes[name], float("nan"), dtype=value.dtype))
            full[box.slices()] = value
    checked = 0
    for r in range(ranks):
        assert reports[r]["step"] == 1 and reports[r]["devices"] == [device]
        for (name, box), value in pieces(tmp_path / f"restored_r{r}.safetensors").items():
            assert torch.equal(value.view(torch.uint8), saved[name][box.slices()].contiguous().view(torch.uint8)), \
                f"rank {r}: {name} {box} differs from the saved values"
            checked += value.numel()
    assert checked >= sum(t.numel() for t in saved.values())  # every saved tensor came back (replicas: more)
    assert all(not torch.isnan(t).any() for t in saved.values() if t.is_floating_point())

