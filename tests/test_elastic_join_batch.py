"""A joining node's workers enter the running world in one change (tenplex.elastic.reform, real processes and gloo
groups on a real rendezvous store): while one of a two-worker node's workers is registered and its sibling is still
starting, the running world holds it back and trains on; once the sibling registers, one generation admits both."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from inplace_nodes import RendezvousThread, lines, wait_for

WORKER = Path(__file__).parent / "mp" / "batch_worker.py"


def test_a_two_worker_node_joins_in_one_change_once_both_registered(tmp_path):
    server = RendezvousThread()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    job, stop_file, procs = f"batch-{os.getpid()}", tmp_path / "stop", []

    def worker(host: str, local_rank: int, local_world: int) -> Path:
        record = tmp_path / f"{host}-{local_rank}.jsonl"
        log = open(tmp_path / f"{host}-{local_rank}.log", "wb")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), server.endpoint, job, host,
                                       str(local_rank), str(local_world), str(record), str(stop_file)],
                                      env=env, stdout=log, stderr=subprocess.STDOUT))
        return record

    try:
        a = worker("h0", 0, 1)
        wait_for(a, lambda d: d["kind"] == "step", procs)                       # the first world trains
        b0 = worker("h1", 0, 2)
        held = wait_for(a, lambda d: d.get("held_back"), procs)                # the world saw h1's first worker...
        assert held["generation_of_step"] == 1 and held["size"] == 1  # ...and trains on without it
        b1 = worker("h1", 1, 2)
        wait_for(a, lambda d: d.get("generation_of_step", 0) >= 2, procs)
        stop_file.touch()
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
        server.stop()
    assert codes == [0, 0, 0], [(tmp_path / f).read_text()[-2000:] for f in ("h0-0.log", "h1-0.log", "h1-1.log")]
    generations = {path.name: [d for d in lines(path) if d["kind"] == "generation"] for path in (a, b0, b1)}
    assert [(g["generation"], len(g["members"])) for g in generations[a.name]] == [(1, 1), (2, 3)]
    assert generations[a.name][1]["reasons"] == ["join"]
    # both of h1's workers entered at generation 2, in the same change
    assert [g["generation"] for g in generations[b0.name]] == [2] == [g["generation"] for g in generations[b1.name]]
