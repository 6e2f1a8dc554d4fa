"""Units of tenplex.ops.metrics that need no Prometheus: a worker whose metrics port is taken keeps training,
and the store's per-peer byte count of a transform request (golden values)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from tenplex.ops.metrics import JobMetrics, endpoint_states, received_by_peer
from tenplex.planner import plan
from tenplex.ports import free_port
from tenplex.store.transformer import TransformRequest

from store_helpers import gpt_layout


def test_a_taken_metrics_port_is_a_warning_not_a_dead_worker(caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="tenplex.ops.metrics"):
            metrics = JobMetrics.from_environment({"TENPLEX_METRICS_PORT": str(port), "LOCAL_RANK": "0",
                                                   "TORCHELASTIC_RESTART_COUNT": "3",
                                                   "TENPLEX_METRICS_PORT_WAIT": "0"})  # no wait: at once
    assert f"no metrics endpoint on port {port}" in caplog.text
    assert metrics.registry.get_sample_value("tenplex_job_restarts") == 3


def _scrape(port: int) -> str:
    """The metrics text served on ``port``; "" while nothing serves it."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            return reply.read().decode()
    except urllib.error.URLError:
        return ""


def _wait_until(what: str, ready, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.1)


LINGERING = """
import sys, time
from tenplex.ops.metrics import JobMetrics
JobMetrics.from_environment({"TENPLEX_METRICS_PORT": sys.argv[1], "LOCAL_RANK": "0"})
print("serving", flush=True)
time.sleep(600)
"""


def test_a_worker_serves_its_metrics_port_once_the_previous_worlds_worker_frees_it(tmp_path, caplog):
    """Issue 42 item 7: a lingering worker of the previous world (a real process) still serves the port; the new
    world's worker says so, waits (training goes on), serves once the port is free, and records each state under
    its store root, where ``tenplex status`` reads it."""
    port, root = free_port(), tmp_path / "h0"
    lingering = subprocess.Popen([sys.executable, "-c", LINGERING, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert lingering.stdout.readline().strip() == "serving"
        with caplog.at_level(logging.WARNING, logger="tenplex.ops.metrics"):
            metrics = JobMetrics.from_environment({"TENPLEX_METRICS_PORT": str(port), "LOCAL_RANK": "0",
                                                   "TORCHELASTIC_RESTART_COUNT": "1",
                                                   "TENPLEX_STORE_ROOT": str(root)})
            assert metrics.registry.get_sample_value("tenplex_job_restarts") == 1
            assert f"metrics port {port} is in use" in caplog.text
            assert [(e["port"], e["state"]) for e in endpoint_states(root)] == [(port, "waiting")]
            assert "tenplex_job_restarts 0.0" in _scrape(port)  # still the lingering worker's
            lingering.kill()
            lingering.wait(60)
            _wait_until("endpoint of the new worker", lambda: "tenplex_job_restarts 1.0" in _scrape(port))
            _wait_until("serving state", lambda: endpoint_states(root)[0]["state"] == "serving")
        assert f"metrics port {port} is free after" in caplog.text
        assert endpoint_states(root)[0]["pid"] == os.getpid() and endpoint_states(root)[0]["alive"] is True
    finally:
        lingering.kill()
        lingering.wait(60)


def test_a_metrics_port_held_longer_than_the_wait_is_left_unserved(tmp_path, caplog):
    root = tmp_path / "h0"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="tenplex.ops.metrics"):
            JobMetrics.from_environment({"TENPLEX_METRICS_PORT": str(port), "LOCAL_RANK": "0",
                                         "TENPLEX_METRICS_PORT_WAIT": "0.5", "TENPLEX_STORE_ROOT": str(root)})
            _wait_until("give-up", lambda: endpoint_states(root)[0]["state"] == "unserved")
    assert f"no metrics endpoint on port {port}: still in use after 0.5 s" in caplog.text


def test_a_worker_serves_on_the_port_plus_its_local_rank():
    base = free_port()
    JobMetrics.from_environment({"TENPLEX_METRICS_PORT": str(base - 1), "LOCAL_RANK": "1"})
    with urllib.request.urlopen(f"http://127.0.0.1:{base}/metrics", timeout=10) as reply:
        assert "tenplex_job_last_committed_step -1.0" in reply.read().decode()


def test_bytes_received_per_peer_host_are_the_plans_cross_host_transfers():
    old, new = gpt_layout(1, 2, 1, 1, 2), gpt_layout(1, 4, 1, 2, 2)  # h1 joins h0
    request = TransformRequest("h1", 1, 2, plan(old, new), old, new)
    received = received_by_peer(request)
    assert list(received) == ["h0"]
    assert received["h0"] == plan(old, new).host_traffic({n: s.itemsize for n, s in new.tensors.items()})["h1"][1]
    assert received_by_peer(TransformRequest("h0", 1, 2, plan(old, new), old, new)) == {}
