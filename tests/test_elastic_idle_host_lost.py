"""An idle host outlives the training host (issues 36 and 40): real `tenplex run --in-place` nodes h0 and h1 (one
worker each; pinned ``dp=1`` for two ranks, so one host trains and the other idles, with its own store), the
worker of tests/test_elastic_inplace_idle.py.

The idle host's store holds no snapshot of the world it idled in (it is in no saved layout and in no replication
ring). When the training worker hangs (SIGSTOP) while its host's store still answers, the idle rank's restore asks
that store (its address is in the job's key-value store) and resumes from its newest committed snapshot, bit for
bit, at most the steps in flight replayed. When the training host dies with its store (SIGKILL), nothing of the
state survives: the survivor starts from scratch and says so, counting every step whose commit the job's
key-value store decided as lost (it said 0 before)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from inplace_nodes import InPlaceNodes, lines, wait_for
from tenplex.elastic.launcher import store_pid
from test_elastic_inplace_idle import WORKER, _check_job, _reference, _stepped, _worlds

import json

import torch


def _run_until_lost(tmp_path: Path, name: str, kill_host: bool):
    """h0 and h1 train one world (one idles); the trainer's worker is stopped (or its whole host killed, store
    included) after step 4; the idle rank trains on alone to the end. Returns the logs, the steps, the final
    file, the trainer's host and the last step it logged."""
    nodes = InPlaceNodes(tmp_path, f"{name}-{os.getpid()}", WORKER)
    outs = {h: tmp_path / f"{h}-out" for h in ("h0", "h1")}
    w = {h: o / "w0.jsonl" for h, o in outs.items()}
    try:
        node = {h: nodes.node(h, outs[h]) for h in ("h0", "h1")}
        wait_for(w["h0"], _stepped(list(w.values()), 1, 4), nodes.procs)
        trainer = next(h for h in w if any("step" in d for d in lines(w[h])))
        idler = "h1" if trainer == "h0" else "h0"
        if kill_host:                                  # the host dies: agent, worker and store
            os.killpg(node[trainer].pid, signal.SIGKILL)
            os.kill(store_pid((tmp_path / trainer).resolve()), signal.SIGKILL)
        else:                                          # the worker hangs; its host's store still answers
            os.kill(next(d["started"] for d in lines(w[trainer]) if "started" in d), signal.SIGSTOP)
        wait_for(w[idler], _stepped([w[idler]], 2, 1), [node[idler]])
        last = max(d["step"] for d in lines(w[trainer]) if "step" in d)
        steps = max(d["step"] for d in lines(w[idler]) if "step" in d) + 2
        (outs[idler] / "steps").write_text(str(max(steps, last + 2)))
        assert node[idler].wait(timeout=120) == 0, nodes.tail(outs[idler])
    finally:
        nodes.close(("h0", "h1"))
    log = {h: lines(p) for h, p in w.items()}
    final = next(outs[idler].glob("final-*.json"))
    return log, json.loads(final.read_text())["step"], final, trainer, idler, last


def test_an_idle_host_resumes_from_the_hung_training_hosts_newest_snapshot(tmp_path):
    log, steps, final, trainer, idler, last = _run_until_lost(tmp_path, "idle-host-hang", kill_host=False)
    worlds = _worlds(log)
    assert [(d["generation"], d["size"], d["idled"]) for d in worlds[trainer]] == [(1, 2, [])]
    (survivor,) = worlds[idler]
    assert (survivor["generation"], survivor["size"], survivor["reasons"]) == (2, 1, ["lost"])
    # from the stopped host's store: its newest committed snapshot, not a fresh start (at most the steps in flight)
    assert last - 2 <= survivor["restored"] <= last, (survivor, last)
    assert 0 <= survivor["lost"] <= last - survivor["restored"], (survivor, last)   # never more than were lost
    _check_job(log, steps, final, lost_in=1)      # bit for bit, each committed sample once, losses, final state


def test_a_survivor_that_holds_no_copy_counts_the_dead_training_hosts_steps_as_lost(tmp_path):
    log, steps, final, trainer, idler, last = _run_until_lost(tmp_path, "idle-host-dead", kill_host=True)
    (survivor,) = _worlds(log)[idler]
    assert (survivor["generation"], survivor["restored"]) == (2, 0), survivor    # nothing of the state survived
    # every step whose snapshot commit was decided is reported lost (at most the steps in flight were not decided)
    assert last - 2 <= survivor["lost"] <= last, (survivor, last)
    # the survivor trained every step again from the start: the uninterrupted run's losses and final state
    done = [d for d in log[idler] if "step" in d]
    assert [d["step"] for d in done] == list(range(1, steps + 1))
    state, losses = _reference(steps)
    for d in done:
        assert abs(d["loss"] - losses[d["step"] - 1]) <= 1e-12 * abs(losses[d["step"] - 1]), d
    params = json.loads(final.read_text())["params"]
    for name, value in state.items():
        assert torch.allclose(torch.tensor(params[name], dtype=torch.float64), value, rtol=1e-12, atol=1e-14), name
