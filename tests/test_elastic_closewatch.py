"""The close watch (tenplex.elastic.closewatch): a process that announced itself is marked gone the moment the
kernel closes its connection (SIGKILL), through a real rendezvous store; a connection that never announced a key
under ``tenplex/`` marks nothing; a forked child does not keep its parent's announcement open."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from tenplex.elastic import closewatch, rendezvous

ANNOUNCER = """
import os, sys, time
from tenplex.elastic import closewatch
conn = closewatch.announce("127.0.0.1", int(sys.argv[1]), "tenplex/test/gone", sys.argv[2] + ",")
if os.fork() == 0:           # a child that outlives its parent (as a DataLoader worker may, for a while)
    time.sleep(600)
    os._exit(0)
print("announced", flush=True)
time.sleep(600)
"""


def _wait_for(predicate, what: str, deadline_s: float = 60.0):
    deadline = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_killed_process_is_marked_gone_in_the_store_and_a_stray_connection_marks_nothing(tmp_path):
    stop, ports = threading.Event(), []
    server = threading.Thread(target=rendezvous.serve, kwargs={"stop": stop, "ready": ports.append}, daemon=True)
    server.start()
    _wait_for(lambda: ports, "the rendezvous store did not start")
    store = dist.TCPStore("127.0.0.1", ports[0], is_master=False, timeout=timedelta(seconds=30))
    port = int(store.get(closewatch.PORT_KEY))  # published by the server beside its store
    stray = closewatch.announce("127.0.0.1", port, "not/tenplex/key", "9,")  # outside tenplex/: ignored
    closewatch.withdraw(stray)
    announcer = subprocess.Popen([sys.executable, "-c", ANNOUNCER, str(port), "7"], stdout=subprocess.PIPE,
                                 start_new_session=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    try:
        assert announcer.stdout.readline().strip() == b"announced"
        assert not store.check(["tenplex/test/gone"])  # alive, and its forked child holds no copy open
        announcer.kill()                               # the parent only: the child sleeps on
        announcer.wait(timeout=30)
        _wait_for(lambda: store.check(["tenplex/test/gone"]), "the killed process was never marked gone")
        assert store.get("tenplex/test/gone") == b"7,"
        assert not store.check(["not/tenplex/key"])
    finally:
        os.killpg(announcer.pid, signal.SIGKILL)  # the forked child too (its own session)
        stop.set()
        server.join(timeout=30)
