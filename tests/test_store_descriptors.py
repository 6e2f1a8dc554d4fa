"""No descriptor is closed twice or used after its close: readers' version directories, shard files released
between writes, and the shared-descriptor rule behind both (issue 39 item 2).

Each race is made to happen, not hoped for: a patched system call waits, while it holds the number, until
another thread has closed the reader or finished the shard. Before the fix each of these failed with EBADF
(or closed a number that by then belonged to another file)."""

from __future__ import annotations

import errno
import gc
import os
import threading

import numpy as np
import pytest

from tenplex.box import Box
from tenplex.errors import StoreError
from tenplex.store import Store, _safetensors
from tenplex.store._descriptor import SharedDescriptor
from tenplex.store.reader import VersionReader

WAIT_S = 60.0


def _committed(tmp_path, version: int = 1) -> Store:
    store = Store(tmp_path / "store", "h0")
    w = store.begin(version)
    w.put("h0/cuda:0", "w", Box((0,), (64,)), np.arange(64, dtype=np.float32), "float32")
    w.put_json("step", {"step": 3})
    w.commit()
    return store


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError as e:
        assert e.errno == errno.EBADF
        return False
    return True


def test_a_reader_that_fails_to_open_never_closes_its_directory_twice(tmp_path):
    """A damaged manifest fails the reader's constructor, which closes the directory it opened; collecting the
    half-built reader later must not close that number again (it may belong to another file by then)."""
    store = _committed(tmp_path)
    path = store.root / "versions" / "1"
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(StoreError) as failed:
        VersionReader(path)
    other = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)  # likely the number the reader had
    try:
        del failed  # the traceback held the half-built reader
        gc.collect()
        assert _is_open(other), "collecting the failed reader closed a descriptor it no longer owned"
    finally:
        if _is_open(other):
            os.close(other)


def _pause_inside(monkeypatch, module, name: str, other_done: threading.Event, entered: threading.Event):
    """Make ``module.name`` wait, with its arguments already evaluated, until ``other_done`` is set."""
    real = getattr(module, name)

    def paused(*args, **kwargs):
        entered.set()
        assert other_done.wait(WAIT_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, paused)


def _race(use, close) -> BaseException | None:
    """Run ``use`` in a thread that pauses inside its system call (see ``_pause_inside``) while ``close`` runs;
    the error ``use`` raised, or None."""
    errors: list[BaseException] = []

    def run():
        try:
            use()
        except BaseException as e:  # noqa: BLE001 - examined by the test
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    close()
    thread.join(WAIT_S)
    assert not thread.is_alive()
    return errors[0] if errors else None


def test_closing_a_reader_while_it_links_a_file_waits_for_the_link(tmp_path, monkeypatch):
    store = _committed(tmp_path)
    reader = store.open(1)
    entry = reader.entries[0]
    entered, closed = threading.Event(), threading.Event()
    _pause_inside(monkeypatch, os, "link", closed, entered)
    fds_before = set(os.listdir("/proc/self/fd"))

    def close():
        assert entered.wait(WAIT_S)
        reader.close(deleted=True)
        closed.set()

    error = _race(lambda: reader.link_file(entry, tmp_path / "linked"), close)
    assert error is None, f"link_file raced with close: {error!r}"
    assert (tmp_path / "linked").read_bytes() == (reader.path / entry.file).read_bytes()
    with pytest.raises(StoreError, match="deleted"):
        reader.link_file(entry, tmp_path / "again")
    assert set(os.listdir("/proc/self/fd")) <= fds_before  # the directory was closed once the link was done


def test_closing_a_reader_while_it_opens_a_shard_waits_for_the_open(tmp_path, monkeypatch):
    store = _committed(tmp_path)
    reader = store.open(1)
    entered, closed = threading.Event(), threading.Event()
    _pause_inside(monkeypatch, os, "open", closed, entered)

    def close():
        assert entered.wait(WAIT_S)
        reader.close()
        closed.set()

    error = _race(lambda: reader.get_json("step"), close)
    assert error is None, f"reading a document raced with close: {error!r}"
    with pytest.raises(StoreError, match="closed"):
        reader.get_json("step")


def test_finishing_a_shard_while_its_space_is_reserved_waits_for_the_reservation(tmp_path, monkeypatch):
    """The transformer reserves new shards' space in a thread of its own while pulls fill them; the pull that
    lands a shard's last region finishes it (closes its file) maybe while the reservation still runs."""
    store = Store(tmp_path / "store", "h0")
    writer = store.begin(1)
    target = writer.create("h0/cuda:0", "w", Box((0,), (1024,)), "float32", reserve=False)
    target.write(Box((0,), (1024,)), np.ones(1024, np.float32))
    entered, finished = threading.Event(), threading.Event()
    _pause_inside(monkeypatch, _safetensors, "reserve_space", finished, entered)
    fds_before = set(os.listdir("/proc/self/fd"))

    def finish():
        assert entered.wait(WAIT_S)
        target.finish()
        finished.set()

    error = _race(target.reserve, finish)
    assert error is None, f"reserve raced with finish: {error!r}"
    assert set(os.listdir("/proc/self/fd")) < fds_before  # the file is closed once the reservation is done
    writer.commit()
    np.testing.assert_array_equal(store.open(1).read("h0/cuda:0", "w", Box((0,), (1024,))), np.ones(1024))


