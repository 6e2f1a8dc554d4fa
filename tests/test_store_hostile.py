"""Issue 12: a store server stays available and coherent under hostile or broken clients (defects 5-9, 11, 12)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from tenplex.box import Box
from tenplex.store import Store, wire
from tenplex.store._proto import store_pb2 as pb
from tenplex.store.client import StoreClient

from store_helpers import StoreProcess

SHAPE = (64, 48)


def _write_stream(address: str):
    channel = grpc.insecure_channel(address)
    call = channel.stream_unary("/tenplex.v1.Store/WriteShard",
                                request_serializer=pb.WriteShardRequest.SerializeToString,
                                response_deserializer=pb.WriteShardReply.FromString)
    return channel, call


def _header(version: int, part: str, lengths: tuple[int, ...], tensor: str = "w") -> pb.WriteShardRequest:
    box = Box((0,) * len(lengths), lengths)
    return pb.WriteShardRequest(header=pb.ShardHeader(version=version, part=part, device="h0/0", tensor=tensor,
                                                      box=wire.to_pb_box(box), dtype="float32",
                                                      shape=list(lengths)))


def _stalled(header: pb.WriteShardRequest, release: threading.Event):
    """A WriteShard request stream that sends its header, then nothing until ``release``."""
    yield header
    release.wait()


def _part_files(root) -> list[str]:
    staging = root / "staging"
    return sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())


# ---- defect 5: stalled streams -------------------------------------------------------------------------------
def test_stalled_write_streams_cannot_take_the_server_down(tmp_path):
    proc = StoreProcess(tmp_path / "h0", "h0", extra_args=("--max-streams", "4", "--stream-idle-s", "2"))
    release = threading.Event()
    channel, write = _write_stream(proc.address)
    try:
        calls = [write.future(_stalled(_header(1, f"p{i}", (16,), tensor=f"t{i}"), release), timeout=60)
                 for i in range(40)]
        with StoreClient(proc.address, timeout=10) as client:
            assert client.health()["host"] == "h0"  # control calls keep their own threads
            codes = [c.exception().code() if c.exception() else grpc.StatusCode.OK for c in calls]
            busy = [c for c in calls if c.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED]
            assert len(busy) == 36, codes
            assert "4 bulk streams" in busy[0].exception().details()
            # the four admitted streams sent nothing for 2 s: cancelled, their partial shards dropped
            for c in calls:
                assert c.exception().code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED)
            deadline = time.monotonic() + 120  # the handlers clean up just after the client sees CANCELLED
            while _part_files(tmp_path / "h0") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _part_files(tmp_path / "h0") == [], "idle streams left their shard files"
            # a well-behaved writer gets through afterwards
            data = np.arange(16, dtype=np.float32)
            assert client.write_shard(1, "ok", "h0/0", "w", Box((0,), (16,)), data, "float32") == data.nbytes
            client.prepare(1, "ok")
            client.commit(1)
            np.testing.assert_array_equal(client.read_box(1, "h0/0", "w", Box((0,), (16,)), "float32"), data)
    finally:
        release.set()
        channel.close()
        proc.stop()


# ---- defect 7: reservations ----------------------------------------------------------------------------------
@pytest.fixture
def small_tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount an 8 MiB tmpfs")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _free(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_write_shard_reserves_no_space_before_data_and_leaks_none(small_tmpfs):
    root = small_tmpfs / "h0"
    proc = StoreProcess(root, "h0")
    channel, write = _write_stream(proc.address)
    try:
        # a header declaring 1 GiB on an 8 MiB disk: refused at once, nothing left behind
        with pytest.raises(grpc.RpcError) as info:
            write(iter([_header(1, "big", (1 << 28,))]), timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1073741824" in info.value.details() and "free" in info.value.details()
        assert _part_files(root) == []
        # a 6 MiB header and a stalled client: no space is held while no data comes
        before = _free(small_tmpfs)
        release = threading.Event()
        call = write.future(_stalled(_header(1, "stall", (6 << 18,)), release), timeout=60)
        deadline = time.monotonic() + 120
        while not any(p.endswith(".safetensors") for p in _part_files(root)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert before - _free(small_tmpfs) < (1 << 20), "space was reserved before any data arrived"
        release.set()
        with pytest.raises(grpc.RpcError):
            call.result()
        assert not any(p.endswith(".safetensors") for p in _part_files(root))
        # a stream that fills the disk halfway through fails with ENOSPC and frees what it wrote
        with StoreClient(proc.address, timeout=30, chunk_bytes=1 << 20) as client:
            from tenplex.store.client import RemoteStoreError
            with pytest.raises(RemoteStoreError) as failed:
                client.write_shard(1, "full", "h0/0", "w", Box((0,), (3 << 20,)), np.ones(3 << 20, np.float32),
                                   "float32")
            assert failed.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert not any(p.endswith(".safetensors") for p in _part_files(root))
            assert _free(small_tmpfs) >= before - (1 << 20)
            # and later writes succeed without an Abort
            data = np.arange(1 << 18, dtype=np.float32)
            client.write_shard(1, "ok", "h0/0", "w", Box((0,), data.shape), data, "float32")
            client.prepare(1, "ok")
            client.commit(1, )
            np.testing.assert_array_equal(client.read_box(1, "h0/0", "w", Box((0,), data.shape), "float32"), data)
        assert proc.alive()
    finally:
        channel.close()
        proc.stop()


# ---- defect 6: data-plane connection floods -------------------------------------------------------------------
@pytest.fixture
def in_process_store(tmp_path):
    """A store with version 1 (a 64x48 float32 w) served by an in-process gRPC server with a data plane."""
    from tenplex.store.server import serve

    w = np.random.default_rng(3).random(SHAPE, dtype=np.float32)
    store = Store(tmp_path / "h0", "h0")
    with store.begin(1) as writer:
        writer.put("h0/0", "w", Box((0, 0), SHAPE), w, "float32", shape=SHAPE)
        writer.commit()
    server, port = serve(store, port=0)
    yield server, f"127.0.0.1:{port}", w
    server.data_server.close()
    server.stop(grace=None)


def _one_version(tmp_path) -> tuple[Store, np.ndarray]:
    """A store on host h0 with version 1: device h0/0 holds all of tensor ``w`` (SHAPE float32, 0, 1, 2, ...)."""
    w = np.arange(64 * 48, dtype=np.float32).reshape(SHAPE)
    store = Store(tmp_path / "h0", "h0")
    with store.begin(1) as writer:
        writer.put("h0/0", "w", Box((0, 0), SHAPE), w, "float32", shape=SHAPE)
        writer.commit()
    return store, w


def _data_client(address: str) -> StoreClient:
    return StoreClient(address, chunk_bytes=4096, data_plane_min_bytes=0, timeout=20)


def test_data_plane_accept_loop_survives_thread_exhaustion(in_process_store, monkeypatch):
    from tenplex.store import dataplane

    server, address, w = in_process_store
    real = threading.Thread
    failures = [3]

    class Exhausted(real):
        def start(self):
            if self.name == "data-conn" and failures[0] > 0:
                failures[0] -= 1
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(dataplane.threading, "Thread", Exhausted)
    for _ in range(3):  # each of these connections is dropped (no thread for it): the read goes over gRPC
        with _data_client(address) as client:
            np.testing.assert_array_equal(client.read_box(1, "h0/0", "w", Box((0, 0), SHAPE), "float32"), w)
    assert failures == [0]
    with _data_client(address) as client:  # the accept loop is still alive: the data plane serves again
        pool = client.data_pool()
        got, bad = pool.read(1, "h0/0", "w", Box((0, 0), SHAPE), 4, 4096, out=np.empty(SHAPE, np.float32),
                             out_box=Box((0, 0), SHAPE))
        assert got == w.nbytes and bad == []


def test_silent_data_connections_are_dropped_and_bounded(tmp_path):
    from tenplex.store.dataplane import DataPool, DataServer
    from tenplex.store.service import StoreService

    store, w = _one_version(tmp_path)
    service = StoreService(store)
    data = DataServer("127.0.0.1", service._reader, lambda e: ("INTERNAL", str(e)), handshake_s=1.0,
                      max_connections=8)
    silent = []
    try:
        for _ in range(40):
            silent.append(socket.create_connection(("127.0.0.1", data.port), timeout=10))
        pool = DataPool("127.0.0.1", data.port, None, 10)
        out = np.empty(SHAPE, np.float32)
        got, bad = pool.read(1, "h0/0", "w", Box((0, 0), SHAPE), 4, 4096, out=out, out_box=Box((0, 0), SHAPE))
        assert got == w.nbytes and bad == [] and (out == w).all()
        pool.close()
        # every silent connection is closed by the server: dropped for a newer one, or after the 1 s handshake
        for sock in silent:
            received = b""
            try:
                while True:
                    chunk = sock.recv(4096)
                    if not chunk:
                        break
                    received += chunk
            except ConnectionResetError:
                pass
            assert len(received) < 200  # at most the hello
    finally:
        for sock in silent:
            sock.close()
        data.close()


def test_a_pooled_connection_the_server_dropped_is_replaced_transparently(tmp_path):
    from tenplex.store.dataplane import DataPool, DataServer
    from tenplex.store.service import StoreService

    store, w = _one_version(tmp_path)
    data = DataServer("127.0.0.1", StoreService(store)._reader, lambda e: ("INTERNAL", str(e)), max_connections=1)
    pools = [DataPool("127.0.0.1", data.port, None, 10) for _ in range(2)]
    try:
        for pool in (*pools, *pools):  # each read evicts the other pool's idle connection
            out = np.empty(SHAPE, np.float32)
            got, bad = pool.read(1, "h0/0", "w", Box((0, 0), SHAPE), 4, 4096, out=out, out_box=Box((0, 0), SHAPE))
            assert got == w.nbytes and bad == [] and (out == w).all()
    finally:
        for pool in pools:
            pool.close()
        data.close()


def test_client_falls_back_to_grpc_when_the_data_plane_is_unreachable(in_process_store):
    server, address, w = in_process_store
    with _data_client(address) as client:
        assert client.data_pool() is not None
        server.data_server.close()
        np.testing.assert_array_equal(client.read_box(1, "h0/0", "w", Box((0, 0), SHAPE), "float32"), w)


# ---- defects 8 and 9: ports ------------------------------------------------------------------------------------
def _serve_cli(tmp_path, *args, timeout=20):
    return subprocess.run([sys.executable, "-m", "tenplex.cli.store", "serve", "--root", str(tmp_path / "x"),
                           "--host", "x", *args], capture_output=True, text=True, timeout=timeout)  # noqa: S603


def test_a_port_in_use_is_refused(tmp_path):
    first = StoreProcess(tmp_path / "h0", "h0")
    try:
        result = _serve_cli(tmp_path, "--port", str(first.port))
        assert result.returncode == 2, result.stderr
        assert f"port {first.port}" in result.stderr and "in use" in result.stderr
        assert "Traceback" not in result.stderr
        with StoreClient(first.address) as client:
            assert client.health()["host"] == "h0"
    finally:
        first.stop()


@pytest.mark.parametrize("port", ["99999", "-1", "65536"])
def test_ports_outside_0_65535_are_refused(tmp_path, port):
    result = _serve_cli(tmp_path, "--port", port)
    assert result.returncode == 2
    assert "0-65535" in result.stderr and "Traceback" not in result.stderr


# ---- defect 11: concurrent transforms ---------------------------------------------------------------------------
def test_concurrent_identical_transforms_fail_cleanly_or_succeed_once(tmp_path):
    from tenplex.errors import TransformError
    from tenplex.planner import plan
    from tenplex.transform import transform

    from store_helpers import Cluster, assert_version_matches, random_globals, tiny_layout, write_version

    tensors = {"a": ((1024, 768), "float32"), "b": ((768, 1024), "float32")}
    old = tiny_layout(tensors, {"h0/0": [("a", (0, 0), (1024, 768)), ("b", (0, 0), (768, 1024))]})
    new = tiny_layout(tensors, {"h1/0": [("a", (0, 0), (512, 768)), ("b", (0, 0), (768, 512))],
                                "h2/0": [("a", (512, 0), (512, 768)), ("b", (0, 512), (768, 512))]})
    the_plan = plan(old, new)
    with Cluster(tmp_path, ["h0", "h1", "h2"]) as cluster:
        arrays = random_globals(old)
        write_version(cluster.roots, old, 1, arrays)
        for new_version in (2, 3, 4):
            outcomes: list = [None, None]

            def run(i: int, outcomes: list = outcomes, new_version: int = new_version) -> None:
                try:
                    outcomes[i] = transform(the_plan, old, new, cluster.addresses, 1, new_version, chunk_bytes=4096)
                except TransformError as e:
                    outcomes[i] = e

            threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            committed = [Store(cluster.roots[h], h).versions() for h in ("h1", "h2")]
            errors = [o for o in outcomes if isinstance(o, TransformError)]
            for error in errors:
                text = str(error)
                assert "INTERNAL" not in text and "FileExistsError" not in text and "FileNotFound" not in text, text
                causes = [str(cause) for cause in error.failures.values()]
                assert all(("ABORTED" in cause or "ALREADY_EXISTS" in cause) for cause in causes), text
                assert "another transformation" in text, text
                if new_version in committed[0]:
                    assert f"{new_version} was not committed" not in text, text
            assert committed[0] == committed[1], "a version was committed on some hosts only"
            if len(errors) < 2:
                assert new_version in committed[0]
                assert_version_matches(cluster.roots, new, new_version, arrays)
            else:
                assert new_version not in committed[0]
        # once committed, the same transform is refused with ALREADY_EXISTS and a true message
        transform(the_plan, old, new, cluster.addresses, 1, 5)
        with pytest.raises(TransformError) as info:
            transform(the_plan, old, new, cluster.addresses, 1, 5)
        assert "ALREADY_EXISTS" in str(info.value) and "already committed" in str(info.value)
        assert Store(cluster.roots["h1"], "h1").versions() == Store(cluster.roots["h2"], "h2").versions()


# ---- defect 12: the token in plaintext ---------------------------------------------------------------------------
def test_token_without_tls_off_loopback_is_warned_about(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    proc = StoreProcess(tmp_path / "h0", "h0", token_file=token_file, bind="0.0.0.0")
    try:
        with StoreClient(proc.address, token="s3cret-token") as client:
            client.versions()
    finally:
        proc.stop()
    log = (tmp_path / ".h0.log").read_text()
    assert "WARNING" in log and "plaintext" in log and "--tls-cert" in log
    assert "s3cret-token" not in log
    help_text = subprocess.run([sys.executable, "-m", "tenplex.cli.store", "serve", "--help"], capture_output=True,
                               text=True, timeout=60).stdout
    assert "plaintext" in " ".join(help_text.split())


# ---- weaker spots ---------------------------------------------------------------------------------------------
def test_a_version_without_its_manifest_is_named_damaged_and_gc_removes_it(tmp_path):
    from tenplex.errors import StoreError

    store = Store(tmp_path / "s", "h0")
    for v in (1, 2):
        with store.begin(v) as w:
            w.put("h0/0", "w", Box((0,), (4,)), np.ones(4, np.float32), "float32")
            w.commit()
    (store.root / "versions" / "1" / "manifest.json").unlink()
    assert store.versions() == [2]
    with pytest.raises(StoreError, match="no manifest.json"):
        store.begin(1)
    assert store.gc(keep=1) == []
    assert not (store.root / "versions" / "1").exists(), "gc left the damaged version behind"
    with store.begin(1) as w:  # the number is free again
        w.put("h0/0", "w", Box((0,), (4,)), np.zeros(4, np.float32), "float32")
        w.commit()
    assert store.versions() == [1, 2]


def test_abandoned_remote_parts_expire_and_release_their_descriptors(tmp_path):
    proc = StoreProcess(tmp_path / "h0", "h0", extra_args=("--part-idle-s", "2"))
    try:
        with StoreClient(proc.address, timeout=30) as client:
            for i in range(40):  # written, never prepared: each would hold its shard file open
                client.write_shard(1, f"p{i}", "h0/0", "w", Box((0,), (4,)), np.ones(4, np.float32), "float32")
            held = len(os.listdir(f"/proc/{proc.proc.pid}/fd"))
            assert held < 40, f"{held} descriptors held by finished WriteShard streams"
            staging = tmp_path / "h0" / "staging" / "1"
            deadline = time.monotonic() + 120
            while staging.exists() and any(staging.iterdir()) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not staging.exists() or not any(staging.iterdir()), "abandoned parts were never expired"
            with pytest.raises(Exception, match="no open part"):
                client.prepare(1, "p0")
    finally:
        proc.stop()


@pytest.mark.parametrize("dp", ["0", "-1"])
def test_data_state_refuses_a_dp_below_one(tmp_path, dp):
    def tenplex(*args):
        return subprocess.run([sys.executable, "-c", "import sys; from tenplex.cli import main; sys.exit(main())",
                               *args], capture_output=True, text=True, timeout=60)

    np.arange(400, dtype=np.uint16).tofile(tmp_path / "tokens.bin")
    assert tenplex("data", "pack", str(tmp_path / "tokens.bin"), str(tmp_path / "ds"), "--seq-len", "4", "--dtype",
                   "uint16", "--quiet").returncode == 0
    result = tenplex("data", "state", str(tmp_path / "ds"), "--seed", "0", "--global-batch", "4", "--dp", dp,
                     "-o", str(tmp_path / "state.json"))
    assert result.returncode == 2 and "--dp" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "state.json").exists()
