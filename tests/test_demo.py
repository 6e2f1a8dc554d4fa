"""``tenplex demo`` end to end, shortened: real store processes, real gloo workers, a real packed dataset.

The test uses 2-rank configurations (tp=2 on one host -> pp=2 on two hosts, so
the second host's empty store forces a transformation through the stores) to
stay within about a minute on a loaded 2-core machine; ``make demo`` runs the
4-rank default. Where FUSE works, the workers read through a FUSE view (``--fuse``).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tenplex.dataset import DatasetState, open_dataset, upcoming_batches
from tenplex.runtime.demo import LOSS_RTOL, DemoConfig, summarize

TENPLEX = Path(sys.executable).with_name("tenplex")
STEPS = 2
ARGS = ["--steps", str(STEPS), "--from", "tp=2", "--to", "pp=2", "--hosts-from", "1", "--hosts-to", "2"]


def _fuse_missing() -> str | None:
    import fuse_vfs

    return fuse_vfs.fuse_unavailable_reason()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """One shortened run; through a FUSE view of the dataset where FUSE works (the in-process reader
    computes the same view, and tests/test_vfs.py checks that both give the same samples)."""
    workdir = tmp_path_factory.mktemp("demo")
    fuse = [] if _fuse_missing() else ["--fuse"]
    result = subprocess.run([str(TENPLEX), "demo", *ARGS, *fuse, "--json", "--workdir", str(workdir)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    summary = json.loads(result.stdout)
    assert summary["samples"]["readers"] == (["fuse"] if fuse else ["in-process"])
    assert not (workdir / "mnt").is_mount()
    return workdir, summary, result.stderr


def test_demo_continues_the_reference_run_after_a_rescale(demo):
    _, summary, log = demo
    assert summary["ok"] and all(summary["checks"].values()), summary["checks"]
    assert [r["step"] for r in summary["steps"]] == list(range(1, 2 * STEPS + 1))
    assert [r["phase"] for r in summary["steps"]] == ["A"] * STEPS + ["B"] * STEPS
    for r in summary["steps"]:
        assert math.isclose(r["loss"], r["reference"], rel_tol=LOSS_RTOL), r
    assert "all checks passed" in log and "[B] step" in log


def test_restore_reads_the_plan_from_the_stores_and_state_is_bit_equal(demo):
    _, summary, _ = demo
    restore, params = summary["restore"], summary["params"]
    # tp=2 on h0 -> pp=2 on h0 and h1: h1's one device needs its stage from h0, nothing fans out, so every rank
    # reads its part of the plan from the stores and no version is transformed.
    assert restore["step"] == STEPS and restore["read_through"] and not restore["transformed"]
    plan = restore["plan"]
    assert plan["inter_host_bytes"] > 0 and plan["inter_host_bytes"] == plan["inter_host_lower_bound"]
    assert plan["kept_bytes"] + plan["intra_host_bytes"] + plan["inter_host_bytes"] == plan["target_bytes"]
    assert params["bit_equal"] and params["differ"] == [] and params["tensors"] > 0
    assert params["missing_after_restore"] == [] and params["unexpected_after_restore"] == []


def test_every_sample_once_in_the_order_the_dataset_state_prescribes(demo):
    workdir, summary, _ = demo
    info = open_dataset(workdir / "data" / "dataset")
    samples = summary["samples"]
    assert samples["exactly_once"] and samples["dataset"] == info.num_samples == samples["distinct"]
    # Independently of the demo's own check: the pure dataset state says which global batch each step reads.
    start = DatasetState(info.identity, info.num_samples, 0, 0, 8)
    expected = upcoming_batches(start, 1, 2 * STEPS)["batches"]
    assert [r["ids"] for r in summary["steps"]] == expected
    assert sorted(i for batch in expected for i in batch) == list(range(info.num_samples))
    assert summary["restore"]["dataset_state"]["position"] == STEPS * 8


def test_checks_fail_on_a_repeated_sample_or_a_changed_parameter(demo, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    workdir, _, _ = demo
    copy = tmp_path / "copy"
    shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns("stores"))
    rank = copy / "B" / "rank0.json"
    doc = json.loads(rank.read_text())
    doc["steps"][-1]["ids"][0] = doc["steps"][0]["ids"][0]  # B reads a sample again and skips one
    rank.write_text(json.dumps(doc))
    params = sorted((copy / "B").glob("params-r*.safetensors"))[0]
    tensors = load_file(str(params))
    name = sorted(tensors)[0]
    tensors[name] = np.nextafter(tensors[name], np.inf).astype(tensors[name].dtype)  # one ulp off
    save_file(tensors, str(params))
    summary = summarize(DemoConfig(steps=STEPS), copy, 2 * STEPS * 8)
    assert not summary["ok"]
    assert not summary["checks"]["exactly_once"] and not summary["checks"]["params_bit_equal"]
    assert summary["params"]["differ"] == [name]
    assert len(summary["samples"]["duplicates"]) == 1 and len(summary["samples"]["missing"]) == 1


def test_the_demo_command_does_not_load_torch():
    # The orchestrating process stays light; torch runs in the worker processes only.
    code = "import sys, tenplex.cli.demo, tenplex.runtime.demo; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "False"


def test_demo_rejects_more_hosts_than_ranks():
    result = subprocess.run([str(TENPLEX), "demo", "--to", "pp=2", "--hosts-to", "3"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and "cannot fill 3 hosts" in result.stderr, result.stderr


def test_ranks_fill_hosts_in_rank_order():
    from tenplex.runtime.launch import place

    assert place(4, 2) == ["h0/0", "h0/1", "h1/0", "h1/1"]
    assert place(4, 3) == ["h0/0", "h0/1", "h1/0", "h2/0"]
    assert place(2, 1) == ["h0/0", "h0/1"]
    with pytest.raises(ValueError, match="cannot spread 2 ranks over 3 hosts"):
        place(2, 3)
