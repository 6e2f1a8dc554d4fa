"""Idle ranks in place (issue 36): `tenplex run --in-place` nodes (real torchrun agents, stores, a rendezvous
store, gloo), the policy pinned to ``dp=1`` for two ranks (one rank idles) and ``dp=3`` for three.

On three nodes, the rank that idles in the first world keeps its process throughout: a warm join makes it train,
the joiner's planned leave makes it idle again (a training rank becomes idle), and it ends when the training rank
finishes. On one node of two workers, the training rank hangs (SIGSTOP: no word, no reset, only its heartbeat
stops): the idle rank's own heartbeat view ends its wait and it trains on alone. In both, every process keeps its
pid and the idle rank went back to the loop (never restarted); every committed sample is trained exactly once,
each world restores bit for bit the state of a step the old world finished (a planned change loses none, the
hang at most the steps in flight), the losses and the final state equal an uninterrupted run's, and a world after
the changes holds the groups and threads an earlier one of its shape held (no subgroup leaked)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import torch

from inplace_nodes import InPlaceNodes, lines, wait_for

WORKER = Path(__file__).parent / "mp" / "inplace_idle_worker.py"


def _reference(steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        torch.manual_seed(step)
        loss = model(torch.randn(4, 8, dtype=torch.float64)).square().mean()
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict(), losses


def _stepped(paths: list[Path], generation: int, at_least: int = 1):
    """A predicate for :func:`wait_for`: a step line of ``generation`` (``at_least`` or later) in any of ``paths``."""
    return lambda _: any(d.get("generation") == generation and d.get("step", 0) >= at_least for p in paths
                         for d in lines(p))


def _worlds(log: dict[str, list[dict]]) -> dict[str, list[dict]]:
    return {w: [d for d in docs if "generation" in d and "pid" in d] for w, docs in log.items()}


def _check_job(log: dict[str, list[dict]], steps: int, final: Path, lost_in: int | None = None) -> None:
    """What every run promises: one process per worker, never restarted; restores bit for bit and no step lost
    by a planned change (at most the steps in flight of world ``lost_in``); every committed sample exactly once;
    losses and the final state equal an uninterrupted run's."""
    for w, docs in log.items():
        started = [d for d in docs if "started" in d]
        assert [d["restarts"] for d in started] == [0], (w, started)
        assert {d["pid"] for d in docs if "pid" in d} == {started[0]["started"]}, w
    done = [d for docs in log.values() for d in docs if "step" in d]
    restored = {d["generation"]: d["restored"] for ws in _worlds(log).values() for d in ws}
    for g in sorted(restored)[1:]:
        last = max(d["step"] for d in done if d["generation"] == g - 1)
        assert last - (2 if g - 1 == lost_in else 0) <= restored[g] <= last, (g, last, restored)
    digests = {(d["generation"], d["step"]): d["digest"] for d in done}
    for w, ws in _worlds(log).items():                               # restored bit for bit
        for d in ws:
            if d["generation"] > 1:
                assert d["digest"] == digests[(d["generation"] - 1, d["restored"])], (w, d)
    committed = [d for d in done if d["generation"] != lost_in or d["step"] <= restored[lost_in + 1]]
    assert sorted(s for d in committed for s in d["samples"]) == list(range(4 * steps))  # each sample once
    state, losses = _reference(steps)
    for step in range(1, steps + 1):
        total = sum(d["loss"] for d in committed if d["step"] == step)
        assert abs(total - losses[step - 1]) <= 1e-12 * abs(losses[step - 1]), (step, total, losses[step - 1])
    params = json.loads(final.read_text())["params"]
    assert json.loads(final.read_text())["step"] == steps
    for name, value in state.items():
        assert torch.allclose(torch.tensor(params[name], dtype=torch.float64), value, rtol=1e-12, atol=1e-14), name


