"""Fault injection on real store processes: dying, hanging and corrupting sources, crashes between prepare and
commit, full or read-only destination disks. Nothing committed is ever lost and errors say what happened."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import grpc
import pytest

from tenplex.errors import TransformError
from tenplex.files import save_layout, save_plan
from tenplex.planner import plan
from tenplex.store import Store
from tenplex.store.client import RemoteStoreError
from tenplex.transform import transform

from store_helpers import (Cluster, StoreProcess, assert_version_matches, gpt_layout, random_globals, tiny_layout,
                           write_version)

# Small chunks so that every pull takes many chunks and a fault lands mid-transfer.
CHUNK = 1024
DIE_SOON = {"TENPLEX_STORE_TEST_HOOKS": "exit_after_chunks=3"}


def _setup(cluster, old, seed=0, version=1):
    arrays = random_globals(old, seed=seed)
    write_version(cluster.roots, old, version, arrays, docs={"step": {"step": 41}})
    return arrays


def _big_layouts():
    """Two 3 MiB tensors (pulled as streamed pieces, not batches), replicated on h0 and h1; h2 pulls all."""
    tensors = {"a": ((1024, 768), "float32"), "b": ((768, 1024), "float32")}
    old = tiny_layout(tensors, {f"{h}/0": [("a", (0, 0), (1024, 768)), ("b", (0, 0), (768, 1024))]
                                for h in ("h0", "h1")})
    new = tiny_layout(tensors, {"h2/0": [("a", (0, 0), (512, 768)), ("b", (0, 0), (768, 512))],
                                "h2/1": [("a", (512, 0), (512, 768)), ("b", (0, 512), (768, 512))]})
    return old, new


@pytest.mark.parametrize("size", ["small regions, batched", "large regions, streamed"])
def test_source_dies_mid_transfer_and_replicas_take_over(tmp_path, size):
    if size.startswith("small"):
        old = gpt_layout(2, 2, 1, 2, 2)                       # h0 and h1 each hold a full replica
        new = gpt_layout(1, 2, 1, 1, 2, host_names=["h2"])    # h2 pulls everything
    else:
        old, new = _big_layouts()
    with Cluster(tmp_path, ["h0", "h1", "h2"], env={"h0": DIE_SOON}) as cluster:
        arrays = _setup(cluster, old)
        report = transform(plan(old, new), old, new, cluster.addresses, 1, 2, chunk_bytes=CHUNK)
        assert not cluster.procs["h0"].alive(), "the fault was not injected"
        assert report["hosts"]["h2"]["refetched_bytes"] > 0
        assert_version_matches(cluster.roots, new, 2, arrays)
        assert Store(cluster.roots["h2"], "h2").open(2).get_json("step") == {"step": 41}


def test_source_dies_without_replica_fails_cleanly(tmp_path):
    old = gpt_layout(1, 2, 1, 1, 2)                       # only h0 holds the state
    new = gpt_layout(1, 2, 1, 2, 1)                       # h0/0 and h1/0
    with Cluster(tmp_path, ["h0", "h1"], env={"h0": DIE_SOON}) as cluster:
        arrays = _setup(cluster, old)
        with pytest.raises(TransformError) as info:
            transform(plan(old, new), old, new, cluster.addresses, 1, 2, chunk_bytes=CHUNK)
        message = str(info.value)
        cause = info.value.failures["h1"]
        assert "no surviving replica" in str(cause) and "UNAVAILABLE" in str(cause)
        # The cause is typed and chained; a region whose only copy is gone cannot come back by waiting.
        assert isinstance(cause, RemoteStoreError) and cause.code == grpc.StatusCode.FAILED_PRECONDITION
        assert info.value.__cause__ in info.value.failures.values() and not info.value.retryable
        assert "version 1 is unchanged" in message
        assert Store(cluster.roots["h1"], "h1").versions() == []
        assert list((cluster.roots["h1"] / "staging").iterdir()) == [], "the failed host's staging was not aborted"
        # h0 died, but what it had committed is intact when it comes back
        cluster.procs["h0"] = StoreProcess(cluster.roots["h0"], "h0")
        assert cluster.client("h0").versions() == [1]
        assert_version_matches(cluster.roots, old, 1, arrays)


def test_hung_source_times_out_and_replicas_take_over(tmp_path):
    old = gpt_layout(2, 2, 1, 2, 2)
    new = gpt_layout(1, 2, 1, 1, 2, host_names=["h2"])
    with Cluster(tmp_path, ["h0", "h1", "h2"]) as cluster:
        arrays = _setup(cluster, old)
        cluster.procs["h0"].proc.send_signal(signal.SIGSTOP)  # accepts connections, never answers
        try:
            report = transform(plan(old, new), old, new, cluster.addresses, 1, 2, pull_timeout=2.0)
        finally:
            cluster.procs["h0"].proc.send_signal(signal.SIGCONT)
        assert report["hosts"]["h2"]["refetched_bytes"] > 0
        assert_version_matches(cluster.roots, new, 2, arrays)


def test_corrupted_chunks_in_flight_are_refetched(tmp_path):
    old = gpt_layout(1, 2, 1, 1, 2)
    new = gpt_layout(1, 4, 1, 2, 2)
    env = {"h0": {"TENPLEX_STORE_TEST_HOOKS": "corrupt_chunks=5"}}
    with Cluster(tmp_path, ["h0", "h1"], env=env) as cluster:
        arrays = _setup(cluster, old)
        transform(plan(old, new), old, new, cluster.addresses, 1, 2, chunk_bytes=CHUNK)
        assert_version_matches(cluster.roots, new, 2, arrays)


def test_destination_crash_between_prepare_and_commit(tmp_path):
    old = gpt_layout(2, 2, 1, 2, 2)
    new = gpt_layout(1, 4, 1, 2, 2)
    with Cluster(tmp_path, ["h0", "h1"]) as cluster:
        arrays = _setup(cluster, old)
        the_plan = plan(old, new)
        with pytest.raises(TransformError) as info:
            transform(the_plan, old, new, cluster.addresses, 1, 2, before_commit=cluster.procs["h1"].kill)
        cause = info.value.failures["h1"]
        assert "commit phase" in str(info.value) and "UNAVAILABLE" in str(cause)
        assert isinstance(cause, RemoteStoreError) and info.value.retryable  # a store that may come back
        # h0 may have committed before h1 was found dead: it was rolled back
        assert Store(cluster.roots["h0"], "h0").versions() == [1]
        assert Store(cluster.roots["h1"], "h1").versions() == [1]
        assert Store(cluster.roots["h1"], "h1").staged_parts(2) == ["transform"]  # prepared, never visible
        cluster.procs["h1"] = StoreProcess(cluster.roots["h1"], "h1")
        assert_version_matches(cluster.roots, old, 1, arrays)
        # a retry after the host came back succeeds
        transform(the_plan, old, new, cluster.addresses, 1, 2)
        assert_version_matches(cluster.roots, new, 2, arrays)


def test_hosts_commit_at_once_and_one_failed_commit_takes_the_others_back():
    """Phase 2 calls every host's commit concurrently (a barrier that all four must reach: one after the other,
    the first would wait in vain). h1's commit fails: it is aborted and deleted (its commit may have landed),
    h0 and h2 committed and are deleted (h2's delete fails: reported), h3 belongs to another transformation
    (ALREADY_EXISTS) and is left alone."""
    from tenplex.transform.coordinator import _commit_everywhere, _Outcome

    hosts = ["h0", "h1", "h2", "h3"]
    barrier = threading.Barrier(len(hosts), timeout=120)
    calls: list[tuple[str, str]] = []

    class Taken(Exception):
        code = grpc.StatusCode.ALREADY_EXISTS

    class Client:
        def __init__(self, host):
            self.host = host

        def commit(self, version):
            barrier.wait()
            calls.append((self.host, "commit"))
            if self.host == "h1":
                raise OSError("disk gone")
            if self.host == "h3":
                raise Taken("version 2 exists")

        def delete(self, version):
            calls.append((self.host, "delete"))
            if self.host == "h2":
                raise OSError("store went away")

        def abort(self, version):
            calls.append((self.host, "abort"))

    outcome = _Outcome()
    _commit_everywhere({h: Client(h) for h in hosts}, hosts, 2, outcome)
    assert sorted(outcome.failures) == ["h1", "h2", "h3"] and outcome.conflicts == {"h3"}
    assert "disk gone" in str(outcome.failures["h1"])
    assert "committed, and could not be rolled back: store went away" in str(outcome.failures["h2"])
    assert sorted(calls) == [("h0", "commit"), ("h0", "delete"), ("h1", "abort"), ("h1", "commit"),
                             ("h1", "delete"), ("h2", "commit"), ("h2", "delete"), ("h3", "commit")]


def test_a_host_that_does_not_answer_the_abort_is_not_asked_to_delete():
    """A dead or cut-off host would not answer the delete either: the rollback does not wait on it twice."""
    from tenplex.transform.coordinator import _commit_everywhere, _Outcome

    calls: list[tuple[str, str]] = []

    class Client:
        def __init__(self, host):
            self.host = host

        def commit(self, version):
            calls.append((self.host, "commit"))
            if self.host == "h1":
                raise OSError("no answer")

        def delete(self, version):
            calls.append((self.host, "delete"))

        def abort(self, version):
            calls.append((self.host, "abort"))
            if self.host == "h1":
                raise OSError("no answer")

    outcome = _Outcome()
    _commit_everywhere({h: Client(h) for h in ("h0", "h1")}, ["h0", "h1"], 2, outcome)
    assert sorted(calls) == [("h0", "commit"), ("h0", "delete"), ("h1", "abort"), ("h1", "commit")]


def test_commits_that_cannot_all_run_are_rolled_back_before_the_error_is_raised(monkeypatch):
    """An interrupt while the commits run: it is raised after the rollback; the host that committed deletes
    again, the hosts whose commit was not confirmed abort and delete."""
    from tenplex.transform import coordinator

    calls: list[tuple[str, str]] = []

    class Client:
        def __init__(self, host):
            self.host = host

        def commit(self, version):
            calls.append((self.host, "commit"))
            if self.host == "h1":
                raise KeyboardInterrupt

        def delete(self, version):
            calls.append((self.host, "delete"))

        def abort(self, version):
            calls.append((self.host, "abort"))

    monkeypatch.setattr(coordinator, "_COMMIT_THREADS", 1)
    outcome = coordinator._Outcome()
    with pytest.raises(KeyboardInterrupt):
        coordinator._commit_everywhere({h: Client(h) for h in ("h0", "h1", "h2")}, ["h0", "h1", "h2"], 2, outcome)
    assert sorted(outcome.failures) == ["h1", "h2"]  # h2's commit was not confirmed when the interrupt came
    assert [c for c in calls if c[0] == "h0"] == [("h0", "commit"), ("h0", "delete")]
    for host in ("h1", "h2"):  # aborted, and deleted in case their commit landed (h2's ran in its thread)
        assert (host, "abort") in calls and (host, "delete") in calls
        assert calls.index((host, "delete")) > calls.index((host, "commit"))


_COORDINATOR = textwrap.dedent("""
    import json, os, sys
    from tenplex.files import load_layout, load_plan
    from tenplex.transform import transform
    plan, old, new = load_plan(sys.argv[1]), load_layout(sys.argv[2]), load_layout(sys.argv[3])
    transform(plan, old, new, json.loads(sys.argv[4]), 1, 2, before_commit=lambda: os._exit(3))
""")


def test_coordinator_crash_between_prepare_and_commit(tmp_path):
    old = gpt_layout(2, 2, 1, 2, 2)
    new = gpt_layout(2, 1, 2, 2, 2)
    with Cluster(tmp_path / "c", ["h0", "h1"]) as cluster:
        arrays = _setup(cluster, old)
        the_plan = plan(old, new)
        save_plan(the_plan, tmp_path / "plan.json")
        save_layout(old, tmp_path / "old.json")
        save_layout(new, tmp_path / "new.json")
        crashed = subprocess.run([sys.executable, "-c", _COORDINATOR, str(tmp_path / "plan.json"),
                                  str(tmp_path / "old.json"), str(tmp_path / "new.json"),
                                  json.dumps(cluster.addresses)], timeout=300)
        assert crashed.returncode == 3
        for host in ("h0", "h1"):
            assert cluster.client(host).versions() == [1]
            assert Store(cluster.roots[host], host).staged_parts(2) == ["transform"]
        assert_version_matches(cluster.roots, old, 1, arrays)
        transform(the_plan, old, new, cluster.addresses, 1, 2)  # a new coordinator redoes it
        assert_version_matches(cluster.roots, new, 2, arrays)


@pytest.mark.parametrize("fault", ["disk full", "read-only"])
def test_full_or_read_only_destination_aborts_everywhere(tmp_path, fault):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tiny tmpfs")
    old = gpt_layout(1, 2, 1, 1, 2)
    new = gpt_layout(1, 2, 1, 2, 1)
    mount = tmp_path / "h1"
    mount.mkdir()
    size = "64k" if fault == "disk full" else "1m"
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], check=True)
    try:
        with Cluster(tmp_path, ["h0", "h1"]) as cluster:
            arrays = _setup(cluster, old)
            if fault == "read-only":
                subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
            with pytest.raises(TransformError) as info:
                transform(plan(old, new), old, new, cluster.addresses, 1, 2)
            cause = str(info.value.failures["h1"])
            if fault == "disk full":
                assert "RESOURCE_EXHAUSTED" in cause and "No space left" in cause
                assert list((mount / "staging").iterdir()) == []
            else:
                assert "PERMISSION_DENIED" in cause and "Read-only file system" in cause
            assert set(info.value.failures) == {"h1"}
            assert Store(cluster.roots["h0"], "h0").versions() == [1]
            assert Store(cluster.roots["h0"], "h0").staged_parts(2) == []  # aborted on the healthy host too
            assert_version_matches(cluster.roots, old, 1, arrays)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_cancelled_host_part_is_never_prepared(tmp_path):
    """A coordinator cancel makes every pull return early: the part must fail, not prepare zero-filled shards."""
    import threading

    from tenplex.transform import TransformRequest
    from tenplex.transform.host import run_host_part

    old = gpt_layout(1, 2, 1, 1, 2)   # tp=2 on h0/0 and h0/1
    new = gpt_layout(1, 1, 1, 1, 1)   # all on h0/0: local copies, no fan-outs
    roots = {"h0": tmp_path / "h0"}
    write_version(roots, old, 1, random_globals(old))
    cancelled = threading.Event()
    cancelled.set()
    request = TransformRequest(host="h0", old_version=1, new_version=2, plan=plan(old, new), old_layout=old,
                               new_layout=new, peers={"h0": "127.0.0.1:1"})
    store = Store(roots["h0"], "h0")
    with pytest.raises(TransformError, match="cancelled"):
        run_host_part(store, request, lambda p: None, cancelled=cancelled)
    assert store.staged_parts(2) == []
    assert store.versions() == [1]
