"""Generations of real gloo process groups in the same processes (tenplex.elastic.reform): a peer SIGKILLed in
the middle of an all-reduce becomes an error on every survivor, which re-form without it as soon as the rendezvous
server's close watch saw its process gone (not after its heartbeat's silence); twenty more
re-formations leak no process group, thread or file descriptor, and keep resident memory flat."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from tenplex.elastic import rendezvous

WORKER = Path(__file__).parent / "mp" / "reform_worker.py"


def test_survivors_of_a_peer_killed_mid_all_reduce_re_form_in_process_without_leaks(tmp_path):
    stop, ports = threading.Event(), []
    server = threading.Thread(target=rendezvous.serve, kwargs={"stop": stop, "ready": ports.append}, daemon=True)
    server.start()
    while not ports:
        server.join(0.05)
    endpoint = f"127.0.0.1:{ports[0]}"
    roles = {"h0": "survivor", "h1": "victim", "h2": "survivor"}
    env = dict(os.environ, OMP_NUM_THREADS="1")
    logs = {h: open(tmp_path / f"{h}.log", "wb") for h in roles}
    job = f"reform-{os.getpid()}"
    procs = {h: subprocess.Popen([sys.executable, str(WORKER), endpoint, job, h, str(tmp_path), role], env=env,
                                 stdout=logs[h], stderr=subprocess.STDOUT) for h, role in roles.items()}
    try:
        codes = {h: p.wait(timeout=300) for h, p in procs.items()}
    finally:
        for h, p in procs.items():
            p.kill()
            logs[h].close()
        stop.set()
    assert codes == {"h0": 0, "h1": -9, "h2": 0}, {h: (tmp_path / f"{h}.log").read_text()[-3000:] for h in roles}
    killed_at = float((tmp_path / "killed_at").read_text())
    pauses = {}
    for h in ("h0", "h2"):
        r = json.loads((tmp_path / f"{h}.json").read_text())
        # a reset from the dead peer, not the 60 s group timeout, ended the all-reduce
        assert "Connection reset by peer" in r["error"]["text"] or "Connection closed by peer" in r["error"]["text"]
        assert r["first"]["world"] == 3 and r["second"]["world"] == 2
        assert r["second"]["reasons"] == ["lost"] and r["second"]["sum"] == [2.0, 2.0, 2.0]
        assert r["second"]["lost_by"] == ["closed"]  # its process's connection closed; its heartbeat (600 s) did not
        assert r["last_generation"] == r["second"]["generation"] + 20
        assert r["states"][:6] == ["warm", "forming", "training", "failed", "warm", "forming"]
        census = r["census"]
        assert census[0]["gloo_threads"] >= 1 and census[0]["pg_map"] == 1  # the control: in a group, they are seen
        left = census[1:]  # after each leave_group: no group, no thread or fd beyond the first one's
        assert all(c["gloo_threads"] == 0 and c["pg_map"] == 0 for c in left), left
        assert max(c["threads"] for c in left) <= left[0]["threads"], [c["threads"] for c in left]
        assert max(c["fds"] for c in left) <= left[0]["fds"], [c["fds"] for c in left]
        assert census[-1]["rss"] <= 1.10 * census[5]["rss"], [c["rss"] for c in census]
        pauses[h] = {"error_after_kill_s": r["error"]["at"] - killed_at, "re_form_s": r["second"]["re_form_s"]}
    print(json.dumps(pauses))
