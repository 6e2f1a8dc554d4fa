"""One data-parallel rank's view of the dataset: its remaining samples of the epoch, laid end to end.

May import: numpy, the standard library and ``tenplex.dataset`` (format, state).

The view is what the FUSE mount shows in ``rank{r}/`` and what the in-process
fallback reader serves; both are built from this one table, so they cannot
disagree. A rank directory holds::

    data        the rank's samples' records back to back, in read order
    index.npy   int64 (n, 4): sample id, offset in ``data``, length, crc32
    state.json  the dataset state, dp degree and rank, generation, decode info,
                the micro-batch size of every remaining step, and the elastic
                job's world that switched the view to it (null when none did)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from .format import CRC, FILE, LENGTH, OFFSET, DatasetInfo, index_bytes
from .state import DatasetState, remaining_in_epoch

DATA_NAME = "data"
INDEX_NAME = "index.npy"
STATE_NAME = "state.json"
RANK_FILES = (DATA_NAME, INDEX_NAME, STATE_NAME)
VIEW_FORMAT = "tenplex.rank-view/1"


@dataclass(frozen=True)
class RankView:
    rank: int
    dp: int
    state: DatasetState
    generation: int
    sample_ids: np.ndarray      # (n,) in read order
    rows: np.ndarray            # (n, 4) the dataset index rows of those samples: file, offset, length, crc
    data_offsets: np.ndarray    # (n + 1,) start of each sample in ``data``; the last entry is its size
    micro_batches: np.ndarray   # (steps,) this rank's micro-batch size in each remaining global batch
    decode_info: dict[str, Any]
    world: str | None = None    # the elastic job's world that switched the mount to this view

    @property
    def data_size(self) -> int:
        return int(self.data_offsets[-1])

    def index_array(self) -> np.ndarray:
        """(n, 4) int64: sample id, offset in ``data``, length, crc32 (the ``index.npy`` of the view)."""
        return np.stack([self.sample_ids, self.data_offsets[:-1], self.rows[:, LENGTH], self.rows[:, CRC]],
                        axis=1).astype(np.int64)

    def index_npy(self) -> bytes:
        return index_bytes(self.index_array())

    def state_doc(self) -> dict[str, Any]:
        return {"format": VIEW_FORMAT, "rank": self.rank, "dp": self.dp, "generation": self.generation,
                "world": self.world, "state": self.state.to_dict(), "num_samples": int(len(self.sample_ids)),
                "data_bytes": self.data_size, "micro_batches": self.micro_batches.tolist(),
                **self.decode_info}

    def state_json(self) -> bytes:
        return json.dumps(self.state_doc(), separators=(",", ":")).encode()

    def segments(self, offset: int, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Record file, record-file offset and length of each piece of ``data[offset : offset+size]``."""
        end = min(offset + size, self.data_size)
        if offset >= end:
            empty = np.empty(0, dtype=np.int64)
            return empty, empty, empty
        starts = self.data_offsets
        i0 = int(np.searchsorted(starts, offset, side="right")) - 1
        i1 = int(np.searchsorted(starts, end, side="left"))   # first sample starting at or after ``end``
        idx = np.arange(i0, i1)                                 # (k,) samples overlapping the range
        lo = np.maximum(starts[idx], offset)
        hi = np.minimum(starts[idx + 1], end)
        keep = hi > lo                                          # drops empty samples
        idx, lo, hi = idx[keep], lo[keep], hi[keep]
        return self.rows[idx, FILE], self.rows[idx, OFFSET] + (lo - starts[idx]), hi - lo


def build_view(info: DatasetInfo, state: DatasetState, dp: int, rank: int, generation: int = 0,
               world: str | None = None) -> RankView:
    ids, micro = remaining_in_epoch(state, dp, rank)
    rows = info.index[ids]                                      # (n, 4)
    offsets = np.concatenate(([0], np.cumsum(rows[:, LENGTH]))).astype(np.int64)
    return RankView(rank, dp, state, generation, ids, rows, offsets, micro, info.decode_info(), world)
