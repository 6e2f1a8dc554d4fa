"""``tenplex data`` through the real command line: pack, state, and the ``plan --json`` contract."""

import json
import subprocess
import sys

import numpy as np

from tenplex.dataset import open_dataset
from tenplex.dataset.state import DatasetState, upcoming_batches


def tenplex(*args):
    return subprocess.run([sys.executable, "-c", "import sys; from tenplex.cli import main; sys.exit(main())",
                           *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def test_plan_json_contract():
    out = tenplex("data", "plan", "--num-samples", 10, "--seed", 1, "--global-batch", 4, "--dp", 3,
                  "--position", 4, "--steps", 3, "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert list(doc) == ["ranks", "batches", "position"]
    assert doc == upcoming_batches(DatasetState("", 10, 1, 4, 4), 3, 3)
    assert len(doc["ranks"]) == 3 and all(len(b) == 4 for b in doc["batches"])
    assert doc["position"] == 16  # 8 samples per epoch (partial batch dropped): epoch 1, offset 8 -> 0
    chained = json.loads(tenplex("data", "plan", "--num-samples", 10, "--seed", 1, "--global-batch", 4, "--dp", 2,
                                 "--position", 4, "--steps", 1, "--json").stdout)
    assert chained["batches"] == doc["batches"][:1]


def test_plan_errors_are_one_line():
    out = tenplex("data", "plan", "--num-samples", 10, "--seed", 1, "--global-batch", 4, "--dp", 3,
                  "--position", 5, "--steps", 1, "--json")
    assert out.returncode == 2 and "not at a global-batch boundary" in out.stderr
    assert "Traceback" not in out.stderr


def test_pack_info_and_state(tmp_path):
    np.arange(64, dtype=np.int32).tofile(tmp_path / "t.bin")
    out = tenplex("data", "pack", tmp_path / "t.bin", tmp_path / "ds", "--seq-len", 4, "--dtype", "int32")
    assert out.returncode == 0, out.stderr
    info = open_dataset(tmp_path / "ds")
    assert info.num_samples == 16 and info.identity in out.stdout
    assert json.loads(tenplex("data", "info", tmp_path / "ds").stdout)["identity"] == info.identity
    out = tenplex("data", "state", tmp_path / "ds", "--seed", 3, "--global-batch", 4, "--dp", 2, "--position", 8,
                  "-o", tmp_path / "s.json")
    assert out.returncode == 0, out.stderr
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["dp"] == 2 and DatasetState.from_dict(doc) == DatasetState(info.identity, 16, 3, 8, 4)
    bad = tenplex("data", "pack", tmp_path / "t.bin", tmp_path / "ds2", "--seq-len", 5, "--dtype", "int32")
    assert bad.returncode == 2 and "whole number of sequences" in bad.stderr
