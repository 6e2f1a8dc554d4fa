"""Worlds in place (tenplex.elastic.Job.worlds with TENPLEX_IN_PLACE): real worker processes, a real rendezvous
store, real gloo groups and the host's real tensor store. A warm joiner, a planned leave (SIGTERM) and a SIGKILLed
worker each change the world while the survivor keeps its process, and the job ends where an uninterrupted one
does, at most one step lost to the kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from tenplex.elastic import rendezvous

WORKER = Path(__file__).parent / "mp" / "inplace_worker.py"


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(path: Path, predicate, procs, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not any(predicate(d) for d in _lines(path)):
        assert time.monotonic() < deadline, f"timed out waiting in {path}"
        assert all(p.poll() is None for p in procs), [p.poll() for p in procs]
        time.sleep(0.02)


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


def test_join_leave_and_kill_change_the_world_in_place_and_the_survivor_keeps_its_process(tmp_path):
    stop, ports = threading.Event(), []
    server = threading.Thread(target=rendezvous.serve, kwargs={"stop": stop, "ready": ports.append}, daemon=True)
    server.start()
    while not ports:
        server.join(0.05)
    env = dict(os.environ, OMP_NUM_THREADS="1", TENPLEX_IN_PLACE="1", TENPLEX_RDZV_ENDPOINT=f"127.0.0.1:{ports[0]}",
               TENPLEX_RDZV_ID=f"inplace-{os.getpid()}", TENPLEX_MIN_WORKERS="2", TENPLEX_HOST="h0",
               TENPLEX_DEAD_AFTER="10",  # a busy machine starves heartbeats: a kill is noticed by its reset anyway
               TENPLEX_STORE_ROOT=str(tmp_path / "h0"))
    procs: list[subprocess.Popen] = []

    def start(local_rank: int) -> subprocess.Popen:
        log = open(tmp_path / f"w{local_rank}.log", "wb")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(tmp_path)], stdout=log,
                                      stderr=subprocess.STDOUT, env=dict(env, LOCAL_RANK=str(local_rank))))
        return procs[-1]

    w = [tmp_path / f"w{i}.jsonl" for i in range(3)]
    try:
        survivor, leaver = start(0), start(1)
        _wait(w[0], lambda d: d.get("step", 0) >= 3, procs)
        joiner = start(2)                                            # a warm join: world 1 trains meanwhile
        _wait(w[0], lambda d: d.get("generation") == 2 and d.get("step", 0) >= 6, procs)
        leaver.send_signal(signal.SIGTERM)                           # a planned leave
        assert leaver.wait(timeout=120) == 0
        _wait(w[0], lambda d: d.get("generation") == 3 and d.get("step", 0) >= 9, [survivor, joiner])
        joiner.kill()                                                # a lost worker, at any point of a step
        _wait(w[0], lambda d: d.get("generation") == 4, [survivor])
        steps = max(d["step"] for d in _lines(w[0]) if "step" in d) + 3
        (tmp_path / "steps").write_text(str(steps))
        assert survivor.wait(timeout=180) == 0, (tmp_path / "w0.log").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGUSR1)  # its threads' stacks go to its log
        time.sleep(0.5)
        for p in procs:
            p.kill()
        stop.set()
    worlds = [d for d in _lines(w[0]) if "pid" in d]
    assert [(d["generation"], d["size"], d["reasons"]) for d in worlds] == [
        (1, 2, ["start"]), (2, 3, ["join"]), (3, 2, ["leave"]), (4, 1, ["lost"])]
    assert {d["pid"] for d in worlds} == {survivor.pid}             # one process through four worlds
    done = [d for d in _lines(w[0]) if "step" in d]
    last = {g: max(d["step"] for d in done if d["generation"] == g) for g in (1, 2, 3)}
    # a planned change saves the step it stops at; a kill loses at most the step in flight
    assert worlds[1]["restored"] == last[1] and worlds[2]["restored"] == last[2]
    assert last[3] - 1 <= worlds[3]["restored"] <= last[3]
    assert [d["generation"] for d in _lines(w[2]) if "pid" in d] == [2, 3]
    final = json.loads((tmp_path / f"final-{survivor.pid}.json").read_text())
    assert final["step"] == steps
    for name, value in _reference(steps).items():
        assert torch.allclose(torch.tensor(final["params"][name], dtype=torch.float64), value, rtol=1e-12,
                              atol=1e-14), name
    pauses = final["reconfigurations"]
    assert [p["reasons"] for p in pauses] == [["join"], ["leave"], ["lost"]]
    assert all(p["pid"] == survivor.pid and p["pause_s"] >= p["re_form_s"] for p in pauses)
    for kind in ("join", "leave", "lost"):
        assert f'tenplex_job_reconfigurations_total{{kind="{kind}",mode="in_place"}} 1.0' in final["metrics"]
    assert "tenplex_job_pause_seconds_count 3.0" in final["metrics"]
    print(json.dumps([{k: p[k] for k in ("reasons", "pause_s", "agree_s", "re_form_s", "restore_s",
                                         "first_step_s")} for p in pauses]))
