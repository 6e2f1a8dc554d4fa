"""A DTensor model rebuilt with another tp in the same process (issue 36): `tenplex run --in-place` on two
simulated nodes (real torchrun agents, stores, rendezvous store, gloo), the tiny GPT pinned to tp=2 on two ranks
and tp=1 on one. A planned leave takes the survivor from tp=2 to tp=1, a warm join back to tp=2: one process
through the three worlds, each restore bit for bit the state it held at the old world's last step, losses equal
an uninterrupted tp=1 run's, and the third world holds exactly the process groups, gloo threads, threads and
file descriptors the first one held (nothing of the first two worlds, their DeviceMeshes included, is left)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from inplace_nodes import InPlaceNodes, lines, wait_for

WORKER = Path(__file__).parent / "mp" / "inplace_tp_worker.py"


def test_a_dtensor_model_is_rebuilt_with_another_tp_in_the_same_process(tmp_path):
    nodes = InPlaceNodes(tmp_path, f"inplace-tp-{os.getpid()}", WORKER)
    procs, node, env = nodes.procs, nodes.node, nodes.env
    out = tmp_path / "h0-out"
    w = out / "w.jsonl"
    try:
        survivor, leaver = node("h0", out), node("h1", tmp_path / "h1-out")
        wait_for(w, lambda d: d.get("generation") == 1 and d.get("size") == 2, procs)  # both in one tp=2 world
        wait_for(w, lambda d: d.get("step", 0) >= 2, procs)
        leaver.send_signal(signal.SIGTERM)                                       # a planned leave: tp=2 -> tp=1
        assert leaver.wait(timeout=120) == 0, (tmp_path / "h1-out.log").read_text()[-3000:]
        wait_for(w, lambda d: "step" in d and d["generation"] >= 2, [survivor])
        joiner = node("h1", tmp_path / "h1-again")                               # a warm join: tp=1 -> tp=2
        wait_for(w, lambda d: "step" in d and d["generation"] >= 3, [survivor, joiner])
        steps = max(d["step"] for d in lines(w) if "step" in d) + 2
        for o in (out, tmp_path / "h1-again"):
            (o / "steps").write_text(str(steps))
        for p in (survivor, joiner):
            assert p.wait(timeout=120) == 0, (tmp_path / "h0-out.log").read_text()[-3000:]
        ref = subprocess.run([sys.executable, str(WORKER), "--reference", str(tmp_path), str(steps)], env=env,
                             capture_output=True, text=True, timeout=120)
        assert ref.returncode == 0, ref.stderr[-3000:]
    finally:
        nodes.close()
    worlds = [d for d in lines(w) if "pid" in d]
    assert [(d["generation"], d["size"], d["tp"]) for d in worlds] == [(1, 2, 2), (2, 1, 1), (3, 2, 2)]
    assert len({d["pid"] for d in worlds}) == 1                          # one process through three worlds
    done = {d["step"]: d for d in lines(w) if "step" in d}
    for before, after in zip(worlds, worlds[1:]):                       # a planned change loses no step
        assert after["restored"] == max(s for s, d in done.items() if d["generation"] == before["generation"])
        assert after["same_as_held"] is True                           # restored bit for bit
    reference = json.loads((tmp_path / "reference.json").read_text())
    assert sorted(done) == list(range(1, steps + 1))
    for step, d in done.items():                                      # tp changes the sums' order only
        assert abs(d["loss"] - reference[step - 1]) <= 1e-5 * abs(reference[step - 1]), (step, d, reference)
    first, third = worlds[0]["census"], worlds[2]["census"]
    assert third == first, (first, worlds[1]["census"], third)         # nothing of worlds 1 and 2 is left
    print(json.dumps([{k: d[k] for k in ("generation", "tp", "restored", "census")} for d in worlds]))
