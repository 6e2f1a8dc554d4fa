"""The dataset view in real jobs (tenplex run --dataset --data-mount): real torchrun agents on loopback, real FUSE
mounts. A worker that reads only files under its view survives a join, a SIGKILLed node and a leave, and the
final history reads every sample of the epoch exactly once, in the epoch's global batches. Two jobs' views on one
node stay apart; a view of no world or of another world is refused with one line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

import fuse_vfs
from tenplex.dataset import DatasetState, pack, upcoming_batches
from tenplex.elastic import dataview, demo
from tenplex.elastic.launcher import parse
from tenplex.elastic.timeline import final_history, read_worlds
from tenplex.errors import ConfigError

_WHY = fuse_vfs.fuse_unavailable_reason()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"FUSE unavailable: {_WHY}")

WORKER = Path(__file__).parent / "mp" / "view_worker.py"
STEPS, GLOBAL_BATCH = 8, 12
SCHEDULE = "join:h2@2,fail:h1@4,leave:h2@6"


def _dataset(folder: Path, n: int, first: int = 0):
    """``n`` records of two uint16 tokens, each holding its sample id (plus ``first``): a reader's ids come from
    the bytes it read."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = np.arange(first, first + n, dtype=np.uint16)
    np.stack([ids, ids], axis=1).tofile(folder / "t.bin")
    return pack(folder / "t.bin", folder / "ds", seq_len=2, dtype="uint16")


def test_a_worker_reading_only_its_view_reads_every_sample_once_through_join_fail_and_leave(tmp_path):
    info = _dataset(tmp_path / "data", STEPS * GLOBAL_BATCH)
    events = demo.parse_schedule(SCHEDULE, ("h0", "h1"), STEPS)
    record = tmp_path / "elastic" / "record"
    lines: list[str] = []
    demo.run_elastic(tmp_path, info.root, STEPS, events, ("h0", "h1"), 2, {}, lines.append, timeout=600,
                     fuse=True, script=[str(WORKER), str(record), str(STEPS)])
    worlds = read_worlds(record)
    assert [sorted(w.hosts) for w in worlds] == [["h0", "h1"], ["h0", "h1", "h2"], ["h0", "h2"], ["h0"]], lines
    history = final_history(worlds)
    expected = upcoming_batches(DatasetState(info.identity, info.num_samples, 0, 0, GLOBAL_BATCH), 1, STEPS)
    assert list(history) == list(range(1, STEPS + 1))
    for step, batch in zip(history, expected["batches"]):  # the epoch's global batches, whatever the dp degree
        assert sorted(history[step]["ids"]) == sorted(batch), step
    read = sorted(i for h in history.values() for i in h["ids"])
    assert read == list(range(info.num_samples))  # exactly once
    # The failure lost steps: the next world replayed them from the view, switched to the restored position.
    fail = worlds[2]
    assert fail.restored_step is not None and fail.restored_step < 4 and fail.position == fail.restored_step * 12
    # Every world switched each of its nodes' views once (h1's view died with it); every rank read its world's.
    switches = json.loads((tmp_path / "elastic" / "views.json").read_text())
    assert switches == {"h0": 4, "h1": None, "h2": 2}
    docs = [json.loads(x) for f in record.glob("rank-*.jsonl") for x in f.read_text().splitlines()]
    starts = [d for d in docs if d["event"] == "start"]
    assert all("/.g" in d["view"] and d["view"].startswith(str(tmp_path / "elastic" / f"view-{d['host']}"))
               for d in starts)
    for host in ("h0", "h1", "h2"):  # the nodes' views were unmounted
        assert not (tmp_path / "elastic" / f"view-{host}").is_mount()


@pytest.fixture
def two_views(tmp_path):
    mounts = [tmp_path / "job-a", tmp_path / "job-b"]
    try:
        yield mounts
    finally:
        dataview.unmount_views(mounts)


