"""Prometheus metrics scraped by a real Prometheus: a store during a transformation (bytes pulled from each
peer host equal the plan's and the coordinator's counts) and the workers of a real two-rank Job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tenplex.devices import host_of
from tenplex.planner import plan
from tenplex.runtime.launch import free_port
from tenplex.transform import transform

from prometheus_helpers import Prometheus
from store_helpers import StoreProcess, gpt_layout, random_globals, write_version

WORKER = Path(__file__).parent / "mp" / "metrics_worker.py"


def _by(result, label: str) -> dict[str, float]:
    return {labels[label]: value for labels, value in result}


def test_store_metrics_agree_with_the_plan_and_the_transformation(tmp_path):
    old, new = gpt_layout(1, 2, 1, 1, 2), gpt_layout(1, 4, 1, 2, 2)  # h1 joins: it pulls its half from h0
    roots = {h: tmp_path / h for h in ("h0", "h1")}
    write_version(roots, old, 1, random_globals(old, seed=3))  # on h0 only
    ports = {h: free_port() for h in roots}
    stores = {h: StoreProcess(roots[h], h, extra_args=("--metrics-port", str(ports[h]))) for h in roots}
    prometheus = None
    try:
        prometheus = Prometheus(tmp_path / "prometheus", [f"127.0.0.1:{p}" for p in ports.values()])
        the_plan = plan(old, new)
        report = transform(the_plan, old, new, {h: s.address for h, s in stores.items()}, 1, 2)
        expected: dict[tuple[str, str], float] = {}  # (receiving host, peer host) -> bytes, from the plan
        for t in the_plan.transfers:
            src, dst = host_of(t.src), host_of(t.dst)
            if src != dst:
                expected[dst, src] = expected.get((dst, src), 0) + t.box.volume * new.tensors[t.tensor].itemsize
        assert expected and all(v > 0 for v in expected.values())
        instance = {f"127.0.0.1:{p}": h for h, p in ports.items()}

        def received(result):
            return {(instance[labels["instance"]], labels["peer_host"]): value for labels, value in result}

        result = prometheus.await_query("tenplex_store_received_bytes_total", lambda r: received(r) == expected)
        assert received(result) == expected
        for host in roots:  # what the coordinator counted as pulled from other hosts
            assert sum(v for (dst, _), v in expected.items() if dst == host) == report["hosts"][host]["remote_bytes"]
        done = prometheus.await_query('tenplex_store_transformations_total{outcome="ok"}', lambda r: len(r) == 2)
        assert sorted(instance[labels["instance"]] for labels, value in done if value == 1) == ["h0", "h1"]
        commits = prometheus.await_query('tenplex_store_rpcs_total{method="Commit",code="OK"}', lambda r: len(r) == 2)
        assert [value for _, value in commits] == [1, 1]
        versions = prometheus.await_query("tenplex_store_newest_version", lambda r: len(r) == 2)
        assert [value for _, value in versions] == [2, 2]
        assert all(v > 0 for _, v in prometheus.query("tenplex_store_free_bytes"))
    finally:
        if prometheus is not None:
            prometheus.stop()
        for store in stores.values():
            store.stop()


def test_job_metrics_of_a_two_rank_job(tmp_path):
    base, master = free_port(), free_port()
    procs = []
    prometheus = None
    try:
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master), OMP_NUM_THREADS="1", TENPLEX_HOST="h0",
                       TENPLEX_STORE_ROOT=str(tmp_path / "h0"), TENPLEX_METRICS_PORT=str(base),
                       TENPLEX_LOG_FORMAT="json", TENPLEX_LOG="info")
            log = open(tmp_path / f"rank{rank}.log", "w")
            procs.append(subprocess.Popen([sys.executable, str(WORKER), str(tmp_path)], env=env, stdout=log,
                                          stderr=subprocess.STDOUT))
        prometheus = Prometheus(tmp_path / "prometheus", [f"127.0.0.1:{base + r}" for r in range(2)])
        deadline = time.monotonic() + 180
        while not all((tmp_path / f"trained-r{r}").exists() for r in range(2)):
            assert all(p.poll() is None for p in procs), (tmp_path / "rank0.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the ranks did not train 4 steps"
            time.sleep(0.1)

        def both(value):
            return lambda result: len(result) == 2 and all(v == value for _, v in result)

        assert both(4)(prometheus.await_query("tenplex_job_last_committed_step", both(4)))
        assert both(4)(prometheus.await_query("tenplex_job_step_duration_seconds_count", both(4)))
        assert both(2)(prometheus.await_query('tenplex_job_saves_total{reason="periodic"}', both(2)))
        assert both(2)(prometheus.await_query("tenplex_job_world_size", both(2)))
        info = prometheus.await_query("tenplex_job_configuration_info", both(1))
        # the policy's choice for 2 ranks on one host under the worker's max_tp=1: data parallelism
        assert {(labels["config"], labels["dp"], labels["tp"], labels["pp"]) for labels, _ in info} == \
            {("dp=2,tp=1,pp=1,sharding=none", "2", "1", "1")}
        # tenplex run --log-format json reaches the workers as TENPLEX_LOG_FORMAT: JSON lines with the context
        lines = [json.loads(line) for line in (tmp_path / "rank0.log").read_text().splitlines() if line.startswith("{")]
        started = [line for line in lines if line["logger"] == "tenplex.elastic.job"]
        assert started and started[0]["level"] == "INFO" and started[0]["host"] == "h0" and started[0]["world"]
        assert started[0]["message"].startswith("rank 0 of 2 in world ")
    finally:
        (tmp_path / "stop").write_text("")
        if prometheus is not None:
            prometheus.stop()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
