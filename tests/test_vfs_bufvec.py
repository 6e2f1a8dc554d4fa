"""fuse_bufvec replies built in process (no mount): the pieces of any read equal the view's segments."""

import ctypes

import numpy as np
import pytest

from fuse_vfs import bufvec
from tenplex.dataset.pack import write_dataset
from tenplex.dataset.state import DatasetState
from tenplex.dataset.view import build_view

_free = ctypes.CDLL(None).free
_free.argtypes = [ctypes.c_void_p]


def _bufs(ptr: int) -> np.ndarray:
    """The bufs of a malloc'd bufvec."""
    count, idx, off = (ctypes.c_uint64.from_address(ptr + 8 * i).value for i in range(3))
    assert (idx, off) == (0, 0)
    return np.frombuffer(ctypes.string_at(ptr + 24, bufvec.BUF.itemsize * count), dtype=bufvec.BUF).copy()


def _read_back(ptr: int) -> np.ndarray:
    """The bufs of a malloc'd bufvec, which is then freed (as libfuse does)."""
    bufs = _bufs(ptr)
    _free(ptr)
    return bufs


@pytest.fixture(scope="module")
def view(tmp_path_factory):
    rng = np.random.default_rng(4)
    # Sizes 0..300: empty samples, reads inside one sample, and many samples per read.
    records = [bytes(int(n)) for n in rng.integers(0, 300, 500)]
    info = write_dataset(iter(records), tmp_path_factory.mktemp("d") / "ds", "bytes", file_bytes=4000)
    return build_view(info, DatasetState(info.identity, len(records), 3, 0, 10), 2, 1)


def test_pieces_equal_the_views_segments(view):
    fds = np.arange(100, 100 + view.rows[:, 0].max() + 1, dtype=np.int32)   # a made-up descriptor per file
    table = bufvec.PieceTable(view, fds)
    rng = np.random.default_rng(5)
    ranges = [(0, 1), (0, view.data_size), (view.data_size - 1, 4096), (view.data_size, 10), (5, 0)]
    ranges += [(int(o), int(n)) for o, n in zip(rng.integers(0, view.data_size, 300), rng.integers(1, 20000, 300))]
    for offset, size in ranges:
        files, pos, lengths = view.segments(offset, size)
        bufs = _read_back(table.bufvec(offset, size))
        assert bufs["size"].tolist() == lengths.tolist(), (offset, size)
        assert bufs["fd"].tolist() == fds[files].tolist() and bufs["pos"].tolist() == pos.tolist()
        assert (bufs["flags"] == bufvec.FD_FLAGS).all() and (bufs["mem"] == 0).all()
        assert bufs["size"].sum() == max(0, min(size, view.data_size - offset))


def test_memory_bufvec_holds_a_copy():
    ptr = bufvec.memory_bufvec(b"hello")
    bufs = _bufs(ptr)
    assert bufs["size"].tolist() == [5] and bufs["flags"].tolist() == [0]
    assert ctypes.string_at(int(bufs["mem"][0]), 5) == b"hello"
    _free(int(bufs["mem"][0]))
    _free(ptr)
    assert len(_read_back(bufvec.memory_bufvec(b""))) == 0

