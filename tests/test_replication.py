"""Replicated state and recovery from a lost host.

Pure rules (which regions are copied where, what survivors can assemble) with exact
expected values; the copier against real store processes (commit, failure of the
origin mid-copy, cancel); and whole jobs of real gloo ranks with real store processes,
in which a host's store is killed and its directory deleted:

* the survivors restore the newest version they can assemble completely, from the
  copies, bit for bit, and the planner and the restore read the copies as sources;
* a host lost while a version was still being copied leaves that version not counted
  as replicated, and the restore falls back to the previous one (the step lost is reported);
* a host that left but whose store still answers is reached through the recorded address;
* with replication off, losing the only copy is a LostStateError naming tensor, box and
  host, and nothing is restored.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from store_helpers import StoreProcess, assert_bit_equal, random_globals, run_replica_job, write_version
from tenplex.box import Box
from tenplex.layout import Layout, Shard, TensorSpec
from tenplex.planner import plan
from tenplex.replication import Copy, Lost, assemble, copies, effective_replicas
from tenplex.replication.copier import Replicator, held_layout, held_versions, replica_store
from tenplex.replication.plan import copy_layout
from tenplex.replication.stores import replicas_of
from tenplex.store import Store

ROWS, COLS = 8, 6
F32 = "float32"


def rows(lo: int, hi: int, cols: int = COLS) -> Box:
    return Box((lo, 0), (hi - lo, cols))


def three_hosts() -> Layout:
    """w split by rows over h0/0, h1/0, h2/0; h0/1 also holds h1/0's rows (a replica across hosts); b everywhere."""
    tensors = {"w": TensorSpec((6, 4), F32), "b": TensorSpec((4,), F32)}
    whole_b = Shard("b", Box((0,), (4,)))
    return Layout.build(tensors, {
        "h0/0": [Shard("w", rows(0, 2, 4)), whole_b], "h0/1": [Shard("w", rows(2, 4, 4))],
        "h1/0": [Shard("w", rows(2, 4, 4)), whole_b], "h2/0": [Shard("w", rows(3, 6, 4)), whole_b]})


# ------------------------------------------------------------------ pure rules
def test_replica_count_defaults_to_one_with_two_or_more_hosts_and_is_capped():
    assert [effective_replicas(None, n) for n in (1, 2, 5)] == [0, 1, 1]
    assert [effective_replicas(0, 3), effective_replicas(2, 3), effective_replicas(5, 3)] == [0, 2, 2]
    with pytest.raises(ValueError):
        effective_replicas(-1, 3)


def test_only_regions_no_other_host_holds_are_copied_to_the_next_hosts_of_the_ring():
    layout = three_hosts()
    # rows 2:4 are on h0 and h1, row 3 also on h2, b on every host: none of that is copied.
    assert copies(layout, 1) == [
        Copy("h0", "h1", "h0/0", "w", rows(0, 2, 4)),
        Copy("h2", "h0", "h2/0", "w", rows(4, 6, 4)),
    ]
    assert copies(layout, 2) == [
        Copy("h0", "h1", "h0/0", "w", rows(0, 2, 4)), Copy("h0", "h2", "h0/0", "w", rows(0, 2, 4)),
        Copy("h2", "h0", "h2/0", "w", rows(4, 6, 4)), Copy("h2", "h1", "h2/0", "w", rows(4, 6, 4)),
    ]
    assert copies(layout, 0) == []


def test_copies_become_devices_of_their_holder_above_every_index_it_uses():
    layout = three_hosts()
    held = {"h0": {"h2": copy_layout(layout, [c for c in copies(layout, 1) if c.holder == "h0"])}}
    found = assemble(layout, ["h0", "h1"], held, taken={"h0": {0, 5}})
    assert found.lost == []
    assert found.replica_devices == {"h0/6": ("h0", "h2/0")}
    assert found.layout.devices["h0/6"] == (Shard("w", rows(4, 6, 4)),)
    assert "h2/0" not in found.layout.devices
    # The planner reads the copy like any other replica: rows 4:6 come from h0's copy device.
    new = Layout.build(layout.tensors, {"h1/0": [Shard("w", rows(0, 6, 4)), Shard("b", Box((0,), (4,)))]})
    sources = {(t.src, t.box) for t in plan(found.layout, new).transfers if t.box.offsets[0] >= 4}
    assert sources == {("h0/6", rows(4, 6, 4))}


