"""Snapshots (``Checkpointer.async_save``): real gloo jobs of two ranks on two hosts' stores, real files.

The worker is ``mp/replica_worker.py`` (ops ``snapshot``, ``wait_snapshot``, ``leave_unsettled``, ``restore``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from store_helpers import REPLICA_WORKER, assert_bit_equal
from tenplex.ports import free_port
from tenplex.runtime import launch
from tenplex.store import Store

DEVICES = ["h0/0", "h1/0"]


def run(base: Path, name: str, ops: list[dict], keep: int = 2, expect_failure: bool = False,
        frozen: tuple[str, ...] = ()) -> list[list[dict]]:
    """Run ``ops`` on two ranks, one per host (h0, h1), without replication; every rank's results."""
    out = base / name
    out.mkdir(parents=True)
    (out / "spec.json").write_text(json.dumps({"out": str(out), "ops": ops, "replicas": 0, "keep": keep,
                                               "stores": {}, "frozen": list(frozen)}))
    roots = {h: base / "stores" / h for h in ("h0", "h1")}
    try:
        launch.run_job([sys.executable, str(REPLICA_WORKER), str(out / "spec.json")], DEVICES, roots, {},
                       out / "logs", timeout=240)
    except launch.JobError:
        if not expect_failure:
            raise
    return [json.loads((out / f"result_r{r}.json").read_text()) for r in range(len(DEVICES))]


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


@pytest.fixture(scope="module")
def four_snapshots(tmp_path_factory):
    """Four snapshots in a row, each write slowed down (so each next one meets the previous in flight), keep=2,
    then a restore in a new job."""
    base = tmp_path_factory.mktemp("snapshots")
    snap = {"op": "snapshot", "slow_write": 0.05}
    first = run(base, "train", [{"op": "train", "steps": 1}, snap, snap, snap, snap, {"op": "wait_snapshot"}])
    again = run(base, "restore", [{"op": "restore"}])
    return base, first, again


def test_snapshot_holds_the_values_at_its_step_although_training_changed_them(four_snapshots):
    base, first, again = four_snapshots
    last = [r for r in first[0] if r["op"] == "snapshot"][-1]["step"]
    for rank, ops in enumerate(again):
        assert "error" not in ops[0], ops[0].get("trace")
        assert ops[0]["step"] == last == 4
        restored = load_file(str(base / "restore" / f"restored_r{rank}.safetensors"))
        # The worker trained a step right after each async_save returned: the dump is the state at the call.
        assert_bit_equal(restored, load_file(str(base / "train" / f"snap_step{last}_r{rank}.safetensors")))


def test_back_pressure_one_snapshot_in_flight_and_the_previous_settled_first(four_snapshots):
    base, first, _ = four_snapshots
    for rank, ops in enumerate(first):
        snaps = [r for r in ops if r["op"] == "snapshot"]
        # One writer and one decider thread per rank for all its snapshots (none started per snapshot; replicas=0:
        # no copier); at most one snapshot in flight per rank.
        assert [s["threads"] for s in snaps] == [["tenplex-snapshot-decider", "tenplex-snapshot-writer"]] * 4
        # Each snapshot waited for the previous write and settled it: every earlier future holds its version.
        for k, s in enumerate(snaps):
            assert len(s["previous_done"]) == k and all(isinstance(v, int) for v in s["previous_done"])
        done = [r for r in ops if r["op"] == "wait_snapshot"][0]
        assert done["outcomes"] == [1, 2, 3, 4]  # one version per snapshot, in order, all committed
        assert done["version"] == 4
        stats = done["stats"]
        assert stats["snapshots"] == 4 and stats["committed"] == 4 and stats["failed"] == 0
        assert stats["committed_step"] == 4 and stats["replication_lag"] == 0
        # w's rows are on one host each and nothing is copied (replicas=0): no step survives the loss of a host.
        assert (stats["spread"], stats["copies"], stats["protected_step"]) == (False, 0, None)
        # Staging memory: one copy of the rank's state (model and Adam moments), reused by every snapshot.
        dump = load_file(str(base / "train" / f"snap_step4_r{rank}.safetensors"))
        assert stats["staging_bytes"] == state_bytes(dump)


def test_retention_keeps_the_newest_versions(four_snapshots):
    base, first, _ = four_snapshots
    for ops in first:
        assert [r for r in ops if r["op"] == "wait_snapshot"][0]["versions"] == [3, 4]  # keep=2
    for host in ("h0", "h1"):
        assert Store(base / "stores" / host, host).versions() == [3, 4]


def shard_inode(root: Path, host: str, version: int, tensor: str) -> int:
    """The inode of the file that holds ``tensor`` (its one box on the host's device) in ``version``."""
    reader = Store(root, host).open(version)
    try:
        (entry,) = [e for e in reader.entries if e.tensor == tensor]
        return (root / "versions" / str(version) / entry.file).stat().st_ino
    finally:
        reader.close()


