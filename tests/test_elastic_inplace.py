"""Worlds in place end to end: `tenplex run --in-place` on two simulated nodes (real torchrun agents, each node's
own store, a real rendezvous store, gloo). A node SIGKILLed with its whole process group, a replacement that joins
warm (while a snapshot is being written), and its planned leave (SIGTERM) each change the world while the survivor
keeps its process, restoring what it kept from memory (bytes per source pinned); the job ends
where an uninterrupted one does (the worker's float64 steps are the same in every world size), at most one step
lost to the kill, and Prometheus counts each change and its pause."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import torch

from inplace_nodes import InPlaceNodes, lines, wait_for

WORKER = Path(__file__).parent / "mp" / "inplace_worker.py"


def _reference(steps: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        torch.manual_seed(step)
        model(torch.randn(4, 8, dtype=torch.float64)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def test_a_lost_node_a_warm_join_and_a_leave_change_the_world_and_the_survivor_keeps_its_process(tmp_path):
    nodes = InPlaceNodes(tmp_path, f"inplace-{os.getpid()}", WORKER)
    procs, node = nodes.procs, nodes.node
    w0 = tmp_path / "h0" / "w0.jsonl"
    try:
        survivor, lost = node("h0", tmp_path / "h0-out"), node("h1", tmp_path / "h1-out")
        w0 = tmp_path / "h0-out" / "w0.jsonl"
        wait_for(w0, lambda d: d.get("step", 0) >= 3, procs)
        os.killpg(lost.pid, signal.SIGKILL)                        # the node dies: agent, worker
        wait_for(w0, lambda d: d.get("generation") == 2, [survivor])
        hold = tmp_path / "h0-out" / "hold-snapshots"
        hold.touch()                                               # the join finds a snapshot in flight
        joiner = node("h1", tmp_path / "h1-again")                 # a replacement, warm before the world changes
        wait_for(w0, lambda d: d.get("generation") == 3 and "step" in d, [survivor, joiner])
        hold.unlink()
        joiner.send_signal(signal.SIGTERM)                         # a planned leave
        assert joiner.wait(timeout=120) == 0
        wait_for(w0, lambda d: d.get("generation") == 4 and "step" in d, [survivor])
        steps = max(d["step"] for d in lines(w0) if "step" in d) + 3
        (tmp_path / "h0-out" / "steps").write_text(str(steps))    # a world of one rank reads it: the end
        assert survivor.wait(timeout=120) == 0, (tmp_path / "h0-out.log").read_text()[-3000:]
    finally:
        nodes.close()
    worlds = [d for d in lines(w0) if "pid" in d]
    assert [(d["generation"], d["size"], d["reasons"]) for d in worlds] == [
        (1, 2, ["start"]), (2, 1, ["lost"]), (3, 2, ["join"]), (4, 1, ["leave"])]
    pid = worlds[0]["pid"]
    assert {d["pid"] for d in worlds} == {pid}                      # one process through four worlds
    done = [d for d in lines(w0) if "step" in d]
    last = {g: max(d["step"] for d in done if d["generation"] == g) for g in (1, 2, 3)}
    assert last[1] - 1 <= worlds[1]["restored"] <= last[1]          # a kill loses at most the step in flight
    assert worlds[2]["restored"] == last[2] and worlds[3]["restored"] == last[3]  # a planned change loses none
    # the join came while the snapshot of the step before was still being written: the stopping save settled it
    assert any(d.get("snapshot_written") == last[2] - 1 and d["released_by_save"] for d in lines(w0))
    assert [d["generation"] for d in lines(tmp_path / "h1-again" / "w0.jsonl") if "pid" in d] == [3]
    final = json.loads((tmp_path / "h0-out" / f"final-{pid}.json").read_text())
    assert final["step"] == steps
    for name, value in _reference(steps).items():
        assert torch.allclose(torch.tensor(final["params"][name], dtype=torch.float64), value, rtol=1e-12,
                              atol=1e-14), name
    pauses = final["reconfigurations"]
    assert [p["reasons"] for p in pauses] == [["lost"], ["join"], ["leave"]]
    assert all(p["pid"] == pid and p["pause_s"] >= p["re_form_s"] for p in pauses)
    # the killed node's worker was counted dead because its process's connection to the close watch closed, not
    # after its heartbeat's silence (TENPLEX_DEAD_AFTER is 5 s here); the planned changes lost nobody
    assert [list(p["lost_by"].values()) for p in pauses] == [["closed"], [], []]
    # the loop's variables still hold the old world's model and optimizer at each change, but neither holds a
    # process group (plain tensors; the gradients are all-reduced by hand): no group outlived its world
    assert [p["pinned_groups"] for p in pauses] == [0, 0, 0]
    for kind in ("join", "leave", "lost"):
        assert f'tenplex_job_reconfigurations_total{{kind="{kind}",mode="in_place"}} 1.0' in final["metrics"]
    assert "tenplex_job_pause_seconds_count 3.0" in final["metrics"]
    # Restore from memory: after a planned change the survivor keeps its whole (data-parallel) state in memory and
    # reads nothing. After the kill it does so only when its tensors still hold the restored (newest committed)
    # step: the kill came before its next optimizer step and that step's snapshot committed; else its store.
    # The joiner reads all from the survivor's host.
    state = (8 * 8 + 8) * 8  # Linear(8, 8) in float64; plain SGD keeps no state tensors
    kept = {"memory": state, "this_host": 0, "other_hosts": 0}
    read = {"memory": 0, "this_host": state, "other_hosts": 0}
    by_source = [{k: v for k, v in p["bytes"].items() if k != "planned"} for p in pauses]
    assert by_source[0] in (kept, read) and by_source[1:] == [kept, kept]
    if by_source[0] == kept:  # the survivor's tensors held its last finished step: that step was restored
        assert worlds[1]["restored"] == last[1]
    joined = [d for d in lines(tmp_path / "h1-again" / "w0.jsonl") if "pid" in d]
    assert joined[0]["bytes"] == {"memory": 0, "this_host": 0, "other_hosts": state}
    memory = sum(p["bytes"]["memory"] for p in pauses)
    assert f'tenplex_job_restore_bytes_total{{source="memory"}} {float(memory)}' in final["metrics"]
    print(json.dumps([{k: p[k] for k in ("reasons", "pause_s", "agree_s", "re_form_s", "restore_s",
                                         "first_step_s", "bytes")} for p in pauses]))
