"""Units of tenplex.ops.metrics that need no Prometheus: a worker whose metrics port is taken keeps training,
and the store's per-peer byte count of a transform request (golden values)."""

from __future__ import annotations

import logging
import socket
import urllib.request

from tenplex.ops.metrics import JobMetrics, received_by_peer
from tenplex.planner import plan
from tenplex.runtime.launch import free_port
from tenplex.store.transformer import TransformRequest

from store_helpers import gpt_layout


def test_a_taken_metrics_port_is_a_warning_not_a_dead_worker(caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="tenplex.ops.metrics"):
            metrics = JobMetrics.from_environment({"TENPLEX_METRICS_PORT": str(port), "LOCAL_RANK": "0",
                                                   "TORCHELASTIC_RESTART_COUNT": "3"})
    assert f"no metrics endpoint on port {port}" in caplog.text
    assert metrics.registry.get_sample_value("tenplex_job_restarts") == 3


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
