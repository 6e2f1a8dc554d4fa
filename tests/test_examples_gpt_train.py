"""Run examples/01-gpt-train shortened: train under tp=2, save, resume under pp=2 (a store process serving)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tenplex.runtime.hosts import Hosts

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "01-gpt-train"
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _train(nproc: int, parallel: str, steps: int, env: dict) -> str:
    # --standalone: torchrun picks a free port itself (no race with other processes on this machine).
    result = subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc),
                             str(EXAMPLE / "train.py"), "--parallel", parallel, "--steps", str(steps)],
                            env=env, capture_output=True, text=True, timeout=300, cwd=EXAMPLE)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_example_trains_saves_and_resumes_under_another_configuration(tmp_path):
    with Hosts(tmp_path) as stores:
        stores.start("h0")
        env = dict(os.environ, TENPLEX_STORE_ROOT=str(stores.root("h0")), TENPLEX_HOST="h0",
                   TENPLEX_STORES=f"h0={stores.addresses['h0']}", OMP_NUM_THREADS="1")
        first = _train(2, "tp=2", 2, env)
        assert "fresh start" in first and "saved step 2 as version 1" in first
        second = _train(2, "pp=2", 4, env)
    # One host: each pipeline stage assembles its whole tensors from the two tp shards in the store files.
    assert "restored step 2 (transformed: False)" in second
    steps = [int(s) for s in re.findall(r"^step\s+(\d+)", second, flags=re.M)]
    assert steps == [3, 4]
    assert "saved step 4 as version 2" in second
