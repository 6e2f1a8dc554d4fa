"""Leaving a process group frees it before the interpreter exits: no gloo thread is left to abort the process
when it releases a collective's tensors during finalization (pytorch issue 190489). Real gloo ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tenplex.ports import free_port

WORKER = Path(__file__).parent / "mp" / "leave_worker.py"


def _threads_after_leaving(tmp_path: Path, mode: str) -> list[list[str]]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(tmp_path), mode],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(port), OMP_NUM_THREADS="1"))
             for r in range(2)]
    assert [p.wait(timeout=180) for p in procs] == [0, 0]
    return [json.loads((tmp_path / f"threads-r{r}.json").read_text()) for r in range(2)]


def test_leaving_joins_every_gloo_thread(tmp_path):
    for names in _threads_after_leaving(tmp_path, "tenplex"):
        assert not [n for n in names if n.startswith(("pt_gloo", "gloo_"))], names


def test_without_it_an_optimizer_created_after_joining_keeps_the_group_alive(tmp_path):
    # The control that makes the test above meaningful: torch alone leaves the gloo worker threads running.
    for names in _threads_after_leaving(tmp_path, "plain"):
        assert "pt_gloo_runloop" in names, names
