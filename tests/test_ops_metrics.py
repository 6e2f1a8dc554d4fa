"""Prometheus metrics scraped by a real Prometheus: a store during a transformation (bytes pulled from and sent
to each peer host equal the plan's and the coordinator's counts) and the workers of a real two-rank Job; and the
sent bytes a store counts per declared reader host, over gRPC and the data plane, old-style readers included."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tenplex.box import Box
from tenplex.devices import host_of
from tenplex.ops.metrics import StoreMetrics
from tenplex.layout import Layout, Shard, TensorSpec
from tenplex.planner import plan
from tenplex.replication.copier import Replicator
from tenplex.ports import free_port
from tenplex.store import Store
from tenplex.store.client import StoreClient
from tenplex.store.server import serve
from tenplex.transform import transform

from prometheus_helpers import Prometheus
from store_helpers import StoreProcess, gpt_layout, random_globals, write_version

WORKER = Path(__file__).parent / "mp" / "metrics_worker.py"
READ_THROUGH = Path(__file__).parent / "mp" / "readthrough_sent_worker.py"


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

        def by_peer(result):
            return {(instance[labels["instance"]], labels["peer_host"]): value for labels, value in result}

        result = prometheus.await_query("tenplex_store_received_bytes_total", lambda r: by_peer(r) == expected)
        assert by_peer(result) == expected
        # measured where they are sent: each (sender, reader) pair's bytes are the plan's from the sender to the
        # reader, the reader's received bytes from the sender; the transformer's pulls declare their host
        sent = {(src, dst): value for (dst, src), value in expected.items()}
        result = prometheus.await_query("tenplex_store_sent_bytes_total", lambda r: by_peer(r) == sent)
        assert by_peer(result) == sent
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

        # The periodic saves are snapshots: step 2's was settled (committed everywhere) at step 4's boundary;
        # step 4's is still in flight until the next boundary or finish(), so the newest committed step is 2.
        assert both(2)(prometheus.await_query("tenplex_job_last_committed_step", both(2)))
        assert both(4)(prometheus.await_query("tenplex_job_step_duration_seconds_count", both(4)))
        assert both(2)(prometheus.await_query('tenplex_job_saves_total{reason="snapshot"}', both(2)))
        # what optimizer.step() waited for the snapshots' background copies, on every rank (a counter of seconds)
        assert len(prometheus.await_query("tenplex_job_save_step_wait_seconds_total", lambda r: len(r) == 2)) == 2
        assert both(2)(prometheus.await_query("tenplex_job_world_size", both(2)))
        assert both(0)(prometheus.await_query("tenplex_job_lost_steps_total", both(0)))  # a fresh job loses none
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


# ------------------------------------------------------------ sent bytes, in one process --
SHAPE = (512, 1024)  # float32: 2 MiB, two stored checksum blocks


def _served_store(root: Path) -> tuple[np.ndarray, StoreMetrics, object, str]:
    data = np.random.default_rng(5).random(SHAPE, dtype=np.float32)
    store = Store(root, "h0")
    with store.begin(1) as writer:
        writer.put("h0/0", "w", Box((0, 0), SHAPE), data, "float32", shape=SHAPE)
        writer.commit()
    metrics = StoreMetrics(store.versions, store.free_bytes, lambda: {})
    server, port = serve(store, on_sent=metrics.count_sent)
    return data, metrics, server, f"127.0.0.1:{port}"


def _sent(metrics: StoreMetrics) -> dict[str, float]:
    return {sample.labels["peer_host"]: sample.value for family in metrics.registry.collect()
            if family.name == "tenplex_store_sent_bytes" for sample in family.samples
            if sample.name == "tenplex_store_sent_bytes_total"}


def test_sent_bytes_are_counted_per_declared_reader_on_every_read_path(tmp_path):
    data, metrics, server, address = _served_store(tmp_path / "h0")
    whole, columns = Box((0, 0), SHAPE), Box((0, 0), (SHAPE[0], 100))  # one run of the file; not one run
    nbytes = {box: box.volume * 4 for box in (whole, columns)}
    try:
        with StoreClient(address, peer_host="h1", data_plane=False) as grpc_only:  # ReadBox, then ReadBoxes
            assert np.array_equal(grpc_only.read_box(1, "h0/0", "w", whole, "float32"), data)
            grpc_only.read_boxes_to(1, [("h0/0", "w", Box((0, 0), (1, 8)), 4, lambda *a: None),
                                        ("h0/0", "w", Box((3, 0), (2, 8)), 4, lambda *a: None)])
        with StoreClient(address, peer_host="h2", data_plane_min_bytes=0) as fast:  # data-plane frames
            assert fast.data_pool() is not None
            assert np.array_equal(fast.read_box(1, "h0/0", "w", whole, "float32"), data)  # whole blocks: sendfile
            assert np.array_equal(fast.read_box(1, "h0/0", "w", columns, "float32"), data[columns.slices()])
        with StoreClient(address) as old_style:  # declares no host, like a client from before
            old_style.read_box(1, "h0/0", "w", whole, "float32")  # 2 MiB: the data plane
            old_style.read_box(1, "h0/0", "w", columns, "float32")  # under 1 MiB: gRPC
        with StoreClient(address, peer_host="no such host!") as odd:  # not a host name: no label of its own
            odd.read_box(1, "h0/0", "w", columns, "float32")
        assert _sent(metrics) == {"h1": nbytes[whole] + 3 * 8 * 4, "h2": nbytes[whole] + nbytes[columns],
                                  "unknown": nbytes[whole] + 2 * nbytes[columns]}
    finally:
        server.stop(None)


def test_the_data_plane_request_field_peer_host(tmp_path):
    """The data-plane protocol's request field, written by hand (another client's, or a newer one's, request)."""
    data, metrics, server, address = _served_store(tmp_path / "h0")
    box = Box((8, 0), (4, 1024))
    try:
        with socket.create_connection(("127.0.0.1", server.data_server.port), timeout=30) as conn:
            files = conn.makefile("rb")

            def message() -> dict:
                (n,) = struct.unpack("<I", files.read(4))
                return json.loads(files.read(n))

            assert message()["tenplex_data"] == 1
            for declared in ({"peer_host": "h9"}, {}):  # a newer client's request, then an older one's
                body = json.dumps({"v": 1, "auth": "", "version": 1, "device": "h0/0", "tensor": "w", "box": {
                    "offsets": list(box.offsets), "lengths": list(box.lengths)}, "frame_bytes": 1 << 20,
                    **declared}).encode()
                conn.sendall(struct.pack("<I", len(body)) + body)
                assert message()["ok"]
                length, _digest = struct.unpack("<QQ", files.read(16))
                assert files.read(length) == data[box.slices()].tobytes()
        assert _sent(metrics) == {"h9": box.volume * 4, "unknown": box.volume * 4}
    finally:
        server.stop(None)


def test_replica_copies_declare_the_copying_host(tmp_path):
    data, metrics, server, address = _served_store(tmp_path / "h0")
    saved = Layout.build({"w": TensorSpec(SHAPE, "float32"), "v": TensorSpec((8,), "float32")},  # h1 copies w
                         {"h0/0": [Shard("w", Box((0, 0), SHAPE))], "h1/0": [Shard("v", Box((0,), (8,)))]})
    try:
        replicator = Replicator(Store(tmp_path / "h1", "h1"), 1, saved, 1, {"h0": address}, timeout=30).start()
        assert replicator.wait(300), replicator.status()
        assert _sent(metrics) == {"h1": data.nbytes} and replicator.status()["bytes"] == data.nbytes
    finally:
        server.stop(None)


def test_a_read_through_restore_declares_the_restoring_host(tmp_path):
    proc = subprocess.run([sys.executable, str(READ_THROUGH), str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {"ok": True, "equal": True, "sent": {"h1": 64 * 64 * 4}}
