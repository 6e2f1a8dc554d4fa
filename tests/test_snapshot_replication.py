"""Snapshots and replication: a host's store dies while another host pulls the copies of a snapshot.

Real gloo jobs (``mp/replica_worker.py``), one rank per host, each host with its own store process. h1's
store exits abruptly (``os._exit(137)``, as a SIGKILL) in the middle of the copy of the second snapshot that
h2 pulls from it (``TENPLEX_STORE_TEST_HOOKS``); training goes on. Then h1 is gone with its disk, and the
survivors restore, a second rank on h0 in h1's place, and snapshot again.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from store_helpers import StoreProcess, assert_bit_equal, run_replica_job
from tenplex.store import Store

# Each copy of h1's part (w's rows and Adam's two moments) is 3 chunks: h1's store dies on its 2nd chunk of the
# second snapshot's copy.
H1_DIES_AFTER_CHUNKS = 4


def joined(out: Path, stem: str, ranks: int) -> dict[str, torch.Tensor]:
    """The ranks' dumps put together: rows of w and its moments in rank order (rank r holds the r-th rows)."""
    parts = [load_file(str(out / f"{stem}_r{r}.safetensors")) for r in range(ranks)]
    return {k: (parts[0][k] if k == "b" or k.endswith(".b") else torch.cat([p[k] for p in parts]))
            for k in parts[0]}


@pytest.fixture(scope="module")
def lost_mid_copy(tmp_path_factory):
    base = tmp_path_factory.mktemp("snapshot-replication")
    procs = {h: StoreProcess(base / "stores" / h, h) for h in ("h0", "h2", "h3")}
    procs["h1"] = StoreProcess(base / "stores" / "h1", "h1",
                               env={"TENPLEX_STORE_TEST_HOOKS": f"exit_after_chunks={H1_DIES_AFTER_CHUNKS}"})
    try:
        snap = [{"op": "snapshot"}, {"op": "wait_snapshot"}, {"op": "wait_replicated", "timeout": 30}]
        train = run_replica_job(base, "train", ["h0/0", "h1/0", "h2/0", "h3/0"], procs,
                                [{"op": "train", "steps": 1}, *snap, *snap, *snap], replicas=1, keep=10)
        died = procs["h1"].proc.wait(120)
        shutil.rmtree(procs["h1"].root)  # h1 is lost with its disk
        survivors = {h: procs[h] for h in ("h0", "h2", "h3")}
        after = run_replica_job(base, "after", ["h0/0", "h0/1", "h2/0", "h3/0"], survivors,
                                [{"op": "restore"}, {"op": "train", "steps": 1}, *snap], replicas=1, keep=10)
        yield {"base": base, "train": train, "after": after, "died": died,
               "roots": {h: p.root for h, p in procs.items()}}
    finally:
        for p in procs.values():
            p.stop()


def test_training_goes_on_and_the_copier_reports_the_failed_copy(lost_mid_copy):
    train = lost_mid_copy["train"]
    assert lost_mid_copy["died"] == 137
    for ops in train:
        done = [o for o in ops if o["op"] == "wait_snapshot"]
        assert done[-1]["outcomes"] == [1, 2, 3]  # every snapshot committed: the ranks write their own disks
        assert [o["ok"] for o in ops if o["op"] == "wait_replicated"] == [True, False, False]
    # Committed is not protected: h2's rank saw snapshots up to step 3 committed, but only step 1's copy of h1's
    # rows committed on h2, so step 1 is the newest that survives the loss of h1 (as the restore below finds).
    stats = [o for o in train[2] if o["op"] == "wait_snapshot"][-1]["stats"]
    assert (stats["committed_step"], stats["protected_step"], stats["spread"], stats["copies"]) == (3, 1, False, 1)
    status = train[2][-1]["status"]  # h2 pulls h1's part: it saw the store die
    assert status["state"] == "failed" and "h1" in status["error"]
    assert train[2][-1]["hosts"] and any(r["status"]["state"] == "failed" for r in train[0][-1]["hosts"])


def test_the_survivors_restore_the_newest_snapshot_they_hold_bit_for_bit(lost_mid_copy):
    base, after = lost_mid_copy["base"], lost_mid_copy["after"]
    for ops in after:
        assert "error" not in ops[0], ops[0].get("trace")
        # Version 1 is the newest whose copies of h1's part were committed (on h2); 2 and 3 lack h1's rows.
        assert ops[0]["step"] == 1 and ops[0]["info"]["saved_version"] == 1 and ops[0]["info"]["lost_hosts"] == ["h1"]
    assert_bit_equal(joined(base / "after", "restored", 4), joined(base / "train", "snap_step1", 4))


def test_the_next_snapshot_is_copied_among_the_survivors(lost_mid_copy):
    after = lost_mid_copy["after"]
    for ops in after:
        assert [o["ok"] for o in ops if o["op"] == "wait_replicated"] == [True]
        version = [o for o in ops if o["op"] == "wait_snapshot"][-1]["version"]
    doc = Store(lost_mid_copy["roots"]["h0"], "h0").open(version).get_json("tenplex.stores")
    assert doc["ring"] == ["h0", "h2", "h3"] and doc["replicas"] == 1
