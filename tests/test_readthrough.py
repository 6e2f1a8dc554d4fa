"""Read-through restore: a rank runs its device's transfers of the plan into its tensors (no new version).

Real stores: the saved version lies in host h0's store directory and a real
``tenplex store serve`` process serves it; a device on h1 reads from it (over
gRPC for these small regions, over the data plane when told to use it for
every size), a device on h0 from the files.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tenplex.box import Box
from tenplex.integration import Annotation
from tenplex.integration.pieces import tensor_pieces
from tenplex.integration import readthrough
from tenplex.integration.readthrough import RemoteVersion, fans_out, read_through, source_hosts
from tenplex.integration.shardio import write_piece
from tenplex.layout import Layout, Shard, TensorSpec
from tenplex.planner import plan
from tenplex.store import Store
from tenplex.store.client import RemoteStoreError, StoreClient

from store_helpers import StoreProcess, assert_bit_equal, run_replica_job

ROWS, COLS = 4, 6
FULL_W = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
FULL_B = torch.arange(COLS, dtype=torch.float64) / 7
SPECS = {"w": TensorSpec((ROWS, COLS), "float32"), "b": TensorSpec((COLS,), "float64")}
# Saved: w in two column halves on h0/0 and h0/1, b whole on h0/0.
OLD = Layout.build(SPECS, {"h0/0": [Shard("w", Box((0, 0), (ROWS, 3))), Shard("b", Box.whole((COLS,)))],
                           "h0/1": [Shard("w", Box((0, 3), (ROWS, 3)))]})


def save_old(root) -> None:
    with Store(root, "h0").begin(1) as writer:
        for device, shards in OLD.devices.items():
            for shard in shards:
                values = (FULL_W if shard.tensor == "w" else FULL_B)[shard.box.slices()].contiguous()
                piece, = tensor_pieces(shard.tensor, values, Annotation(SPECS[shard.tensor].shape, shard.box.offsets))
                write_piece(writer, device, piece)
        writer.commit()


class Recorded:
    """A reader that notes every region asked of it, then reads it."""

    def __init__(self, reader):
        self.reader, self.calls = reader, []

    def read(self, device, tensor, box):
        self.calls.append((device, tensor, box))
        return self.reader.read(device, tensor, box)

    def readinto(self, device, tensor, box, dest):
        self.calls.append((device, tensor, box))
        self.reader.readinto(device, tensor, box, dest)


@pytest.fixture
def h0(tmp_path):
    save_old(tmp_path / "h0")
    server = StoreProcess(tmp_path / "h0", "h0")
    yield server
    server.stop()


def test_a_device_reads_its_transfers_from_the_source_hosts_store_and_its_own(h0):
    # h1/0 needs columns 2:5 of rows 1:3 (both old halves: each region is a column block of its tensor) and b;
    # h0/2 needs row 3 whole, which its own host holds.
    new = Layout.build(SPECS, {"h1/0": [Shard("w", Box((1, 2), (2, 3))), Shard("b", Box.whole((COLS,)))],
                               "h0/2": [Shard("w", Box((3, 0), (1, COLS)))]})
    the_plan = plan(OLD, new)
    assert not fans_out(the_plan)
    assert source_hosts(the_plan, "h1/0") == {"h0"} and source_hosts(the_plan, "h0/2") == {"h0"}

    w = torch.full((2, 3), -1.0)
    b = torch.zeros(COLS, dtype=torch.float64)
    pieces = tensor_pieces("w", w, Annotation((ROWS, COLS), (1, 2))) + tensor_pieces("b", b)
    with StoreClient(h0.address) as client:
        remote = Recorded(RemoteVersion(client, 1, {"w": "float32", "b": "float64"}))
        got = read_through(the_plan, "h1/0", pieces, {"h0": remote})
    assert torch.equal(w, FULL_W[1:3, 2:5]) and torch.equal(b, FULL_B)
    assert got == w.numel() * 4 + b.numel() * 8
    # Exactly the plan's transfers to h1/0, each read once from its source device.
    wanted = {(t.src, t.tensor, t.box) for t in the_plan.transfers if t.dst == "h1/0"}
    assert sorted(map(str, remote.calls)) == sorted(map(str, wanted)) and len(remote.calls) == len(wanted)
    assert {(d, t, b.offsets, b.lengths) for d, t, b in remote.calls if t == "w"} == {
        ("h0/0", "w", (1, 2), (2, 1)), ("h0/1", "w", (1, 3), (2, 2))}

    row = torch.zeros(1, COLS)
    local = Recorded(Store(h0.root, "h0").open(1))
    read_through(the_plan, "h0/2", tensor_pieces("w", row, Annotation((ROWS, COLS), (3, 0))), {"h0": local})
    assert torch.equal(row, FULL_W[3:4])
    assert {d for d, _, _ in local.calls} == {"h0/0", "h0/1"}


def test_large_regions_go_over_the_data_plane_in_slabs_and_unneeded_transfers_are_skipped(h0, monkeypatch):
    # A layout given in advance may give a device more than its model holds (here b): those transfers are skipped.
    # Slabs of at most 8 bytes: h0/0's 2x1 float32 block is one slab, h0/1's 2x2 block two row slabs.
    monkeypatch.setattr(readthrough, "SLAB_BYTES", 8)
    new = Layout.build(SPECS, {"h1/0": [Shard("w", Box((1, 2), (2, 3))), Shard("b", Box.whole((COLS,)))]})
    the_plan = plan(OLD, new)
    w = torch.full((2, 3), -1.0)
    pieces = tensor_pieces("w", w, Annotation((ROWS, COLS), (1, 2)))
    with StoreClient(h0.address, data_plane_min_bytes=0) as client:
        assert client.data_pool() is not None  # the server runs a data plane, and every read takes it
        remote = Recorded(RemoteVersion(client, 1, {"w": "float32", "b": "float64"}))
        got = read_through(the_plan, "h1/0", pieces, {"h0": remote})
    assert torch.equal(w, FULL_W[1:3, 2:5]) and got == w.numel() * 4
    assert all(t == "w" for _, t, _ in remote.calls)
    assert sorted((d, b.offsets, b.lengths) for d, _, b in remote.calls) == [
        ("h0/0", (1, 2), (2, 1)), ("h0/1", (1, 3), (1, 2)), ("h0/1", (2, 3), (1, 2))]


def test_after_a_failed_read_the_regions_not_started_are_not_read(h0):
    new = Layout.build({"w": SPECS["w"]}, {"h1/0": [Shard("w", Box((0, 0), (ROWS, COLS)))]})
    the_plan = plan(OLD, new)
    calls = []

    class Failing:
        def read(self, device, tensor, box):
            raise AssertionError("not used")

        def readinto(self, device, tensor, box, dest):
            calls.append(box)
            raise RemoteStoreError("store h0: injected")

    pieces = tensor_pieces("w", torch.zeros(ROWS, COLS), Annotation((ROWS, COLS), (0, 0)))
    with pytest.raises(RemoteStoreError, match="injected"):
        read_through(the_plan, "h1/0", pieces, {"h0": Failing()}, threads=1)
    assert len(calls) == 1  # one thread: the second region was dropped once the first failed


def test_a_region_that_two_devices_of_a_new_host_need_fans_out():
    # h1/0 and h1/1 both need b: it crosses to h1 once and is copied there, so per-device reads would send it twice.
    new = Layout.build({"b": SPECS["b"]}, {"h1/0": [Shard("b", Box.whole((COLS,)))],
                                           "h1/1": [Shard("b", Box.whole((COLS,)))]})
    fanned = plan(Layout.build({"b": SPECS["b"]}, {"h0/0": [Shard("b", Box.whole((COLS,)))]}), new)
    assert fans_out(fanned)
    assert [(t.src, t.dst, t.source) for t in fanned.transfers] == [("h0/0", "h1/0", "old"), ("h1/0", "h1/1", "new")]


def test_a_gpu_style_byte_buffer_is_read_as_the_regions_c_order_values(h0):
    # read_piece hands a GPU tensor's host buffer as raw bytes; RemoteVersion reads into it all the same.
    out = bytearray(2 * 3 * 4)
    with StoreClient(h0.address) as client:
        RemoteVersion(client, 1, {"w": "float32"}).readinto("h0/1", "w", Box((2, 3), (2, 3)), memoryview(out))
    assert np.array_equal(np.frombuffer(out, np.float32).reshape(2, 3), FULL_W[2:4, 3:6].numpy())


# ------------------------------------------------------------ whole jobs (gloo)
# In this order: the first two cases commit nothing (each asserts it), so each restores the same saved version 1
# as a fresh job would; the last one commits version 2.
FAULTS = ["corrupted_chunks", "always_corrupted", "failed_read"]


@pytest.fixture(scope="module")
def swapped(tmp_path_factory):
    """Saved once by [h0/0, h1/0] (rows 0:4 and 4:8 of w, b on both); then, for each fault in turn, restored by
    [h1/0, h0/0], so each rank's rows are on the other host (both hosts stay in the job, nothing fans out:
    read-through). Before each restore h1's store restarts on its recorded address, with the fault's hook."""
    base = tmp_path_factory.mktemp("swapped")
    stores = {h: StoreProcess(base / "stores" / h, h) for h in ("h0", "h1")}
    results: dict[str, list[dict] | BaseException] = {}
    try:
        run_replica_job(base, "save", ["h0/0", "h1/0"], stores, [{"op": "train", "steps": 2}, {"op": "save"}],
                        replicas=0, keep=10)
        port = stores["h1"].port  # the saved version recorded this address: h1 comes back on it
        for fault in FAULTS:
            count = {"corrupted_chunks": 2, "always_corrupted": 1_000_000}.get(fault, 0)
            stores["h1"].stop()
            stores["h1"] = StoreProcess(base / "stores" / "h1", "h1", extra_args=("--port", str(port)),
                                        env={"TENPLEX_STORE_TEST_HOOKS": f"corrupt_chunks={count}"} if count else {})
            restore: dict = {"op": "restore"} if count else {"op": "restore", "break_read_through_on_rank": 1}
            try:
                results[fault] = [ops[0] for ops in run_replica_job(base, fault, ["h1/0", "h0/0"], stores, [restore],
                                                                    replicas=0, keep=10)]
            except Exception as e:  # noqa: BLE001 -- reported by that case's test
                results[fault] = e
    finally:
        for p in stores.values():
            p.stop()
    return base, results


@pytest.mark.parametrize("fault", FAULTS)
def test_a_job_swapping_hosts_reads_through_and_falls_back_to_the_stores(swapped, fault):
    """corrupted_chunks: h1's store damages its first chunks in flight; the reads fetch them again and the
    restore reads through. always_corrupted: it damages every chunk; the reads give up, the stores'
    transformation fails the same way, and the restore raises on every rank. failed_read: rank 1's reads
    from other stores fail; every rank falls back to the stores' transformation, which commits a new version
    on both hosts."""
    base, results = swapped
    records = results[fault]
    if isinstance(records, BaseException):
        raise records
    if fault == "always_corrupted":  # the same hook, firing on every chunk: the restore fails on every rank
        for record in records:
            assert record.get("error") and "corrupted" in record["message"], record
            assert record["versions"] == [1]  # the fallback transformation committed nothing
        return
    for record in records:
        assert "error" not in record, record.get("trace")
    info = records[0]["info"]
    assert info["saved_version"] == 1 and info["plan_stats"]["inter_host_bytes"] > 0
    if fault == "corrupted_chunks":
        assert info["read_through"] and not info["transformed"] and info["version"] == 1
        assert [r["versions"] for r in records] == [[1], [1]]  # nothing was written into either store
    else:
        assert info["transformed"] and not info["read_through"] and info["version"] == 2
        assert [r["versions"] for r in records] == [[1, 2], [1, 2]]
    for rank in (0, 1):  # the same rows as the saving rank of that index: bit for bit
        saved = load_file(str(base / "save" / f"saved_step2_r{rank}.safetensors"))
        assert_bit_equal(load_file(str(base / fault / f"restored_r{rank}.safetensors")), saved)