def test_without_a_copy_every_lost_region_is_named_with_its_host_and_device():
    layout = three_hosts()
    found = assemble(layout, ["h0", "h1"], {})
    assert found.layout is None
    assert found.lost == [Lost("w", rows(4, 6, 4), "h2", "h2/0")]  # row 3 survives on h0/1 and h1/0
    assert str(found.lost[0]) == "tensor 'w' box [4:6, 0:4] (device h2/0 on host h2)"
    # A copy held by a lost host does not help: h0 held the copy of h2's rows.
    held = {"h0": {"h2": copy_layout(layout, [c for c in copies(layout, 1) if c.holder == "h0"])}}
    assert assemble(layout, ["h1"], held).lost == [Lost("w", rows(0, 2, 4), "h0", "h0/0"),
                                                  Lost("w", rows(4, 6, 4), "h2", "h2/0")]


def test_the_rules_are_pure():
    code = ("import sys, json; import tenplex.replication.plan; "
            "print(json.dumps([m for m in sys.modules if m.startswith(('grpc', 'torch', 'tenplex.store'))]))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       check=True).stdout)
    assert loaded == []


def test_a_replica_count_needs_every_hosts_store_address(tmp_path):
    from tenplex import Checkpointer
    from tenplex.errors import ConfigError
    from tenplex.integration.savedoc import replica_count

    with pytest.raises(ConfigError, match="replicas must be >= 0"):
        Checkpointer(store_root=tmp_path, replicas=-1)
    assert replica_count(1, {"h0": "127.0.0.1:1", "h1": "127.0.0.1:2"}, ["h0", "h1"], rank=0) == 1
    with pytest.raises(ConfigError, match=r"host\(s\) h1 reported none: set TENPLEX_STORE_ADDRESS"):
        replica_count(1, {"h0": "127.0.0.1:1"}, ["h0", "h1"], rank=0)
    assert replica_count(0, {}, ["h0", "h1"], rank=0) == 0


# -------------------------------------------------------- copier, real stores
def two_hosts() -> Layout:
    tensors = {"w": TensorSpec((64, 256), F32), "b": TensorSpec((256,), F32)}
    b = Shard("b", Box((0,), (256,)))
    return Layout.build(tensors, {"h0/0": [Shard("w", rows(0, 32, 256)), b],
                                  "h1/0": [Shard("w", rows(32, 64, 256)), b]})


@pytest.fixture
def stores(tmp_path):
    procs = {}

    def start(host: str, env: dict | None = None) -> StoreProcess:
        procs[host] = StoreProcess(tmp_path / host, host, env=env)
        return procs[host]
    yield start
    for p in procs.values():
        p.stop()


def test_copies_are_pulled_verified_and_committed_as_their_own_version(tmp_path, stores):
    layout, arrays = two_hosts(), random_globals(two_hosts())
    roots = {h: tmp_path / h for h in ("h0", "h1")}
    h0 = stores("h0")
    write_version(roots, layout, 3, arrays)
    replicator = Replicator(Store(roots["h1"], "h1"), 3, layout, 1, {"h0": h0.address}).start()
    assert replicator.wait(300), replicator.status()
    assert replicator.status()["bytes"] == 32 * 256 * 4  # only h0's rows: b is on both hosts
    assert held_versions(roots["h1"], "h1") == {"h0": [3]}
    assert held_layout(roots["h1"], "h1", "h0", 3).devices == {"h0/0": (Shard("w", rows(0, 32, 256)),)}
    reader = replica_store(roots["h1"], "h0", "h1").open(3)
    assert np.array_equal(reader.read("h0/0", "w", rows(0, 32, 256)).view(np.uint32), arrays["w"][:32].view(np.uint32))
    assert reader.verify() == []
    assert Store(roots["h0"], "h0").versions() == [3]  # the origin is untouched


def test_an_origin_dying_mid_copy_leaves_no_committed_copy(tmp_path, stores, monkeypatch):
    monkeypatch.setattr("tenplex.replication.copier.CHUNK_BYTES", 4096)  # many chunks: die after the second
    layout, arrays = two_hosts(), random_globals(two_hosts())
    roots = {h: tmp_path / h for h in ("h0", "h1")}
    write_version(roots, layout, 1, arrays)
    h0 = stores("h0", env={"TENPLEX_STORE_TEST_HOOKS": "exit_after_chunks=2"})
    replicator = Replicator(Store(roots["h1"], "h1"), 1, layout, 1, {"h0": h0.address}, timeout=10).start()
    assert not replicator.wait(300)
    assert replicator.status()["state"] == "failed" and "h0" not in held_versions(roots["h1"], "h1")
    assert not any((roots["h1"] / "replicas" / "h0" / "staging").iterdir())  # the partial copy was dropped
    assert h0.proc.wait(120) == 137


def test_a_cancelled_copy_is_dropped(tmp_path, stores, monkeypatch):
    monkeypatch.setattr("tenplex.replication.copier.CHUNK_BYTES", 4096)
    layout, arrays = two_hosts(), random_globals(two_hosts())
    roots = {h: tmp_path / h for h in ("h0", "h1")}
    write_version(roots, layout, 1, arrays)
    h0 = stores("h0")
    replicator = Replicator(Store(roots["h1"], "h1"), 1, layout, 1, {"h0": h0.address})
    from tenplex.store.target import ShardTarget
    original = ShardTarget.write

    def write_then_cancel(self, region, data, *digest):  # the first chunk lands, then the next save cancels the copy
        original(self, region, data, *digest)
        replicator._cancel.set()
    monkeypatch.setattr(ShardTarget, "write", write_then_cancel)
    replicator.start()
    assert not replicator.wait(300)
    assert replicator.status()["state"] == "cancelled" and held_versions(roots["h1"], "h1") == {}
    assert not any((roots["h1"] / "replicas" / "h0" / "staging").iterdir())


def test_bench_replicate_copies_without_holding_the_version(tmp_path):
    size = 32 << 20
    proc = subprocess.run([sys.executable, "-m", "tenplex.cli", "bench", "replicate", "--json", "--bytes", str(size),
                           "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert set(result) == {"benchmark", "bytes", "chunk_bytes", "replicate_s", "replicate_gbps",
                           "replicate_rss_growth_bytes", "baseline_read_s", "baseline_rss_growth_bytes", "load"}
    assert result["bytes"] == size
    # The copier streams chunk by chunk; the baseline holds the whole version in memory.
    assert result["replicate_rss_growth_bytes"] < size // 2 <= result["baseline_rss_growth_bytes"]


# ------------------------------------------------------------ whole jobs (gloo)
def full_state(out: Path, stem: str, results: list[list[dict]], op: str) -> dict[str, torch.Tensor]:
    """Each rank's dumped local state, put together: rows of w and its moments; b from rank 0."""
    parts = []
    for rank, ops in enumerate(results):
        lo, hi = next(o for o in ops if o["op"] == op)["rows"]
        parts.append((lo, load_file(str(out / f"{stem}_r{rank}.safetensors"))))
    state = {k: v for k, v in parts[0][1].items() if k.endswith("b")}
    for key in [k for k in parts[0][1] if not k.endswith("b")]:
        state[key] = torch.cat([p[key] for _, p in sorted(parts, key=lambda x: x[0])])
    return state


@pytest.fixture(scope="module")
def recovery(tmp_path_factory):
    """A job's life on hosts h0, h1, h2, each with its own store process (stores keep every version here):

    * first  [h0, h1]: save steps 1 and 2 (versions 1, 2), each copied to the other host;
    * second [h0, h1]: save step 3 (version 3) while h1's store dies in the middle of h0's copy;
    * rejoin [h0, h1]: h1 is back with an empty disk; restore (from h0's copy of h1's part of version 2), save step 4;
    * smaller [h0, h2]: h1 is lost (store killed, disk gone), h2 is new; restore step 4 from the copies, save step 5;
    * alone  [h0]: h2 left but its store still answers; restore step 5 through the address recorded with it.
    """
    base = tmp_path_factory.mktemp("recovery")
    procs = {h: StoreProcess(base / "stores" / h, h) for h in ("h0", "h1", "h2")}
    try:
        def hosts(*names):
            return {h: procs[h] for h in names}

        saves = [{"op": "save"}, {"op": "wait_replicated"}]
        first = run_replica_job(base, "first", ["h0/0", "h1/0"], hosts("h0", "h1"),
                    [{"op": "train", "steps": 1}, *saves, {"op": "train", "steps": 1}, *saves], keep=10)
        # h1's store dies on the second chunk it sends: in the middle of h0's copy of step 3.
        procs["h1"].stop()
        procs["h1"] = StoreProcess(base / "stores" / "h1", "h1",
                                   env={"TENPLEX_STORE_TEST_HOOKS": "exit_after_chunks=1"})
        second = run_replica_job(base, "second", ["h0/0", "h1/0"], hosts("h0", "h1"),
                     [{"op": "restore"}, {"op": "train", "steps": 1}, *saves], keep=10)
        died = procs["h1"].proc.wait(120)
        copies_after_second = held_versions(procs["h0"].root, "h0")
        procs["h1"].stop()
        shutil.rmtree(procs["h1"].root)  # h1 was lost with its disk, and comes back with an empty store
        procs["h1"] = StoreProcess(base / "stores" / "h1", "h1")
        rejoin = run_replica_job(base, "rejoin", ["h0/0", "h1/0"], hosts("h0", "h1"),
                     [{"op": "restore"}, {"op": "train", "steps": 2}, *saves], keep=10)
        procs["h1"].kill()
        shutil.rmtree(procs["h1"].root)  # lost for good
        smaller = run_replica_job(base, "smaller", ["h0/0", "h2/0"], hosts("h0", "h2"),
                      [{"op": "restore"}, {"op": "train", "steps": 1}, *saves], keep=10)
        alone = run_replica_job(base, "alone", ["h0/0"], hosts("h0"), [{"op": "restore"}], keep=10)
        yield {"base": base, "first": first, "second": second, "rejoin": rejoin, "smaller": smaller, "alone": alone,
               "died": died, "copies_after_second": copies_after_second, "roots": {h: p.root for h, p in procs.items()}}
    finally:
        for p in procs.values():
            p.stop()


def restored(recovery, job: str) -> tuple[int, dict]:
    """The step every rank of ``job`` restored (the same on all) and rank 0's RestoreInfo."""
    records = [ops[0] for ops in recovery[job]]
    for record in records:
        assert "error" not in record, record.get("trace")
    # every rank got the same answer; only the bytes it restored, by source, are its own
    assert len({json.dumps({**r["info"], "bytes": None}, sort_keys=True) for r in records}) == 1
    assert all(set(r["info"]["bytes"]) == {"memory", "this_host", "other_hosts"} for r in records)
    return records[0]["step"], records[0]["info"]


def test_saves_record_every_store_and_count_as_replicated_once_copies_commit(recovery):
    first = recovery["first"]
    for rank_ops in first:
        assert [o["ok"] for o in rank_ops if o["op"] == "wait_replicated"] == [True, True]
    assert first[0][-1]["status"]["state"] == "replicated" and first[0][-1]["status"]["copies"] == 3  # w + 2 moments
    # Workers had no TENPLEX_STORES: the copier found the other host through the recorded address.
    doc = Store(recovery["roots"]["h0"], "h0").open(2).get_json("tenplex.stores")
    assert doc["format"] == "tenplex.stores/1" and doc["version"] == 2 and doc["replicas"] == 1
    assert doc["ring"] == ["h0", "h1"]
    assert sorted(doc["stores"]) == ["h0", "h1"] and all(doc["stores"].values())


def test_a_host_lost_mid_copy_leaves_that_version_not_replicated(recovery):
    second = recovery["second"]
    assert recovery["died"] == 137
    assert [o["ok"] for o in second[0] if o["op"] == "wait_replicated"] == [False]
    assert [o["ok"] for o in second[1] if o["op"] == "wait_replicated"] == [False]  # same answer on every rank
    status = second[0][-1]["status"]
    assert status["version"] == 3 and status["state"] == "failed" and "h1/0" in status["error"]  # read from h1 failed
    # h0 holds committed copies of h1's versions 1 and 2 only: version 3's copy never committed.
    assert recovery["copies_after_second"]["h1"] == [1, 2]


def test_a_host_back_with_an_empty_store_gets_its_part_from_the_copies_bit_for_bit(recovery):
    step, info = restored(recovery, "rejoin")
    assert step == 2 and info["saved_version"] == 2 and info["step"] == 2 and info["lost_hosts"] == ["h1"]
    # Version 3 is skipped (not counted as replicated, so it cannot be assembled): step 3 is lost.
    assert [(s["version"], s["step"]) for s in info["skipped"]] == [(3, 3)]
    # h1/0 reads its rows from the version put together on h0 (read-through: no transformed version).
    assert info["promoted_version"] == 4 and info["read_through"] and not info["transformed"] and info["version"] == 4
    assert info["replica_devices"] == {"h0/1": ["h0", "h1/0"]}
    saved = full_state(recovery["base"] / "first", "saved_step2", recovery["first"], "save")
    assert_bit_equal(full_state(recovery["base"] / "rejoin", "restored", recovery["rejoin"], "restore"), saved)


def test_the_plan_from_the_put_together_version_takes_the_lost_hosts_rows_from_the_copy(recovery):
    h0 = Store(recovery["roots"]["h0"], "h0")
    # The restore's new layout is the layout the same job saved next (version 5 by rejoin, 7 by smaller).
    for promoted, saved_next, target in ((4, 5, "h1/0"), (6, 7, "h2/0")):
        old, new = h0.open(promoted).layout(), h0.open(saved_next).layout()
        # The copy is device h0/1 of the promoted version, linked from h0's committed copy of h1's rows.
        assert {s.tensor: s.box for s in old.devices["h0/1"]} == {
            "w": rows(4, 8), "optim.exp_avg.w": rows(4, 8), "optim.exp_avg_sq.w": rows(4, 8)}
        assert not any(d.startswith("h1/") for d in old.devices)
        moves = [t for t in plan(old, new).transfers if t.dst == target and t.tensor.endswith("w")]
        assert moves and {(t.src, t.box) for t in moves} == {("h0/1", rows(4, 8))}
    # Versions a restore made carry the saved version's record: they are not copied themselves.
    assert [replicas_of(h0.open(v).get_json("tenplex.stores"), v) for v in (2, 4, 5, 6)] == [1, None, 1, None]


def test_survivors_in_a_smaller_world_resume_from_the_copies_bit_for_bit(recovery):
    step, info = restored(recovery, "smaller")
    assert step == 4 and info["saved_version"] == 5 and info["lost_hosts"] == ["h1"] and info["skipped"] == []
    assert info["promoted_version"] == 6 and info["read_through"] and not info["transformed"] and info["version"] == 6
    saved = full_state(recovery["base"] / "rejoin", "saved_step4", recovery["rejoin"], "save")
    assert_bit_equal(full_state(recovery["base"] / "smaller", "restored", recovery["smaller"], "restore"), saved)


def test_a_departed_host_is_reached_through_its_recorded_store(recovery):
    step, info = restored(recovery, "alone")
    # Step 5 was saved by h0 and h2; h2 left the job but its store answers at the recorded address.
    assert step == 5 and info["lost_hosts"] == [] and info["promoted_version"] is None
    # h2's store answers but h2 is not in the job: the stores transform the state onto h0 rather than leave
    # the job depending on h2's store until its next save.
    assert info["transformed"] and not info["read_through"] and info["plan_stats"]["inter_host_bytes"] > 0
    saved = full_state(recovery["base"] / "smaller", "saved_step5", recovery["smaller"], "save")
    assert_bit_equal(full_state(recovery["base"] / "alone", "restored", recovery["alone"], "restore"), saved)


def test_without_replication_a_lost_only_copy_is_an_error_and_nothing_is_restored(tmp_path):
    procs = {h: StoreProcess(tmp_path / "stores" / h, h) for h in ("h0", "h1")}
    try:
        run_replica_job(tmp_path, "save", ["h0/0", "h1/0"], procs, [{"op": "train", "steps": 1}, {"op": "save"}],
                        replicas=0)
        procs["h1"].kill()
        shutil.rmtree(procs["h1"].root)
        alone = run_replica_job(tmp_path, "restore", ["h0/0"], {"h0": procs["h0"]}, [{"op": "restore"}],
                                replicas=0)
    finally:
        for p in procs.values():
            p.stop()
    restore = alone[0][0]
    assert restore["error"] == "LostStateError", restore
    message = restore["message"]
    for words in ("version 1 (step 1)", "tensor 'w' box [4:8, 0:6] (device h1/0 on host h1)",
                  "tensor 'optim.exp_avg.w' box [4:8, 0:6]", "replicas=0", "Nothing was restored", "replicas=1"):
        assert words in message, (words, message)
    assert restore["versions"] == [1]  # nothing was put together or transformed
    state = load_file(str(tmp_path / "restore" / "restored_r0.safetensors"))
    fresh = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    assert torch.equal(state["w"], fresh) and torch.equal(state["b"], torch.zeros(COLS))  # the model is untouched


def test_a_full_disk_is_reported_with_the_copy_and_its_directory(tmp_path, stores):
    """Issue 31: a copy that does not fit its holder's disk fails naming the directory, not a bare OSError."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a 4 MiB tmpfs")
    try:
        tensors = {"w": TensorSpec((2048, 1024), F32)}  # 8 MiB, all on h0
        layout = Layout.build(tensors, {"h0/0": [Shard("w", rows(0, 2048, 1024))], "h1/0": []})
        roots = {"h0": tmp_path / "h0", "h1": mount / "h1"}
        write_version(roots, layout, 1, random_globals(layout))
        h0 = stores("h0")
        replicator = Replicator(Store(roots["h1"], "h1"), 1, layout, 1, {"h0": h0.address}, timeout=30).start()
        assert not replicator.wait(300)
        status = replicator.status()
        assert status["state"] == "failed", status
        assert "No space left on device" in status["error"] and str(mount / "h1" / "replicas" / "h0") in \
            status["error"] and "'w'" in status["error"], status["error"]
        assert "h0" not in held_versions(roots["h1"], "h1")
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
