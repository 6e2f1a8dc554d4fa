"""A snapshot between exchanges runs no collective at the step boundary (issue 40 item 2), and loses nothing.

Three gloo ranks on two hosts (h0: ranks 0 and 1; h1: rank 2), real stores and the job's real c10d key-value store
(``mp/snapshot_boundary_worker.py``): twelve snapshots, one per step, every rank's RNG streams changing every step.
The first snapshot exchanges (one all-gather); the next ones run no collective at the boundary; every version
holds, on every host, the writer's tensors at its step bit for bit and every rank's RNG streams and Adam steps of
that boundary (they travel through the job's store, not the all-gather); a parameter given new memory with the
same description changes nothing; a new buffer on every rank drops that one snapshot (counted as dropped, its
future fails with the reason) and the next one exchanges and commits; from then on every host holds the buffer's
values of its source, rank 0 (rank 2 on h1 has its own: they travel through the job's store); the job's store
keeps only the newest snapshot's keys however many snapshots ran.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tenplex.integration.versions import STATE_DOC
from tenplex.runtime import launch
from tenplex.store import Store

WORKER = Path(__file__).parent / "mp" / "snapshot_boundary_worker.py"
DEVICES = ["h0/0", "h0/1", "h1/0"]
SNAPSHOTS, SWAP_AT, CHANGE_AT, SETTLE_AT = 12, 4, 7, 5
WRITERS = {"h0": 0, "h1": 2}  # the first rank of each host writes the replicated state


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("boundary")
    out = base / "out"
    out.mkdir()
    (out / "spec.json").write_text(json.dumps({"out": str(out), "snapshots": SNAPSHOTS, "swap_at": SWAP_AT,
                                               "change_at": CHANGE_AT, "settle_at": SETTLE_AT}))
    roots = {h: base / "stores" / h for h in ("h0", "h1")}
    launch.run_job([sys.executable, str(WORKER), str(out / "spec.json")], DEVICES, roots, {}, out / "logs",
                   timeout=240)
    ranks = [json.loads((out / f"result_r{r}.json").read_text()) for r in range(len(DEVICES))]
    return roots, ranks


def test_only_the_first_snapshot_and_the_one_after_a_structure_change_exchange(run):
    _, ranks = run
    for result in ranks:
        collectives = [b["collectives"] for b in result["boundaries"]]
        exchanging = {b["step"] for b in result["boundaries"] if b["collectives"]}
        # Step 1 exchanges; CHANGE_AT's snapshot is dropped and the next one exchanges; wait_snapshot's own
        # all-gather runs outside async_save.
        assert exchanging == {1, CHANGE_AT + 1}, collectives
        assert [b["exchanges"] for b in result["boundaries"]][-1] == 2
        # Back-pressure: every snapshot before the previous one is settled when async_save returns, and the
        # previous one too between exchanges (its decision is what the boundary waited for).
        for k, b in enumerate(result["boundaries"]):
            assert all(b["previous_done"]), (k, b["previous_done"])


def test_every_committed_version_holds_its_steps_tensors_rng_and_scalars_on_every_host(run):
    roots, ranks = run
    by_version = {b["version"]: b for b in ranks[0]["boundaries"]}
    committed = [o for o in ranks[0]["outcomes"] if isinstance(o, int)]
    assert committed == [by_version[v]["version"] for v in committed]
    assert len(committed) == SNAPSHOTS - 1
    for host, root in roots.items():
        store = Store(root, host)
        assert store.versions() == committed
        for version in committed:
            step = by_version[version]["step"]
            reader = store.open(version)
            try:
                doc = reader.get_json(STATE_DOC)
                assert doc["step"] == step
                # Every rank's streams at that boundary, keyed by its coordinate (rank=R): all three ranks'.
                assert doc["rng"] == {f"rank={r}": ranks[r]["boundaries"][step - 1]["rng"] for r in range(3)}
                assert {s["step"] for s in doc["scalars"].values()} == {step}
                writer = ranks[WRITERS[host]]["boundaries"][step - 1]["state"]
                for name, values in writer.items():
                    if name == "seen":  # a buffer: every host writes its source's values, rank 0's (.canonical)
                        values = ranks[0]["boundaries"][step - 1]["state"][name]
                    stored = read_whole(reader, name)
                    assert torch.equal(stored, torch.tensor(values, dtype=torch.float32)), (host, version, name)
            finally:
                reader.close()


def test_a_frozen_parameter_is_linked_from_the_previous_snapshot_between_exchanges(run):
    roots, _ = run
    # Linked (one inode) from the version before, but where that version was not the newest committed (the one
    # after the dropped snapshot, CHANGE_AT + 1, exchanges and stages everything) and at the first.
    linked = [v for v in range(2, SNAPSHOTS + 1) if v not in (CHANGE_AT, CHANGE_AT + 1)]
    for host, root in roots.items():
        inodes = {v: frozen_inode(root, host, v) for v in range(1, SNAPSHOTS + 1) if v != CHANGE_AT}
        assert [v for v in inodes if v - 1 in inodes and inodes[v] == inodes[v - 1]] == linked, (host, inodes)


def frozen_inode(root: Path, host: str, version: int) -> int:
    reader = Store(root, host).open(version)
    try:
        (entry,) = [e for e in reader.entries if e.tensor == "frozen"]
        return (root / "versions" / str(version) / entry.file).stat().st_ino
    finally:
        reader.close()


def read_whole(reader, name: str) -> torch.Tensor:
    (entry,) = [e for e in reader.entries if e.tensor == name]
    return torch.as_tensor(reader.read(entry.device, name, entry.box))


def test_a_structure_change_drops_one_snapshot_with_its_reason(run):
    _, ranks = run
    for result in ranks:
        dropped = result["outcomes"][CHANGE_AT - 1]
        assert isinstance(dropped, str) and f"snapshot of step {CHANGE_AT}" in dropped
        assert "structure changed" in dropped
        final = result["settled"][-1]["stats"]
        assert (final["committed"], final["dropped"], final["failed"]) == (SNAPSHOTS - 1, 1, 0)


def test_the_job_store_keeps_only_the_newest_snapshots_keys(run):
    _, ranks = run
    # Every snapshot's keys are deleted once the next one is decided: what is left is the newest version's shared
    # keys and each rank's newest RNG streams, under the newest prefix (the exchange at CHANGE_AT + 1 began it).
    for result in ranks:
        newest = result["newest_prefix"]
        left = sorted(result["left"])
        assert left[:2] == [f"{newest}/{SNAPSHOTS}/decision", f"{newest}/{SNAPSHOTS}/prepared"], left
        rng = left[2:]
        assert [key.rsplit("/", 2)[0] for key in rng] == [f"{newest}/rng"] * 3, left
        assert sorted(key.rsplit("/", 2)[1] for key in rng) == ["0", "1", "2"], left
