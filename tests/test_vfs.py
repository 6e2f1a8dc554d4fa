"""Real FUSE mounts (server in its own process): plain I/O, PyTorch, switches, bad input, unmounting."""

import errno
import gc
import json
import os
import tempfile
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import fuse_vfs
from fuse_vfs import VfsError, mount, switch, write_state_file
from tenplex.dataset import DatasetError, DatasetState, StateError, pack
from tenplex.dataset.reader import open_fallback, open_mounted
from tenplex.dataset.state import upcoming_batches

_WHY = fuse_vfs.fuse_unavailable_reason()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"FUSE unavailable: {_WHY}")

N, SEQ, B = 97, 6, 10


@pytest.fixture
def dataset(tmp_path):
    toks = np.random.default_rng(0).integers(0, 60000, (N, SEQ)).astype(np.uint16)
    toks.tofile(tmp_path / "t.bin")
    info = pack(tmp_path / "t.bin", tmp_path / "ds", seq_len=SEQ, dtype="uint16", file_bytes=300)
    assert len(info.files) > 3  # samples of one view come from several record files
    return info, toks


@pytest.fixture
def mounted(tmp_path, dataset):
    """Mount ``dataset`` with dp=3 at position 0; always unmounted (lazily) in teardown."""
    info, _ = dataset
    write_state_file(tmp_path / "state.json", DatasetState(info.identity, N, 7, 0, B), dp=3)
    (tmp_path / "mnt").mkdir()
    handle = mount(info.root, tmp_path / "mnt", tmp_path / "state.json", log_path=tmp_path / "vfs.log")
    try:
        yield handle
    finally:
        gc.collect()  # readers a failed test left open would keep a lazily detached server alive
        handle.unmount(lazy=True, timeout=20)
        assert not os.path.ismount(tmp_path / "mnt")


def _read_all(path, chunk):
    out = bytearray()
    with open(path, "rb", buffering=0) as f:
        while data := f.read(chunk):
            out += data
    return bytes(out)


def _read_direct(path, chunk):
    """The whole file read with O_DIRECT (the server answers straight into the buffer) in page-aligned reads."""
    import mmap
    buf, out = mmap.mmap(-1, chunk), bytearray()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        while n := os.readv(fd, [buf]):
            out += buf[:n]
    finally:
        os.close(fd)
        buf.close()
    return bytes(out)


