"""A committed snapshot survives the loss of any one host (issue 40), on real ``tenplex run`` agents and stores.

Data-parallel training on three emulated nodes (one worker each), snapshots every step
(``mp/ddp_kill_worker.py``). First the node that holds rank 0 (agent, worker, store) is SIGKILLed once the commit
of step 3's snapshot is decided (every rank prepared; the rank-0 host committed it) while the other hosts have
not committed it yet (their commit is held back): the next world resumes from step 3, nothing replayed. Then,
in that world of two nodes, its rank-0 node is SIGKILLed in the middle of its background write of step 7's
snapshot, after the other host prepared its part: the last node resumes from step 7 (the snapshot its surviving
ranks all prepared). Every restore is bit for bit the state saved at its step and the reference's, every step's
samples are trained exactly once in the final history, and the losses equal an uninterrupted run's. The same on
an emulated cluster (every node in a network namespace of its own) with the rank-0 node's link cut instead of a
SIGKILL: the cut-off node's processes keep running, unreachable, and the others resume from the decided step.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mp.ddp_kill_worker import reference
from store_helpers import assert_bit_equal
from tenplex.cluster import emulated
from tenplex.elastic.demo import LINKED_TCP_RETRIES
from tenplex.elastic.nodes import Nodes
from tenplex.integration.versions import STATE_DOC
from tenplex.store import Store

REASON = emulated.unavailable()
linked = pytest.mark.skipif(REASON is not None, reason=f"emulated cluster unavailable: {REASON}")
WORKER = Path(__file__).parent / "mp" / "ddp_kill_worker.py"
STEPS, FIRST, SECOND = 9, 3, 6
CUT_STEPS = 5


def committed_step(root: Path, host: str) -> int | None:
    store = Store(root, host)
    latest = store.latest()
    if latest is None:
        return None
    reader = store.open(latest)
    try:
        return reader.get_json(STATE_DOC)["step"]
    finally:
        reader.close()


def prepared_next(root: Path, host: str) -> bool:
    """Whether ``host`` prepared its part of the version after its newest committed one."""
    store = Store(root, host)
    return bool(store.staged_parts((store.latest() or 0) + 1))


def wait_for(what: str, ready, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def held_world(out: Path, step: int, hosts: list[str]) -> bool:
    worlds = {(out / f"held-{step}-{h}").read_text() if (out / f"held-{step}-{h}").exists() else None for h in hosts}
    return len(worlds) == 1 and None not in worlds


def rank0_host(out: Path, hosts: list[str], world: str) -> str:
    for host in hosts:
        for line in (out / f"{host}.jsonl").read_text().splitlines():
            doc = json.loads(line)
            if doc.get("world") == world and doc.get("rank") == 0:
                return host
    raise AssertionError(f"no rank 0 of world {world}")


def test_the_rank0_host_dies_after_a_committed_snapshot_and_during_the_next_write(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "holds").write_text(f"{FIRST},{SECOND}")
    (out / "late-commit").write_text(str(FIRST))
    (out / "slow").write_text(str(SECOND))
    hosts = ["h0", "h1", "h2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with Nodes(tmp_path, 1, 3, [str(WORKER), str(out), str(STEPS)], env=env) as nodes:
        nodes.start_rendezvous()
        for host in hosts:
            nodes.start(host)
        wait_for(f"three nodes hold at step {FIRST}", lambda: held_world(out, FIRST, hosts))
        dead = rank0_host(out, hosts, (out / f"held-{FIRST}-h0").read_text())
        survivors = [h for h in hosts if h != dead]
        # Decided: the rank-0 host committed it (every rank prepared); the others hold their prepared parts.
        wait_for(f"the commit of step {FIRST} is decided", lambda: committed_step(nodes.root(dead), dead) == FIRST
                 and all(prepared_next(nodes.root(h), h) for h in survivors))
        nodes.fail(dead)
        (out / f"go-{FIRST}").touch()
        wait_for(f"two nodes hold at step {SECOND}", lambda: held_world(out, SECOND, survivors))
        world = (out / f"held-{SECOND}-{survivors[0]}").read_text()
        wait_for(f"both committed step {SECOND}",
                 lambda: all(committed_step(nodes.root(h), h) == SECOND for h in survivors))
        second_dead = rank0_host(out, survivors, world)
        last = [h for h in survivors if h != second_dead]
        (out / f"go-{SECOND}").touch()
        wait_for("rank 0 writes the next snapshot and the other host prepared it",
                 lambda: (out / "writing").exists() and prepared_next(nodes.root(last[0]), last[0]))
        nodes.fail(second_dead)
        codes = nodes.wait(240)
        assert codes[last[0]] == 0, (nodes.log(last[0]).read_text()[-3000:])

    check_history(out, hosts, STEPS, [FIRST, SECOND + 1])  # the newest decided, or prepared, step


@linked
def test_the_rank0_hosts_link_is_cut_after_a_committed_snapshot(tmp_path):
    """The same on an emulated cluster, with the rank-0 node's link cut instead: its agent, worker and store keep
    running but no packet gets in or out (no reset), once step 3's commit is decided and the other hosts have not
    committed it yet. The two others resume from step 3 without reaching the cut-off node."""
    from tenplex.cluster import EmulatedCluster

    out = tmp_path / "out"
    out.mkdir()
    (out / "holds").write_text(str(FIRST))
    (out / "late-commit").write_text(str(FIRST))
    hosts = ["h0", "h1", "h2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    script = [str(WORKER), str(out), str(CUT_STEPS)]
    with EmulatedCluster(hosts, tcp_retries=LINKED_TCP_RETRIES) as cluster, \
            Nodes(tmp_path, 1, 3, script, env=env, cluster=cluster) as nodes:
        nodes.start_rendezvous()
        for host in hosts:
            nodes.start(host)
        wait_for(f"three nodes hold at step {FIRST}", lambda: held_world(out, FIRST, hosts))
        cut = rank0_host(out, hosts, (out / f"held-{FIRST}-h0").read_text())
        survivors = [h for h in hosts if h != cut]
        wait_for(f"the commit of step {FIRST} is decided", lambda: committed_step(nodes.root(cut), cut) == FIRST
                 and all(prepared_next(nodes.root(h), h) for h in survivors))
        nodes.partition(cut)
        (out / f"go-{FIRST}").touch()
        codes = nodes.wait(240)
        assert all(codes[h] == 0 for h in survivors), nodes.log(survivors[0]).read_text()[-3000:]
        assert codes[cut] != 0  # the cut-off node gave up on its own
    check_history(out, hosts, CUT_STEPS, [0, FIRST])


def check_history(out: Path, hosts: list[str], steps: int, last_restores: list[int]) -> None:
    """The run's restores and history: the last worlds restored ``last_restores`` (one step each), every restore is
    bit for bit the reference's state at its step and the state the previous world dumped there, each step's
    samples are trained exactly once in the final history with the reference's loss, committed/protected steps are
    reported, and no step a world finished is trained again by the next world."""
    losses, states = reference(steps)
    lines = [json.loads(line) for h in hosts for line in (out / f"{h}.jsonl").read_text().splitlines()]
    restored = [d for d in lines if "restored" in d]
    worlds = sorted({d["world"] for d in restored}, key=lambda w: min(d["at"] for d in restored if d["world"] == w))
    steps_of = {w: sorted({d["restored"] for d in restored if d["world"] == w}) for w in worlds}
    assert [steps_of[w] for w in worlds][-len(last_restores):] == [[s] for s in last_restores]
    for w in worlds:
        step = steps_of[w][0]
        got = load_file(out / f"restored-{w}.safetensors")
        assert_bit_equal(got, states[step])  # bit for bit the reference's state at that step
        if step:
            saved = [p for p in out.glob(f"state-{step}-*.safetensors") if not p.name.endswith(f"-{w}.safetensors")]
            assert saved and all(_equal(load_file(p), got) for p in saved)
    # The final history: each step from the last world that finished it; its samples exactly once, its loss the
    # reference's.
    final: dict[int, tuple[int, list[dict]]] = {}
    for d in lines:
        if "step" in d:
            order = worlds.index(d["world"])
            if d["step"] not in final or final[d["step"]][0] < order:
                final[d["step"]] = (order, [])
            if final[d["step"]][0] == order:
                final[d["step"]][1].append(d)
    assert sorted(final) == list(range(1, steps + 1))
    for step, (_, done) in final.items():
        assert sorted(i for d in done for i in d["ids"]) == list(range((step - 1) * 6, step * 6))
        assert {d["loss"] for d in done} == {losses[step - 1]}
    # Under DDP each host holds every region: a step a world of two hosts or more committed survives the loss of
    # one; in the last world (one host) none does.
    ranks = {w: len([d for d in restored if d["world"] == w]) for w in worlds}
    for d in lines:
        if "step" in d and d["step"] > steps_of[d["world"]][0] + 1:
            assert d["committed"] is not None
            assert d["protected"] == (d["committed"] if ranks[d["world"]] > 1 else None)
    for before, after in zip(worlds, worlds[1:]):  # no step that a world finished is trained again by the next
        assert max(d["step"] for d in lines if d.get("world") == before and "step" in d) <= steps_of[after][0]



def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_which_staged_version_is_rolled_forward():
    """Golden cases of the decision every rank takes from the gathered reports (``rollforward.chosen``)."""
    from tenplex.integration.rollforward import chosen

    def doc(host, latest, staged=None):
        return {"host": host, "latest": latest, "staged": staged or {}}
    whole = {"5": {"hosts": ["h0", "h1", "h2"], "complete": True, "parts": ["rank1"]}}
    half = {"5": {"hosts": ["h0", "h1", "h2"], "complete": False, "parts": ["rank1"]}}
    assert chosen([doc("h1", 4), doc("h2", 4)]) is None  # nothing staged
    assert chosen([doc("h1", 4, whole), doc("h2", 4, whole)]) == 5  # h0, the only one not prepared, is lost
    assert chosen([doc("h1", 5), doc("h2", 4, whole)]) == 5  # h1 committed it, h2 prepared it
    assert chosen([doc("h1", 4, whole), doc("h2", 4, half)]) is None  # a rank of a job host did not prepare
    assert chosen([doc("h1", 4, whole), doc("h2", 4)]) is None  # nothing of it on a job host
    assert chosen([doc("h0", 4), doc("h1", 4, whole), doc("h2", 4, whole)]) is None  # h0 is back, unprepared
    assert chosen([doc("h1", 6, whole), doc("h2", 4, whole)]) is None  # a newer version is committed
