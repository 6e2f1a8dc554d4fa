"""A user's reference to an old world's model pins that world's process groups (issue 36): `tenplex run
--in-place`, a node of two workers training the example GPT, then a warm join of a second node. One worker keeps
its first world's trainer in a variable (its DeviceMesh holds the world's gloo groups); the other drops it. At the
change, the worker that keeps it logs one warning naming the variable and what to drop, and its record of the
change counts the groups still alive; the other logs nothing and counts none. Both go on training in the new
world (a warning, not an error)."""

from __future__ import annotations

import os
from pathlib import Path

from inplace_nodes import InPlaceNodes, lines, wait_for

WORKER = Path(__file__).parent / "mp" / "pinned_worker.py"


def test_a_kept_old_trainer_is_named_in_one_warning_and_counted_and_a_dropped_one_is_not(tmp_path):
    nodes = InPlaceNodes(tmp_path, f"pinned-{os.getpid()}", WORKER)
    procs, node = nodes.procs, nodes.node
    outs = {"h0": tmp_path / "h0-out", "h1": tmp_path / "h1-out"}
    keeper, dropper = outs["h0"] / "w0.jsonl", outs["h0"] / "w1.jsonl"
    try:
        first = node("h0", outs["h0"], nnodes=1, per_node=2)                    # world 1: h0's two workers
        wait_for(keeper, lambda d: d.get("generation") == 1 and "step" in d, procs)
        joiner = node("h1", outs["h1"], nnodes=1)                                 # world 2: with h1's worker
        wait_for(keeper, lambda d: d.get("generation") == 2 and "step" in d, procs)
        steps = max(d["step"] for d in lines(keeper) if "step" in d) + 1
        for o in outs.values():
            (o / "steps").write_text(str(steps))
        for h, p in (("h0", first), ("h1", joiner)):
            assert p.wait(timeout=120) == 0, nodes.tail(outs[h])
    finally:
        nodes.close()
    for w in (keeper, dropper):
        assert [(d["generation"], d["size"]) for d in lines(w) if "pid" in d] == [(1, 2), (2, 3)]
        assert len({d["pid"] for d in lines(w) if "pid" in d}) == 1             # in place: one process
    warnings = [d["warning"] for d in lines(keeper) if "warning" in d]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("world 1: ") and "process groups outlived it, held by kept (Trainer) in " \
        "<module>() (pinned_worker.py:" in warnings[0], warnings[0]
    assert "drop every reference to the old world's model" in warnings[0]
    assert [d["warning"] for d in lines(dropper) if "warning" in d] == []
    changes = {w: next(d["reconfigurations"] for d in lines(w) if "reconfigurations" in d) for w in (keeper, dropper)}
    assert [c["pinned_groups"] for c in changes[dropper]] == [0]
    assert [c["pinned_groups"] > 0 for c in changes[keeper]] == [True]