def test_plain_file_io_serves_each_ranks_view(mounted, dataset):
    info, toks = dataset
    mnt = mounted.mountpoint
    assert sorted(os.listdir(mnt)) == ["rank0", "rank1", "rank2", "state.json"]
    assert sorted(os.listdir(mnt / "rank1")) == ["data", "index.npy", "state.json"]
    state = DatasetState(info.identity, N, 7, 0, B)
    seen = []
    for r in range(3):
        fb = open_fallback(info.root, state, 3, r)
        expected = b"".join(fb.read(i) for i in range(len(fb)))
        assert os.path.getsize(mnt / f"rank{r}" / "data") == len(expected)
        for chunk in (1, 7, 4096, 1 << 20):   # reads that start and end inside samples
            assert _read_all(mnt / f"rank{r}" / "data", chunk) == expected
        index = np.load(mnt / f"rank{r}" / "index.npy")
        assert index[:, 0].tolist() == fb.sample_ids.tolist()
        doc = json.loads((mnt / f"rank{r}" / "state.json").read_text())
        assert (doc["rank"], doc["dp"], doc["generation"]) == (r, 3, 1)
        assert doc["micro_batches"] == [4 - (r > 0)] * 9   # 9 full batches of 10 over 3 ranks: 4, 3, 3
        for i in (0, len(fb) // 2, len(fb) - 1):
            np.testing.assert_array_equal(open_mounted(mnt, r).get(i), toks[fb.sample_ids[i]])
        seen.extend(index[:, 0].tolist())
    assert len(seen) == len(set(seen)) == 90    # the epoch's 9 full batches, each sample once


def test_pytorch_dataset_from_mount_and_fallback(mounted, dataset):
    import torch
    from torch.utils.data import DataLoader

    from tenplex.dataset.torch_data import RankBatchSampler, RankDataset, collate, micro_batch_weights

    info, toks = dataset
    state = DatasetState(info.identity, N, 7, 0, B)
    for r in range(3):
        ds = RankDataset.mounted(mounted.mountpoint, r)
        fb = RankDataset.fallback(info.root, state, 3, r)
        assert ds.sample_ids.tolist() == fb.sample_ids.tolist()
        loader = DataLoader(ds, batch_sampler=RankBatchSampler(ds), collate_fn=collate, num_workers=1 if r else 0)
        batches = list(loader)
        assert len(batches) == 9 and [len(b) for b in batches] == [4 - (r > 0)] * 9
        flat = torch.cat(batches)
        assert torch.equal(flat, torch.from_numpy(toks[ds.sample_ids].astype(np.int64)).to(flat.dtype))
        assert micro_batch_weights(ds) == pytest.approx([(4 - (r > 0)) / 10] * 9)


def test_exactly_once_across_switches_and_epochs(mounted):
    """Random dp degrees (most not dividing 10), switched every few steps over three epochs."""
    rng = np.random.default_rng(42)
    state = DatasetState(json.loads((mounted.mountpoint / "state.json").read_text())["dataset"], N, 7, 0, B)
    reference = upcoming_batches(state, 1, 27)["batches"]        # 9 batches per epoch, unchanged run
    batches, dp = [], 3
    while state.epoch < 3:
        readers = [open_mounted(mounted.mountpoint, r) for r in range(dp)]
        steps = min(int(rng.integers(1, 5)), len(readers[0].micro_batches))
        cursors = [0] * dp
        for k in range(steps):
            batch = []
            for r, rd in enumerate(readers):
                size = int(rd.micro_batches[k])
                batch += [int(rd.sample_ids[i]) for i in range(cursors[r], cursors[r] + size)]
                for i in range(cursors[r], cursors[r] + size):
                    rd.read(i)                               # bytes through FUSE, crc-checked
                cursors[r] += size
            batches.append(batch)
        for rd in readers:
            rd.close()
        state = state.advance(steps)
        dp = int(rng.integers(1, 8))
        root = switch(mounted.mountpoint, dp=dp, position=state.position)
        assert root["dp"] == dp and root["state"]["position"] == state.position
    assert batches == reference
    for e in range(3):
        ids = [i for b in batches[9 * e:9 * e + 9] for i in b]
        assert len(ids) == len(set(ids)) == 90


def test_switch_is_atomic_for_open_handles(mounted, dataset):
    info, _ = dataset
    mnt = mounted.mountpoint
    reader = open_mounted(mnt, 2)
    old = [reader.read(i) for i in range(3)]     # rank 2's pages of generation 1 are now in the page cache
    untouched = os.open(mnt / "rank1" / "data", os.O_RDONLY)   # opened, nothing read: no cached pages
    try:
        root = switch(mnt, dp=2, position=20)
        assert root["generation"] == 2 and sorted(os.listdir(mnt)) == ["rank0", "rank1", "state.json"]
        assert os.readlink(mnt / "rank1") == ".g2/rank1" and not os.path.exists(mnt / ".g1")
        # An old handle gets its own generation's bytes or ESTALE, never the new view's bytes.
        with pytest.raises(OSError) as e:
            os.pread(untouched, 10, 0)
        assert e.value.errno == errno.ESTALE
        for i in range(len(reader)):
            try:
                data = reader.read(i)             # crc-checked against generation 1's index
            except DatasetError as err:
                assert "switched to a new view" in str(err)
                break
            if i < 3:
                assert data == old[i]
        with pytest.raises(DatasetError, match="no such rank directory"):
            open_mounted(mnt, 2)
        new = open_mounted(mnt, 1)
        fb = open_fallback(info.root, DatasetState(info.identity, N, 7, 20, B), 2, 1)
        assert new.sample_ids.tolist() == fb.sample_ids.tolist() and new.read(5) == fb.read(5)
        assert json.loads((mnt / "rank1" / "state.json").read_text())["state"]["position"] == 20
        new.close()
    finally:
        os.close(untouched)
        reader.close()


def test_bad_state_keeps_the_old_view(mounted, tmp_path):
    with pytest.raises(StateError, match="not at a global-batch boundary"):
        switch(mounted.mountpoint, position=15)          # refused before the mount is touched
    doc = json.loads((tmp_path / "state.json").read_text())
    doc["dataset"] = "0" * 64
    (tmp_path / "s2.json").write_text(json.dumps(doc))
    os.replace(tmp_path / "s2.json", tmp_path / "state.json")
    deadline = time.monotonic() + 120
    while fuse_vfs.read_root(mounted.mountpoint)["loads"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    root = fuse_vfs.read_root(mounted.mountpoint)
    assert root["generation"] == 1 and "but the mount serves" in root["state_error"]
    assert len(open_mounted(mounted.mountpoint, 0)) == 36   # still the old view: 9 micro-batches of 4


def test_dataset_changed_under_the_mount(mounted, dataset):
    info, _ = dataset
    reader = open_mounted(mounted.mountpoint, 0)
    reader.read(0)
    with open(info.record_path(1), "r+b") as f:
        f.truncate(10)
    deadline = time.monotonic() + 120
    while not fuse_vfs.read_root(mounted.mountpoint)["error"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "records-00001.bin" in fuse_vfs.read_root(mounted.mountpoint)["error"]
    with pytest.raises(OSError) as e:
        open(mounted.mountpoint / "rank1" / "data", "rb")
    assert e.value.errno == errno.EIO
    with pytest.raises(DatasetError, match="dataset may have changed"):
        open_mounted(mounted.mountpoint, 2)
    # A reader opened before the change still sees only verified bytes of the old view, or the error.
    for i in range(len(reader)):
        try:
            reader.read(i)
        except DatasetError as err:
            assert "dataset may have changed" in str(err)
            break
    reader.close()


def test_paths_outside_the_view_are_rejected(mounted):
    mnt = mounted.mountpoint
    for bad in ("rank3", "rank01", "rank-1", "rank", "rank0/../../etc/passwd", "rank0/data/x", "rank0/..data",
                ".tenplex", "rank0/%2e%2e", "rank99999999999"):
        assert not os.path.exists(mnt / bad), bad
    for bad in (".g0", ".g2", ".g1/rank3", ".g1/state.json", ".g01", ".g1/rank0/../../.."):
        assert not os.path.exists(mnt / bad) or os.path.realpath(mnt / bad) == str(mnt.parent), bad
    # ".." is resolved by the kernel and never reaches the server: rank0 -> .g1/rank0, then up twice.
    assert os.path.realpath(mnt / "rank0" / ".." / "..") == str(mnt)
    assert os.path.realpath(mnt / "rank0") == str(mnt / ".g1" / "rank0")
    with pytest.raises(OSError) as e:
        open(mnt / "rank0" / "data", "r+b")
    assert e.value.errno in (errno.EROFS, errno.EACCES)
    with pytest.raises(OSError):
        (mnt / "rank0" / "new").write_bytes(b"x")


def test_mount_point_in_use_or_unusable(mounted, dataset, tmp_path, monkeypatch):
    info, _ = dataset
    with pytest.raises(VfsError, match="in use.*open_fallback"):
        mount(info.root, mounted.mountpoint, tmp_path / "state.json")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(VfsError, match="not empty"):
        mount(info.root, tmp_path / "full", tmp_path / "state.json")
    monkeypatch.setattr(fuse_vfs.preflight.shutil, "which", lambda name: None)
    with pytest.raises(fuse_vfs.FuseUnavailableError, match="fusermount.*open_fallback"):
        mount(info.root, tmp_path / "empty", tmp_path / "state.json")


READER = """
import sys, time
from tenplex.dataset.reader import open_mounted
r = open_mounted(sys.argv[1], 0)
print("open", flush=True)
for round in range(int(sys.argv[2])):
    for i in range(len(r)):
        r.read(i)          # crc-checked: garbage would raise
    time.sleep(0.01)
print("done", flush=True)
"""


def _reader(mnt, rounds):
    proc = subprocess.Popen([sys.executable, "-c", READER, str(mnt), str(rounds)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "open"
    return proc


def test_unmount_while_reading(mounted):
    reader = _reader(mounted.mountpoint, 100000)
    try:
        with pytest.raises(VfsError, match="busy.*--lazy"):
            fuse_vfs.unmount(mounted.mountpoint)
        fuse_vfs.unmount(mounted.mountpoint, lazy=True)
        assert not os.path.ismount(mounted.mountpoint)
        # The detached mount keeps serving the open reader, with verified samples, until it exits.
        time.sleep(0.3)
        assert reader.poll() is None, reader.stderr.read()
    finally:
        reader.kill()
        reader.wait()
    mounted.process.wait(timeout=120)            # last handle closed: the server exits cleanly
    assert mounted.process.returncode == 0


def test_unmount_after_reader_crash(mounted):
    reader = _reader(mounted.mountpoint, 100000)
    reader.send_signal(signal.SIGKILL)
    reader.wait()
    fuse_vfs.unmount(mounted.mountpoint)        # not lazy: the kernel closed the crashed reader's files
    mounted.process.wait(timeout=120)
    assert mounted.process.returncode == 0 and not os.path.ismount(mounted.mountpoint)


def test_server_crash_leaves_a_dead_mount_that_unmount_cleans(mounted, dataset, tmp_path):
    mounted.process.send_signal(signal.SIGKILL)
    mounted.process.wait()
    with pytest.raises(VfsError, match="dead FUSE mount"):
        fuse_vfs.check_mountpoint(mounted.mountpoint)
    mounted.unmount()
    assert not os.path.ismount(mounted.mountpoint)
    fuse_vfs.check_mountpoint(mounted.mountpoint)  # reusable


def test_cli_mount_switch_status_unmount(dataset, tmp_path):
    info, _ = dataset
    cli = [sys.executable, "-c", "import sys; from tenplex.cli import main; sys.exit(main())"]
    def run(*a):
        return subprocess.run(cli + [str(x) for x in a], capture_output=True, text=True, timeout=120)
    out = run("data", "state", info.root, "--seed", 1, "--global-batch", B, "--dp", 2, "-o", tmp_path / "s.json")
    assert out.returncode == 0, out.stderr
    (tmp_path / "m").mkdir()
    out = run("vfs", "mount", info.root, tmp_path / "m", "--state", tmp_path / "s.json", "--log", tmp_path / "l")
    try:
        assert out.returncode == 0, out.stderr
        assert "generation 1, dp 2" in out.stdout
        out = run("vfs", "switch", tmp_path / "m", "--dp", 5, "--position", 90)
        assert out.returncode == 0 and "generation 2, dp 5, position 90 (epoch 1)" in out.stdout, out.stderr
        status = json.loads(run("vfs", "status", tmp_path / "m").stdout)
        assert status["dp"] == 5 and status["state"]["epoch"] == 1
        assert len(os.listdir(tmp_path / "m")) == 6
        out = run("vfs", "switch", tmp_path / "m", "--position", 95)
        assert out.returncode == 2 and "not at a global-batch boundary" in out.stderr
    finally:
        out = run("vfs", "unmount", tmp_path / "m")
    assert out.returncode == 0, out.stderr
    assert not os.path.ismount(tmp_path / "m")


def test_mounting_a_truncated_index_fails_clearly(dataset, tmp_path):
    info, _ = dataset
    write_state_file(tmp_path / "state.json", DatasetState(info.identity, N, 7, 0, B), dp=2)
    index = info.root / "index.npy"
    index.write_bytes(index.read_bytes()[:100])
    (tmp_path / "m").mkdir()
    with pytest.raises(VfsError, match=r"index\.npy: 100 bytes.*truncated"):
        mount(info.root, tmp_path / "m", tmp_path / "state.json", log_path=tmp_path / "log")
    assert not os.path.ismount(tmp_path / "m")


def test_a_failed_mount_leaves_no_log_of_its_own_behind(dataset, tmp_path, monkeypatch):
    info, _ = dataset
    write_state_file(tmp_path / "state.json", DatasetState(info.identity, N, 7, 0, B), dp=2)
    (tmp_path / "empty").mkdir()
    (tmp_path / "m").mkdir()
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    with pytest.raises(VfsError, match="exited with code .*not a tenplex dataset"):  # the log's text, in the error
        mount(tmp_path / "empty", tmp_path / "m", tmp_path / "state.json")
    assert list((tmp_path / "tmp").iterdir()) == []
    assert not os.path.ismount(tmp_path / "m")


@pytest.mark.parametrize("libfuse", ["3", "2"])
def test_each_libfuse_serves_large_reads_and_switches(tmp_path, libfuse):
    """Both bindings serve whole views in 1 MiB reads (libfuse3: 896 KiB requests), also O_DIRECT ones, before
    and after a switch."""
    from fuse_vfs import binding, fs
    from tenplex.dataset.pack import write_dataset
    try:
        binding.library_path(libfuse)
    except ValueError as e:
        pytest.skip(str(e))
    rng = np.random.default_rng(3)
    records = [rng.integers(0, 256, int(n), dtype=np.uint8).tobytes() for n in rng.integers(1, 20000, 600)]
    info = write_dataset(iter(records), tmp_path / "ds", "bytes", file_bytes=1 << 20)
    state = DatasetState(info.identity, len(records), 5, 0, 8)
    write_state_file(tmp_path / "state.json", state, dp=2)
    (tmp_path / "mnt").mkdir()
    handle = mount(info.root, tmp_path / "mnt", tmp_path / "state.json", log_path=tmp_path / "log",
                   libfuse=libfuse)
    try:
        assert fuse_vfs.read_root(handle.mountpoint)["libfuse"].split(".")[0] == libfuse
        for dp in (2, 3):
            if dp == 3:
                switch(handle.mountpoint, dp=3)
            for r in range(dp):
                expected = b"".join(records[i] for i in open_fallback(info.root, state, dp, r).sample_ids)
                assert len(expected) > 1 << 20   # more than one request, each spanning many records
                assert _read_all(handle.mountpoint / f"rank{r}" / "data", 1 << 20) == expected
                assert _read_direct(handle.mountpoint / f"rank{r}" / "data", 1 << 20) == expected  # bench vfs
        if os.geteuid() == 0:  # the server widened the kernel's readahead window for its mount
            ra = f"/sys/class/bdi/{binding.mount_device(str(handle.mountpoint))}/read_ahead_kb"
            assert int(open(ra).read()) >= binding.READAHEAD_REQUESTS * fs.MAX_READ >> 10
    finally:
        handle.unmount(lazy=True, timeout=20)
    assert not os.path.ismount(tmp_path / "mnt")


def test_libfuse_choice_errors_name_the_fix(monkeypatch):
    from fuse_vfs import binding
    with pytest.raises(ValueError, match="expected one of auto, 3, 2"):
        binding.library_path("4")
    monkeypatch.setattr(binding.ctypes.util, "find_library", lambda name: None)
    with pytest.raises(ValueError, match=r"TENPLEX_LIBFUSE=3 but libfuse3 is not installed \(apt-get install fuse3\)"):
        binding.library_path("3")
    assert binding.library_path("auto") is None


def test_bench_vfs_reports_buffered_and_o_direct_first_passes_with_the_load(tmp_path):
    import argparse
    from tenplex.bench import vfs as bench_vfs
    parser = argparse.ArgumentParser()
    bench_vfs.add_arguments(parser)
    args = parser.parse_args(["--size-mb", "2", "--sample-kb", "16", "--repeat", "1", "--random-reads", "20",
                              "--dir", str(tmp_path)])
    result = bench_vfs.run(args)
    assert result["bytes"] == 2 << 20 and result["samples"] == 128 and len(result["load"]) == 2
    for first, ratio in (("vfs_seq_gbps", "seq_ratio"), ("vfs_seq_odirect_gbps", "seq_odirect_ratio"),
                         ("vfs_seq_warm_gbps", "seq_warm_ratio")):
        assert result[first] > 0
        assert result[ratio] == pytest.approx(result[first] / result["direct_seq_gbps"], rel=1e-3, abs=1e-4)
    assert not os.listdir(tmp_path)  # the work directory and its mount are gone
