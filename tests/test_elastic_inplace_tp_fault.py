"""A rank lost in the middle of a tp job in place becomes an error on the survivor still in a collective.

Issue 36 ("collectives never hang"): ``tenplex bench goodput --trace gpufail:h1/1@3 --modes tenplex-inplace-tp``
hung for the group's whole timeout (120 s; gloo does not fail a recv from a peer that is alive but gone
elsewhere) at times. h1/1's device failed; h0/1 and h1/0 saw the error, left the world and waited for the next
one, while h0/0 stayed in the step's last all-reduce over the world group: the departed ranks kept the old
model for a restore from memory (:class:`tenplex.integration.memory.Kept`), its DTensors kept their mesh, the
mesh kept the old world's groups, and the groups kept their connections to h0/0 open. Four real processes
(tests/mp/kept_release_worker.py) replay that: rank 0 must fail with a lost peer's error (the connection closed),
not gloo's timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tenplex.elastic import faults

WORKER = Path(__file__).parent / "mp" / "kept_release_worker.py"


def test_ranks_that_left_with_their_kept_state_release_the_survivor_blocked_in_a_collective(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(tmp_path), str(rank)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(4)]
    try:
        out, err = procs[0].communicate(timeout=240)
    finally:
        (tmp_path / "done").touch()
        rest = [p.communicate(timeout=60) for p in procs[1:]]
    assert procs[0].returncode == 0, err[-3000:]
    assert [p.returncode for p in procs[1:]] == [0, 0, 76], [e[-2000:] for _, e in rest]
    error = json.loads(out.splitlines()[-1])["error"]
    assert error is not None
    assert "Timed out" not in error, error  # the old hang: rank 0 sat out the group's timeout
    assert faults.classify(RuntimeError(error)) == faults.PEER, error
