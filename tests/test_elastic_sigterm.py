"""A SIGTERM in the middle of a step: the ranks finish the step, agree at the boundary, save and exit; a rank
killed in the middle of that save leaves no version behind, only the previous one. Real gloo ranks, a real
store directory; the step interval and the saving cost rule have golden values."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from tenplex.box import Box
from tenplex.elastic import auto_interval
from tenplex.elastic.faults import EXIT_PEER_LOST
from tenplex.ports import free_port
from tenplex.store import Store

WORKER = Path(__file__).parent / "mp" / "sigterm_worker.py"


def _start(tmp_path: Path, mode: str, world: int = 2) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", TENPLEX_HOST="h0",
                   TENPLEX_STORE_ROOT=str(tmp_path / "h0"))
        log = open(tmp_path / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(tmp_path), mode], env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
    return procs


def _wait_for(path: Path, predicate, procs, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text() if path.exists() else ""
        if text and predicate(text):
            return text
        assert time.monotonic() < deadline, f"timed out waiting for {path}"
        assert all(p.poll() is None for p in procs), "a rank exited early"
        time.sleep(0.01)


def _stored(root: Path, version: int) -> dict[str, np.ndarray]:
    reader = Store(root, "h0").open(version)
    return {name: reader.read("h0/0", name, Box.whole(tuple(shape)))
            for name, shape in (("weight", (8, 8)), ("bias", (8,)))}


def test_sigterm_mid_step_gives_one_consistent_save(tmp_path):
    procs = _start(tmp_path, "normal")
    try:
        # Rank 1 is inside step 4 (index 3) when SIGTERM arrives; it finishes that step first.
        _wait_for(tmp_path / "r1.in-step", lambda t: int(t) >= 3, procs)
        procs[1].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    exits = [json.loads((tmp_path / f"exit-r{r}.json").read_text()) for r in range(2)]
    # The rank that got SIGTERM exits 0 (its agent stops it); its peer exits so that its agent restarts it.
    assert codes == [EXIT_PEER_LOST, 0] and [e["code"] for e in exits] == codes
    stop = exits[0]["step"]
    assert exits[1]["step"] == stop and stop >= 4
    steps = [int(s) for s in (tmp_path / "steps-r1.txt").read_text().split()]
    assert steps[-1] == stop  # the step in progress was finished, not cut off
    store = Store(tmp_path / "h0", "h0")
    newest = max(store.versions())
    state = store.open(newest).get_json("tenplex.torch_state")
    assert state["step"] == stop
    saved = load_file(str(tmp_path / f"saved-{stop}-r0.safetensors"))
    stored = _stored(tmp_path / "h0", newest)
    assert all(saved[k].tobytes() == stored[k].tobytes() for k in stored)


def test_killed_in_the_middle_of_the_stopping_save_leaves_the_previous_version(tmp_path):
    procs = _start(tmp_path, "slow-save")
    try:
        _wait_for(tmp_path / "r1.in-step", lambda t: int(t) >= 3, procs)
        procs[1].send_signal(signal.SIGTERM)
        _wait_for(tmp_path / "r0.saving", lambda t: True, procs)
        for p in procs:  # torchrun's kill timeout ran out, or the host died, during the save
            p.kill()
            p.wait()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    store = Store(tmp_path / "h0", "h0")
    assert store.versions() == [1]  # the periodic save at step 2; the stopping save never became visible
    assert store.open(1).get_json("tenplex.torch_state")["step"] == 2
    saved = load_file(str(tmp_path / "saved-2-r0.safetensors"))
    stored = _stored(tmp_path / "h0", 1)
    assert all(saved[k].tobytes() == stored[k].tobytes() for k in stored)


def test_an_idle_rank_waits_until_the_training_ranks_finish(tmp_path):
    # Three ranks pinned to dp=2: rank 2 trains nothing, saves nothing, and exits when the others finish.
    procs = _start(tmp_path, "three-steps", world=3)
    try:
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert codes == [0, 0, 0]
    exits = [json.loads((tmp_path / f"exit-r{r}.json").read_text()) for r in range(3)]
    assert exits[2]["why"] == "the training ranks finished" and not (tmp_path / "steps-r2.txt").exists()
    store = Store(tmp_path / "h0", "h0")
    layout = store.open(max(store.versions())).get_json("layout")
    assert store.open(max(store.versions())).get_json("tenplex.torch_state")["step"] == 3
    assert sorted(layout["devices"]) == ["h0/0"]  # the dp replicas on one host are written once; h0/2 holds nothing


def test_auto_interval_keeps_saving_within_the_budget():
    assert auto_interval(save_s=1.0, step_s=1.0) == 20           # 1 s per save <= 5% of 20 steps of 1 s
    assert auto_interval(save_s=0.5, step_s=2.0) == 5
    assert auto_interval(save_s=0.05, step_s=1.0) == 1           # cheap saves: every step
    assert auto_interval(save_s=3.0, step_s=0.1, budget=0.1) == 300
    assert auto_interval(save_s=0.0, step_s=1.0) == 1 and auto_interval(save_s=1.0, step_s=0.0) == 1
    for save_s, step_s in ((0.7, 0.3), (2.0, 0.01), (0.01, 3.0)):
        n = auto_interval(save_s, step_s)
        assert save_s <= 0.05 * n * step_s + 1e-12 and (n == 1 or save_s > 0.05 * (n - 1) * step_s)