def test_an_idle_rank_trains_after_a_join_and_idles_again_after_a_leave_in_the_same_process(tmp_path):
    nodes = InPlaceNodes(tmp_path, f"inplace-idle-{os.getpid()}", WORKER)
    procs, node = nodes.procs, nodes.node
    outs = {h: tmp_path / f"{h}-out" for h in ("h0", "h1", "h2")}
    w = {h: o / "w0.jsonl" for h, o in outs.items()}
    try:
        first = {h: node(h, outs[h]) for h in ("h0", "h1")}
        wait_for(w["h0"], _stepped([w["h0"], w["h1"]], 1, 2), procs)            # world 1: one trains, one idles
        joiner = node("h2", outs["h2"])                                          # world 2: all three train
        wait_for(w["h2"], _stepped([w["h2"]], 2), procs)
        joiner.send_signal(signal.SIGTERM)                                        # world 3: one idles again
        assert joiner.wait(timeout=120) == 0, nodes.tail(outs["h2"])
        wait_for(w["h0"], _stepped([w["h0"], w["h1"]], 3), list(first.values()))
        steps = max(d["step"] for h in w for d in lines(w[h]) if "step" in d) + 2
        for o in outs.values():
            (o / "steps").write_text(str(steps))
        for h, p in first.items():
            assert p.wait(timeout=120) == 0, nodes.tail(outs[h])
    finally:
        nodes.close(("h0", "h1", "h2"))
    log = {h: lines(p) for h, p in w.items()}
    worlds = _worlds(log)
    idler = next(h for h in ("h0", "h1") if [d["generation"] for d in worlds[h]] == [2])
    trainer = "h1" if idler == "h0" else "h0"
    assert [(d["generation"], d["size"], d["dp"]) for d in worlds[trainer]] == [(1, 2, 1), (2, 3, 3), (3, 2, 1)]
    assert [(d["generation"], d["dp"]) for d in worlds["h2"]] == [(2, 3)]
    # the idle rank went back to the loop: it trained in world 2 after idling through world 1, then idled
    # through world 3 and ended when the training rank finished
    assert [(d["generation"], d["reasons"], d["idled"]) for d in worlds[idler]] == [(2, ["join"], [1])]
    assert [(d["exit"], d["why"], d["idle_worlds"]) for d in log[idler] if "exit" in d] == [
        (0, "the training ranks finished", [1, 3])]
    assert [d["exit"] for d in log["h2"] if "exit" in d] == [0]
    _check_job(log, steps, next(outs[trainer].glob("final-*.json")))
    changes = json.loads(next(outs[trainer].glob("final-*.json")).read_text())["reconfigurations"]
    assert [p["pinned_groups"] for p in changes] == [0, 0]          # nothing of an old world held its groups
    census = [d["census"] for d in worlds[trainer]]
    assert census[2] == census[0], census                           # world 1's subgroup is gone (same shape)
    assert worlds[idler][0]["census"] == census[1], census          # nothing of the idle world is left
    print(json.dumps({"census": census, "worlds": [(d["generation"], d["restored"]) for d in worlds[trainer]]}))


def test_an_idle_rank_notices_a_hung_training_rank_by_its_heartbeat_and_trains_on(tmp_path):
    nodes = InPlaceNodes(tmp_path, f"inplace-idle-hang-{os.getpid()}", WORKER)
    out = tmp_path / "h0-out"
    w = {r: out / f"w{r}.jsonl" for r in (0, 1)}
    try:
        node = nodes.node("h0", out, nnodes=1, per_node=2)                       # world 1: one trains, one idles
        wait_for(w[0], _stepped(list(w.values()), 1, 2), [node])
        trainer = next(r for r in w if any("step" in d for d in lines(w[r])))
        idler = 1 - trainer
        os.kill(next(d["started"] for d in lines(w[trainer]) if "started" in d), signal.SIGSTOP)  # it hangs
        wait_for(w[idler], _stepped([w[idler]], 2, 2), [node])                  # world 2: the idle one alone
        steps = max(d["step"] for d in lines(w[idler]) if "step" in d) + 2
        (out / "steps").write_text(str(steps))
        wait_for(w[idler], lambda d: d.get("step") == steps, [node])
        final = out / f"final-{next(d['started'] for d in lines(w[idler]) if 'started' in d)}.json"
        wait_for(w[idler], lambda d: final.exists(), [node])
    finally:
        nodes.close(("h0",))                                                      # the stopped worker with it
    log = {str(r): lines(p) for r, p in w.items()}
    worlds = _worlds(log)
    assert [(d["generation"], d["size"], d["dp"], d["idled"]) for d in worlds[str(trainer)]] == [(1, 2, 1, [])]
    assert [(d["generation"], d["size"], d["reasons"], d["idled"]) for d in worlds[str(idler)]] == [
        (2, 1, ["lost"], [1])]
    _check_job(log, steps, final, lost_in=1)