def test_two_jobs_on_one_node_have_their_own_views(tmp_path, two_views):
    a, b = _dataset(tmp_path / "a", 24), _dataset(tmp_path / "b", 36, first=1000)
    state_dir = tmp_path / "store" / dataview.STATE_DIR  # one store root for both jobs
    root_a = dataview.ensure_view(a.root, two_views[0], state_dir)
    root_b = dataview.ensure_view(b.root, two_views[1], state_dir)
    assert (root_a["world"], root_a["generation"], root_b["world"]) == (None, 1, None)
    # Before any world switched it, a view is refused.
    with pytest.raises(dataview.DataViewError, match="not switched for this worker's world yet"):
        dataview.rank_dir(two_views[0], 0, None)
    with pytest.raises(dataview.DataViewError, match=r"serves world \(none yet\), not this worker's world w1"):
        dataview.rank_dir(two_views[0], 0, "w1")
    # Job A's world w1 switches its view: job B's stays as it was.
    dataview.switch(two_views[0], DatasetState(a.identity, 24, 5, 12, 6), 2, "w1")
    assert fuse_vfs.read_root(two_views[1])["generation"] == 1 and fuse_vfs.read_root(two_views[1])["world"] is None
    rank1 = dataview.rank_dir(two_views[0], 1, "w1")
    assert rank1.name == "rank1" and rank1.parent.name == ".g2"
    ids = np.fromfile(rank1 / "data", dtype=np.uint16)[::2]
    assert len(ids) == 6 and set(ids.tolist()) <= set(range(24))
    with pytest.raises(dataview.DataViewError, match="serves world w1, not this worker's world w0"):
        dataview.rank_dir(two_views[0], 1, "w0")
    with pytest.raises(dataview.DataViewError, match="no such rank"):
        dataview.rank_dir(two_views[0], 2, "w1")
    # A later tenplex run reuses each view (the same server); another job's dataset at a taken mount is refused.
    assert dataview.ensure_view(a.root, two_views[0], state_dir)["pid"] == root_a["pid"]
    with pytest.raises(ConfigError, match="each job needs a mount point of its own"):
        dataview.ensure_view(b.root, two_views[0], state_dir)
    assert dataview.switches(two_views[0]) == 1 and dataview.switches(two_views[1]) == 0


def test_dataset_and_data_mount_go_together():
    with pytest.raises(ConfigError, match="--dataset and --data-mount go together"):
        parse(["--host", "h0", "--store-root", "/s", "--dataset", "/d", "--standalone", "x.py"])
    spec = parse(["--host", "h0", "--store-root", "/s", "--dataset", "/d", "--data-mount", "/m", "--standalone",
                  "x.py"])
    assert (spec.dataset, spec.data_mount, spec.torchrun) == (Path("/d"), Path("/m"), ["--standalone"])


def test_a_job_with_a_view_has_no_view_directory_before_its_world_switched_it(monkeypatch, tmp_path):
    monkeypatch.delenv(dataview.VIEW_ENV, raising=False)
    assert dataview.checked(None, restored=False) is None  # no view: nothing to refuse
    monkeypatch.setenv(dataview.VIEW_ENV, str(tmp_path))
    with pytest.raises(dataview.DataViewError, match="not switched for this world yet: call job.restore"):
        dataview.checked(None, restored=False)
    assert dataview.checked(tmp_path / ".g2" / "rank0", restored=True) == tmp_path / ".g2" / "rank0"


EPOCHS_SCRIPT = """
import json, sys
import torch
import tenplex.elastic
job = tenplex.elastic.Job(dataset=sys.argv[1], global_batch=4, save_every=0, replicas=0, timeout=60)
model = torch.nn.Linear(2, 1)
job.restore(model, torch.optim.SGD(model.parameters(), lr=0.1))
steps = []
while job.step < 5:
    steps.append({"ids": job.batch().ids, "view": str(job.data_view)})
    job.step_done()
job.finish()
print(json.dumps(steps))
"""


def test_job_batch_reads_through_the_view_and_switches_it_at_the_next_epoch(tmp_path, two_views):
    import subprocess

    from tenplex.ports import free_port

    info = _dataset(tmp_path / "data", 12)  # 3 global batches of 4 per epoch: 5 steps cross into epoch 1
    dataview.ensure_view(info.root, two_views[0], tmp_path / "h0" / dataview.STATE_DIR)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", TENPLEX_HOST="h0",
               TENPLEX_STORE_ROOT=str(tmp_path / "h0"), **{dataview.VIEW_ENV: str(two_views[0])})
    result = subprocess.run([sys.executable, "-c", EPOCHS_SCRIPT, str(info.root)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = json.loads(result.stdout.strip().splitlines()[-1])
    expected = upcoming_batches(DatasetState(info.identity, 12, 0, 0, 4), 1, 5)["batches"]
    assert [s["ids"] for s in steps] == expected
    # The restore switched the view (generation 2), the first batch of epoch 1 switched it again (generation 3).
    assert [Path(s["view"]).parent.name for s in steps] == [".g2"] * 3 + [".g3"] * 2
    assert dataview.switches(two_views[0]) == 2
