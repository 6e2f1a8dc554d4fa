"""Faults in place with real `tenplex run --in-place` nodes (torchrun agents, stores, a rendezvous store, gloo;
the worker of tests/test_elastic_inplace.py). Node h1's worker crashes in user code: its own agent restarts it
alone (h0's process goes on), and the restart counts against ``--max-restarts 1``. The restarted worker crashes
again while building the model of the world it just joined, before that world's first step: a second failure
during a change. h0, which was restoring in that world, moves on to one more change instead of hanging, and the
job ends where an uninterrupted one does.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import torch

from inplace_nodes import InPlaceNodes, lines, wait_for
from test_elastic_inplace import WORKER, _reference


def test_a_crash_restarts_the_worker_alone_and_a_second_failure_during_the_change_leads_to_one_more(tmp_path):
    nodes = InPlaceNodes(tmp_path, f"faults-{os.getpid()}", WORKER)
    procs = nodes.procs

    def node(host: str, *options: str) -> subprocess.Popen:
        return nodes.node(host, tmp_path / f"{host}-out", *options)

    w0, w1 = tmp_path / "h0-out" / "w0.jsonl", tmp_path / "h1-out" / "w0.jsonl"
    try:
        survivor, crashing = node("h0"), node("h1", "--max-restarts", "1")
        wait_for(w1, lambda d: d.get("generation") == 1 and "step" in d, procs)  # the first world trains
        at = tmp_path / "h1-out" / "crash-at.tmp"
        at.write_text(str(max(d["step"] for d in lines(w1) if "step" in d) + 2))
        at.rename(at.with_name("crash-at"))                                   # h1's worker crashes at that step
        assert crashing.wait(timeout=240) != 0, nodes.tail(tmp_path / "h1-out")  # restarts exhausted
        wait_for(w0, lambda d: d.get("size") == 1 and d.get("generation", 0) > _building(w1), [survivor])
        steps = max(d["step"] for d in lines(w0) if "step" in d) + 3
        (tmp_path / "h0-out" / "steps").write_text(str(steps))
        assert survivor.wait(timeout=120) == 0, nodes.tail(tmp_path / "h0-out")
    finally:
        nodes.close()
    first = [d for d in lines(w1) if "pid" in d and "size" in d]
    building = [d for d in lines(w1) if "building" in d]
    assert [d["restarts"] for d in first] == [0] and len(building) == 1        # one restart, crashed in its build
    assert building[0]["pid"] != first[0]["pid"]                               # a new process on h1 ...
    worlds = [d for d in lines(w0) if "size" in d]
    assert len({d["pid"] for d in worlds}) == 1 and worlds[0]["restarts"] == 0  # ... h0's went on, never restarted
    g = building[0]["building"]
    assert g not in [d["generation"] for d in worlds]    # h0 never finished restoring in that world: no first step
    assert worlds[-1]["generation"] > g and worlds[-1]["size"] == 1 and "lost" in worlds[-1]["reasons"]
    final = json.loads((tmp_path / "h0-out" / f"final-{worlds[0]['pid']}.json").read_text())
    assert final["step"] == steps
    for name, value in _reference(steps).items():  # sums over other world sizes: float64 rounding apart
        assert torch.allclose(torch.tensor(final["params"][name], dtype=torch.float64), value, rtol=1e-12,
                              atol=1e-14), name
    print(json.dumps([{k: d[k] for k in ("generation", "size", "reasons", "restored", "bytes")} for d in worlds]))


def _building(path: Path) -> int:
    """The generation h1's restarted worker was building when it crashed (a large number until then)."""
    return next((d["building"] for d in lines(path) if "building" in d), 10**9)
