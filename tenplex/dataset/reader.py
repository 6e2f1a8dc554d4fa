"""Read one data-parallel rank's samples: from a FUSE mount, or in process without FUSE.

May import: numpy, the standard library and ``tenplex.dataset`` (format, inplace, state, view, source).

Both readers expose the same thing: ``sample_ids`` (the rank's remaining samples
of the epoch, in read order), ``micro_batches`` (its micro-batch size for every
remaining global batch), ``read(i)`` (the verified record of the i-th sample)
and ``get(i)`` (decoded). ``open_mounted`` reads ``MOUNT/rank{r}/``;
``open_fallback`` computes the same view in process from the dataset directory,
for machines without FUSE. Both are picklable, so DataLoader workers reopen
their files in their own process.
"""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .format import DatasetError, DatasetInfo, check_record, decode_sample
from .inplace import open_dataset, open_records
from .source import RecordSource, check_unchanged, read_verified
from .state import DatasetState
from .statefile import check_state_matches
from .view import DATA_NAME, INDEX_NAME, STATE_NAME, VIEW_FORMAT, build_view


class RankReader:
    state: DatasetState
    sample_ids: np.ndarray
    micro_batches: np.ndarray
    decode_info: dict[str, Any]

    def __len__(self) -> int:
        return len(self.sample_ids)

    def read(self, i: int) -> bytes:
        raise NotImplementedError

    def get(self, i: int) -> Any:
        return decode_sample(self.read(i), self.decode_info)

    def batches(self) -> Iterator[list[int]]:
        """Positions (0..len-1) of each remaining micro-batch, one list per global batch (may be empty)."""
        start = 0
        for size in self.micro_batches.tolist():
            yield list(range(start, start + size))
            start += size


class FallbackRankReader(RankReader):
    """The rank's view computed and read in process: same samples, same order, no FUSE."""

    def __init__(self, dataset: str | os.PathLike | DatasetInfo, state: DatasetState, dp: int, rank: int,
                 source: RecordSource | None = None):
        self.info = dataset if isinstance(dataset, DatasetInfo) else open_dataset(dataset)
        check_state_matches(state, self.info)
        self.source = source or open_records(self.info)
        self.view = build_view(self.info, state, dp, rank)
        self.state = state
        self.sample_ids, self.micro_batches = self.view.sample_ids, self.view.micro_batches
        self.decode_info = self.view.decode_info

    def read(self, i: int) -> bytes:
        try:
            return read_verified(self.source, self.info, int(self.sample_ids[i]))
        except DatasetError:
            check_unchanged(self.source)  # a changed file is the better explanation of a bad record
            raise


class MountedRankReader(RankReader):
    """Reads ``rank{r}/`` of a tenplex FUSE mount with plain file I/O, verifying each sample's crc32."""

    def __init__(self, rank_dir: str | os.PathLike):
        self.dir = Path(rank_dir)
        # rank{r} links to the current generation's directory: resolve it once and read data, index
        # and state all from there, so they belong to one generation even if the mount switches now.
        if not self.dir.exists():
            raise DatasetError(f"{self.dir}: no such rank directory in the mount (the dp degree may have "
                               "changed; reopen with a valid rank)")
        self.view_dir = Path(os.path.realpath(self.dir))
        self._fd: int | None = None
        self._pid = -1
        self._lock = threading.Lock()
        self._open()
        try:
            doc = json.loads((self.view_dir / STATE_NAME).read_bytes())
            index = np.load(self.view_dir / INDEX_NAME, allow_pickle=False)
        except OSError as e:
            raise self._error(e) from None
        if doc.get("format") != VIEW_FORMAT or index.ndim != 2 or index.shape[1] != 4:
            raise DatasetError(f"{self.dir}: unexpected view format {doc.get('format')!r} / index {index.shape}")
        self.doc, self.index = doc, index
        self.generation = doc["generation"]
        self.state = DatasetState.from_dict(doc["state"], source=str(self.dir / STATE_NAME))
        self.sample_ids = index[:, 0]
        self.micro_batches = np.asarray(doc["micro_batches"], dtype=np.int64)
        self.decode_info = {k: doc[k] for k in ("kind", "dtype", "shape") if k in doc}

    def _open(self) -> int:
        with self._lock:
            if self._fd is None or self._pid != os.getpid():
                try:
                    self._fd = os.open(self.view_dir / DATA_NAME, os.O_RDONLY | os.O_CLOEXEC)
                except OSError as e:
                    raise self._error(e) from None
                self._pid = os.getpid()
            return self._fd

    def _error(self, e: OSError) -> Exception:
        if e.errno in (errno.ESTALE, errno.ENOENT):
            return DatasetError(f"{self.dir}: the mount switched to a new view (dp degree or position changed) "
                                "after this reader opened it; reopen the rank directory")
        if e.errno == errno.EIO:
            return DatasetError(f"{self.dir}: the mount refused the read (see {self.dir.parent / STATE_NAME} "
                                "'error': the dataset may have changed under the mount)")
        return e

    def read(self, i: int) -> bytes:
        _, offset, length, _ = (int(x) for x in self.index[i])
        try:
            data = os.pread(self._open(), length, offset)
        except OSError as e:
            raise self._error(e) from None
        # a view's index row is (sample id, offset, length, crc): the same columns check_record reads
        check_record(data, self.index[i], str(self.dir / DATA_NAME), int(self.sample_ids[i]))
        return data

    def close(self) -> None:
        with self._lock:
            if self._fd is not None and self._pid == os.getpid():
                os.close(self._fd)
            self._fd = None

    def __del__(self):
        if getattr(self, "_lock", None) is not None:
            self.close()

    def __getstate__(self):
        state = dict(self.__dict__)
        state.update(_fd=None, _pid=-1, _lock=None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()


def open_mounted(mountpoint: str | os.PathLike, rank: int) -> MountedRankReader:
    return MountedRankReader(Path(mountpoint) / f"rank{rank}")


def open_fallback(dataset: str | os.PathLike | DatasetInfo, state: DatasetState, dp: int, rank: int,
                  source: RecordSource | None = None) -> FallbackRankReader:
    return FallbackRankReader(dataset, state, dp, rank, source)
