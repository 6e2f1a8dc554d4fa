"""A model under DTensor (the example GPT at tp=2) rebuilt in a second world in the same process, as a survivor in
place does: DTensor caches sharding decisions by meshes that compare by layout, not by process group, so without
:func:`tenplex.elastic.leftovers.forget_world` the second world's model gets the first world's (destroyed)
groups. Four real gloo ranks on loopback; the same run without the call must fail (the test would catch a torch
that no longer caches so, or a call that no longer clears)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tenplex.ports import free_port

WORKER = str(Path(__file__).parent / "mp" / "dtensor_worlds_worker.py")


def _run(mode: str) -> list[str]:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, WORKER, str(rank), str(port), mode], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for rank in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    return [out.strip().splitlines()[-1] if out.strip() else f"no output; stderr: {err[-2000:]}" for out, err in outs]


def test_a_dtensor_model_rebuilt_in_the_next_world_of_the_same_process_uses_that_worlds_groups():
    assert _run("forget") == ["ok"] * 4
    stale = _run("keep")  # a rank that failed first ends the others' collectives with a lost peer
    assert "ok" not in stale and any("Could not resolve the process group" in line for line in stale), stale
