"""Every in-place source under a real elastic job (tenplex run --dataset --data-mount: real torchrun agents on
loopback, a real FUSE view): through a join, a SIGKILLed node and a leave (the dp degree changes mid-epoch each
time), the job trains every sample of the epoch exactly once, in the epoch's global batches. The primary source
is read through ``job.loader()`` (a DataLoader with 2 worker processes, prefetching and pinned memory); the other
sources' shares of the same steps are read in process at the job's position."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import fuse_vfs
import source_helpers
from tenplex.dataset import DatasetState, open_dataset, upcoming_batches
from tenplex.elastic import demo
from tenplex.elastic.timeline import final_history, read_worlds

_WHY = fuse_vfs.fuse_unavailable_reason()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"FUSE unavailable: {_WHY}")

WORKER = Path(__file__).parent / "mp" / "source_worker.py"
STEPS, GLOBAL_BATCH = 8, 12
SCHEDULE = "join:h2@2,fail:h1@4,leave:h2@6"
PRIMARY = "webdataset"


def _others(record: Path, worlds) -> dict[int, dict[str, list[int]]]:
    """step -> source -> the ids its final world's ranks read of the other sources."""
    final: dict[int, dict[str, list[int]]] = {}
    for w in worlds:  # in start order: a later world's replay of a step replaces the earlier one's
        steps: dict[int, dict[str, list[int]]] = {}
        for name in w.files:
            for line in (record / name).read_text().splitlines():
                doc = json.loads(line)
                if doc["event"] == "step":
                    for kind, ids in doc["others"].items():
                        steps.setdefault(doc["step"], {}).setdefault(kind, []).extend(ids)
        final.update(steps)
    return final


def test_every_source_trains_each_sample_once_through_join_kill_and_leave_with_a_prefetching_loader(
        tmp_path, monkeypatch):
    monkeypatch.setenv("TENPLEX_CACHE_DIR", str(tmp_path / "cache"))
    n = STEPS * GLOBAL_BATCH  # one epoch
    paths = {kind: source_helpers.make(kind, tmp_path / "data" / kind, n) for kind in source_helpers.KINDS}
    info = open_dataset(paths[PRIMARY])
    sources = {"primary": PRIMARY, "others": {k: str(p) for k, p in paths.items() if k != PRIMARY}}
    events = demo.parse_schedule(SCHEDULE, ("h0", "h1"), STEPS)
    record = tmp_path / "elastic" / "record"
    lines: list[str] = []
    demo.run_elastic(tmp_path, paths[PRIMARY], STEPS, events, ("h0", "h1"), 2, {}, lines.append, timeout=600,
                     fuse=True, script=[str(WORKER), str(record), str(STEPS), json.dumps(sources)])
    worlds = read_worlds(record)
    assert [sorted(w.hosts) for w in worlds] == [["h0", "h1"], ["h0", "h1", "h2"], ["h0", "h2"], ["h0"]], lines
    assert [w.size for w in worlds] == [4, 6, 4, 2]  # max_tp=1: the dp degree
    history = final_history(worlds)
    expected = upcoming_batches(DatasetState(info.identity, n, 0, 0, GLOBAL_BATCH), 1, STEPS)["batches"]
    assert list(history) == list(range(1, STEPS + 1))
    for step, batch in zip(history, expected):  # the epoch's global batches, whatever the dp degree
        assert sorted(history[step]["ids"]) == sorted(batch), step
    assert sorted(i for h in history.values() for i in h["ids"]) == list(range(n))  # exactly once
    others = _others(record, worlds)
    for kind in sources["others"]:
        for step, batch in zip(history, expected):
            assert sorted(others[step][kind]) == sorted(batch), (kind, step)
    # The kill lost steps whose samples the loader had prefetched: the next world read them again, once.
    fail = worlds[2]
    assert fail.restored_step is not None and fail.restored_step < 4 and fail.position == fail.restored_step * 12
