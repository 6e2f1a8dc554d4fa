"""A joining node's workers enter the running world in one change (tenplex.elastic.reform, real processes and gloo
groups on a real rendezvous store): while one of a two-worker node's workers is registered and its sibling is still
starting, the running world holds it back and trains on; once the sibling registers, one generation admits both."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tenplex.elastic import rendezvous

WORKER = Path(__file__).parent / "mp" / "batch_worker.py"


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(path: Path, predicate, procs, timeout: float = 240) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        hit = next((d for d in _lines(path) if predicate(d)), None)
        if hit is not None:
            return hit
        assert time.monotonic() < deadline, f"timed out waiting in {path}: {_lines(path)[-3:]}"
        assert all(p.poll() is None for p in procs), [p.poll() for p in procs]
        time.sleep(0.05)


def test_a_two_worker_node_joins_in_one_change_once_both_registered(tmp_path):
    stop, ports = threading.Event(), []
    server = threading.Thread(target=rendezvous.serve, kwargs={"stop": stop, "ready": ports.append}, daemon=True)
    server.start()
    while not ports:
        server.join(0.05)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    job, stop_file, procs = f"batch-{os.getpid()}", tmp_path / "stop", []

    def worker(host: str, local_rank: int, local_world: int) -> Path:
        record = tmp_path / f"{host}-{local_rank}.jsonl"
        log = open(tmp_path / f"{host}-{local_rank}.log", "wb")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), f"127.0.0.1:{ports[0]}", job, host,
                                       str(local_rank), str(local_world), str(record), str(stop_file)],
                                      env=env, stdout=log, stderr=subprocess.STDOUT))
        return record

    try:
        a = worker("h0", 0, 1)
        _wait(a, lambda d: d["kind"] == "step", procs)                       # the first world trains
        b0 = worker("h1", 0, 2)
        held = _wait(a, lambda d: d.get("held_back"), procs)                # the world saw h1's first worker...
        assert held["generation_of_step"] == 1 and held["size"] == 1  # ...and trains on without it
        b1 = worker("h1", 1, 2)
        _wait(a, lambda d: d.get("generation_of_step", 0) >= 2, procs)
        stop_file.touch()
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
        stop.set()
    assert codes == [0, 0, 0], [(tmp_path / f).read_text()[-2000:] for f in ("h0-0.log", "h1-0.log", "h1-1.log")]
    generations = {path.name: [d for d in _lines(path) if d["kind"] == "generation"] for path in (a, b0, b1)}
    assert [(g["generation"], len(g["members"])) for g in generations[a.name]] == [(1, 1), (2, 3)]
    assert generations[a.name][1]["reasons"] == ["join"]
    # both of h1's workers entered at generation 2, in the same change
    assert [g["generation"] for g in generations[b0.name]] == [2] == [g["generation"] for g in generations[b1.name]]