def test_reserving_a_finished_shard_does_nothing_and_holds_no_descriptor(tmp_path):
    store = Store(tmp_path / "store", "h0")
    writer = store.begin(1)
    target = writer.create("h0/cuda:0", "w", Box((0,), (16,)), "float32", reserve=False)
    target.write(Box((0,), (16,)), np.ones(16, np.float32))
    target.finish()
    fds_before = set(os.listdir("/proc/self/fd"))
    target.reserve()
    assert set(os.listdir("/proc/self/fd")) == fds_before


def test_a_released_shard_file_is_reopened_by_the_next_write_and_closed_once(tmp_path):
    store = Store(tmp_path / "store", "h0")
    writer = store.begin(1)
    fds_before = set(os.listdir("/proc/self/fd"))
    target = writer.create("h0/cuda:0", "w", Box((0,), (16,)), "float32")
    target.write(Box((0,), (8,)), np.ones(8, np.float32))
    target.release()
    assert set(os.listdir("/proc/self/fd")) == fds_before
    target.write(Box((8,), (8,)), np.full(8, 2, np.float32))
    target.release()
    target.release()
    writer.commit()
    assert set(os.listdir("/proc/self/fd")) == fds_before
    np.testing.assert_array_equal(store.open(1).read("h0/cuda:0", "w", Box((0,), (16,))), [1] * 8 + [2] * 8)


# -------------------------------------------------------------- the rule itself --
def test_shared_descriptor_closes_once_after_its_last_user(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    shared = SharedDescriptor(fd, lambda: StoreError("closed"))
    with shared.use() as a, shared.use() as b:
        assert a == b == fd
        shared.close()
        shared.close()  # any number of times
        assert _is_open(fd) and shared.closed
    assert not _is_open(fd)
    with pytest.raises(StoreError, match="closed"):
        with shared.use():
            pass


def test_shared_descriptor_reopens_after_a_release(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x")
    opened = []

    def reopen() -> int:
        opened.append(os.open(path, os.O_RDONLY))
        return opened[-1]

    shared = SharedDescriptor(reopen(), lambda: StoreError("closed"), reopen=reopen)
    with shared.use() as fd:
        shared.release()  # while in use: closed when the block ends
        assert os.pread(fd, 1, 0) == b"x"
    assert not _is_open(opened[0])
    with shared.use() as fd:
        assert os.pread(fd, 1, 0) == b"x" and len(opened) == 2
    shared.close()
    assert not _is_open(opened[1])


def test_many_threads_using_and_closing_one_reader_never_see_ebadf(tmp_path):
    """Threads read documents and link files of one reader while others close it: each read either works or
    says the reader is closed; none fails with EBADF, and no descriptor is left open."""
    store = _committed(tmp_path)
    fds_before = set(os.listdir("/proc/self/fd"))
    bad: list[BaseException] = []
    for round_ in range(30):
        reader = store.open(1)
        entry = reader.entries[0]
        start = threading.Barrier(8)

        def use(i: int, reader=reader, entry=entry, start=start, round_=round_):
            start.wait(WAIT_S)
            for j in range(20):
                try:
                    reader.get_json("step")
                    reader.link_file(entry, tmp_path / f"l{round_}-{i}-{j}")
                except StoreError:
                    pass  # closed: what a read after close must say
                except OSError as e:
                    bad.append(e)

        def close(reader=reader, start=start):
            start.wait(WAIT_S)
            reader.close()

        threads = [threading.Thread(target=use, args=(i,)) for i in range(6)]
        threads += [threading.Thread(target=close) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
    assert not bad, bad[:3]
    assert set(os.listdir("/proc/self/fd")) <= fds_before


def test_an_internal_error_is_logged_with_its_traceback(tmp_path, monkeypatch, caplog):
    """The caller of a failed call sees only a status and a message: for INTERNAL (a bug, EBADF...) the server's
    log must say where it happened."""
    from tenplex.store.client import StoreClient
    from tenplex.store.server import serve

    store = _committed(tmp_path)

    def broken(version):
        raise OSError(errno.EBADF, "Bad file descriptor")

    monkeypatch.setattr(store, "open", broken)
    server, port = serve(store, data_plane=False)
    try:
        with caplog.at_level("ERROR", logger="tenplex.store.server"), StoreClient(f"127.0.0.1:{port}") as client:
            with pytest.raises(StoreError, match="INTERNAL.*Bad file descriptor"):
                client.manifest(1)
    finally:
        server.stop(None)
    [record] = [r for r in caplog.records if "INTERNAL" in r.getMessage()]
    assert "GetManifest failed with INTERNAL: OSError: [Errno 9] Bad file descriptor" in record.getMessage()
    assert record.exc_info is not None and "in broken" in caplog.text