def test_unchanged_shards_are_hard_links_to_the_previous_snapshot(tmp_path):
    snap = {"op": "snapshot"}
    ranks = run(tmp_path, "train", [{"op": "train", "steps": 1}, snap, snap, {"op": "wait_snapshot"}], keep=5,
                frozen=("b",))
    for rank, ops in enumerate(ranks):
        assert ops[-1]["outcomes"] == [1, 2]
        first, second = [r["stats"] for r in ops if r["op"] == "snapshot"]
        dump = load_file(str(tmp_path / "train" / f"snap_step2_r{rank}.safetensors"))
        frozen = dump["b"].numel() * dump["b"].element_size()
        # The frozen bias is not staged by the second snapshot: its file is linked from the first.
        assert first["linked_bytes"] == 0 and first["staging_bytes"] == state_bytes(dump)
        assert second["linked_bytes"] == frozen and second["staging_bytes"] == state_bytes(dump) - frozen
    for host in ("h0", "h1"):
        root = tmp_path / "stores" / host
        assert shard_inode(root, host, 1, "b") == shard_inode(root, host, 2, "b")
        for trained in ("w", "optim.exp_avg.w", "optim.exp_avg_sq.w"):
            assert shard_inode(root, host, 1, trained) != shard_inode(root, host, 2, trained)
    again = run(tmp_path, "restore", [{"op": "restore"}], frozen=("b",))
    for rank, ops in enumerate(again):
        assert ops[0]["step"] == 2 and ops[0]["info"]["version"] == 2
        assert_bit_equal(load_file(str(tmp_path / "restore" / f"restored_r{rank}.safetensors")),
                         load_file(str(tmp_path / "train" / f"snap_step2_r{rank}.safetensors")))


def test_a_rank_killed_during_the_background_write_leaves_the_previous_snapshot_newest(tmp_path):
    run(tmp_path, "train", [{"op": "train", "steps": 1}, {"op": "snapshot"}, {"op": "wait_snapshot"},
                            {"op": "snapshot", "die_in_write_on_rank": 1}, {"op": "leave_unsettled"}],
        keep=5, expect_failure=True)
    # Rank 0 prepared its part of version 2 and waited; rank 1 died before preparing: nothing is committed.
    assert (tmp_path / "stores" / "h0" / "staging" / "2" / "rank0.part.json").is_file()
    for host in ("h0", "h1"):
        assert Store(tmp_path / "stores" / host, host).versions() == [1]
    again = run(tmp_path, "restore", [{"op": "restore"}])
    for rank, ops in enumerate(again):
        assert ops[0]["step"] == 1 and ops[0]["info"]["version"] == 1
        assert_bit_equal(load_file(str(tmp_path / "restore" / f"restored_r{rank}.safetensors")),
                         load_file(str(tmp_path / "train" / f"snap_step1_r{rank}.safetensors")))


@pytest.fixture
def small_tmpfs(tmp_path):
    """h0's store on a 256 KiB tmpfs of its own (mounted as root, unmounted after)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    root = tmp_path / "stores" / "h0"
    root.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(root)], check=True)
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], check=True)


def test_a_full_disk_fails_one_snapshot_in_one_log_line_and_training_goes_on(tmp_path, small_tmpfs):
    filler = {"rank": 0, "path": str(small_tmpfs / "filler")}
    ranks = run(tmp_path, "train", [{"op": "train", "steps": 1}, {"op": "snapshot"}, {"op": "wait_snapshot"},
                                    {"op": "fill_disk", **filler}, {"op": "snapshot"}, {"op": "wait_snapshot"},
                                    {"op": "free_disk", **filler}, {"op": "snapshot"}, {"op": "wait_snapshot"}],
                keep=5)
    for ops in ranks:
        done = [r for r in ops if r["op"] == "wait_snapshot"]
        assert done[0]["outcomes"] == [1]
        # The second snapshot (version 2) failed on rank 0 and was dropped everywhere; the third is tried and lands.
        assert "version 2" in done[1]["outcomes"][1] and "No space left on device" in done[1]["outcomes"][1]
        assert done[2]["outcomes"][2] == 2 and done[2]["stats"]["failed"] == 1  # its number, free again
        assert [r["step"] for r in ops if r["op"] == "snapshot"] == [1, 2, 3]  # training went on
    for host in ("h0", "h1"):
        assert Store(tmp_path / "stores" / host, host).versions() == [1, 2]
    lines = [line for line in (tmp_path / "train" / "logs" / "rank0.log").read_text().splitlines()
             if "snapshot" in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("tenplex: snapshot of step 2 (version 2) failed on rank 0: OSError: [Errno 28] No "
                               "space left on device")
    assert "training goes on" in lines[0]
    assert "snapshot" not in (tmp_path / "train" / "logs" / "rank1.log").read_text()


def test_a_key_value_store_that_answers_late_is_retried_and_late_commits_are_counted(tmp_path):
    """Issue 42 item 4: the first connection fails (nothing listens yet); once the store answers, snapshots
    commit in the background again, and the snapshots committed at a boundary instead are counted."""
    worker = Path(__file__).parent / "mp" / "late_commit_worker.py"
    subprocess.run([sys.executable, str(worker), str(tmp_path), str(free_port())], check=True, timeout=240,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["first"]["committed_step"], result["first"]["late_commits"]) == (0, 1)
    assert result["failed_first"] >= 1  # an attempt failed before the store came up: the retry is what connects
    on_time = result["on_time"]
    assert on_time is not None, "no snapshot committed through the key-value store once it answered"
    last = result["last"]
    # Snapshots 0 .. on_time-1 committed at the next boundary; on_time (and none after it) in the background.
    assert (last["committed_step"], last["committed"], last["late_commits"], last["failed"]) == (
        on_time, on_time + 1, on_time, 0)
