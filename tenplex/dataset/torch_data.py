"""PyTorch ``Dataset`` and batch ``Sampler`` over one data-parallel rank's view.

May import: torch, numpy, the standard library and ``tenplex.dataset`` (reader, state).

``RankDataset.mounted(MOUNT, rank)`` reads ``MOUNT/rank{r}`` of a tenplex FUSE
mount; ``RankDataset.fallback(DATASET, state, dp, rank)`` computes the same
view in process (no FUSE). Item ``i`` is the rank's i-th remaining sample of the
epoch, decoded (tensors for array kinds), then passed through ``preprocess``
when one is given. ``RankBatchSampler`` yields the rank's
micro-batch for each remaining global batch; their sizes differ across ranks by
at most one, so weight each rank's mean loss by ``len(batch) / global_batch``
(``micro_batch_weights``) and sum across ranks to get the global-batch mean. A
micro-batch may be empty when a global batch has fewer samples than ranks;
``collate`` then returns None so the loop can skip its forward pass but still
take part in the step's collectives.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler, default_collate

from .format import DatasetInfo
from .reader import RankReader, open_fallback, open_mounted
from .state import DatasetState


def _to_torch(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.array(value))  # a writable copy: records are read-only buffers
    if isinstance(value, dict):
        return {k: _to_torch(v) for k, v in value.items()}
    return value


class RankDataset(Dataset):
    def __init__(self, reader: RankReader, preprocess: Callable[[Any], Any] | None = None):
        # preprocess: applied to each decoded sample (torchvision calls it "transform"; in tenplex a
        # transformation reshards state, so the sample's function has its own name)
        self.reader, self.preprocess = reader, preprocess

    @classmethod
    def mounted(cls, mountpoint: str | os.PathLike, rank: int, **kwargs) -> "RankDataset":
        return cls(open_mounted(mountpoint, rank), **kwargs)

    @classmethod
    def fallback(cls, dataset: str | os.PathLike | DatasetInfo, state: DatasetState, dp: int, rank: int,
                 **kwargs) -> "RankDataset":
        return cls(open_fallback(dataset, state, dp, rank), **kwargs)

    @property
    def sample_ids(self) -> np.ndarray:
        return self.reader.sample_ids

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, i: int) -> Any:
        value = _to_torch(self.reader.get(i))
        return self.preprocess(value) if self.preprocess else value


class RankBatchSampler(Sampler[list[int]]):
    """The rank's micro-batches (dataset positions), one per remaining global batch, in order."""

    def __init__(self, dataset: RankDataset):
        self.reader = dataset.reader

    def __len__(self) -> int:
        return len(self.reader.micro_batches)

    def __iter__(self) -> Iterator[list[int]]:
        return self.reader.batches()


def micro_batch_weights(dataset: RankDataset) -> list[float]:
    """Loss weight of this rank's micro-batch at each remaining step: its share of that global batch
    (a kept partial batch at the end of the epoch is smaller than the others)."""
    starts, stops = dataset.reader.state.batch_bounds()
    return (dataset.reader.micro_batches / (stops - starts)).tolist()


def collate(batch: list[Any]) -> Any:
    """``default_collate``, except that an empty micro-batch gives None instead of an error."""
    return default_collate(batch) if batch else None
