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

``StepLoader`` (what ``tenplex.elastic.Job.loader`` returns) feeds one micro-batch per training step
through a ``torch.utils.data.DataLoader`` with the options given (``num_workers``, ``prefetch_factor``,
``pin_memory``, ...), one DataLoader per stretch of an epoch. Its workers read ahead; the position
the job saves is the steps it finished, never what was prefetched, so after a change of world the
samples that were prefetched but not trained on are read again by whichever rank now owns them.
"""

from __future__ import annotations

import os
import signal
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from .format import DatasetInfo
from .reader import RankReader, open_fallback, open_mounted
from .state import STATE_FORMAT, DatasetState, StateError


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


class _IgnoreStop:
    """A DataLoader worker's init: ignore SIGTERM and SIGINT, then run the user's init.

    torchrun stops a worker by signalling its whole process group, DataLoader workers included. A
    worker that died would fail the training process at its next batch; ignoring the signal leaves the
    decision to the training process, which stops at the next step boundary (and its workers exit with
    it: DataLoader workers watch their parent).
    """

    def __init__(self, user: Callable[[int], None] | None):
        self.user = user

    def __call__(self, worker_id: int) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if self.user is not None:
            self.user(worker_id)


# (first step, dataset, micro-batches): the rest of an epoch from ``first`` on (``Job._stretch``)
Stretch = tuple[int, RankDataset, Sequence[list[int]]]


class StepLoader:
    """Batches of consecutive steps through DataLoaders, across epochs; ``make(step, ids, data, weight)`` builds each.

    ``stretch()`` gives the rest of the current epoch from the current step, ``step()`` the step the job
    is at and ``state()`` its dataset state there. Iterating yields forever (epoch after epoch); call the
    job's ``step_done()`` after each batch, exactly once. ``state_dict()``/``load_state_dict()`` have the
    names torchdata's ``StatefulDataLoader`` uses: the state is the data position of the steps done
    (a ``tenplex.dataset-state/1`` document); the job saves and restores it itself, so loading only
    checks that a saved one is the job's (a mismatch means the checkpoint is of another run).
    """

    def __init__(self, stretch: Callable[[], Stretch], step: Callable[[], int], state: Callable[[], DatasetState],
                 make: Callable[..., Any] = lambda *fields: fields, **options: Any):
        self._stretch, self._step, self._state, self._make = stretch, step, state, make
        self.options = {"collate_fn": collate, **options}
        if self.options.get("num_workers"):
            self.options["worker_init_fn"] = _IgnoreStop(self.options.get("worker_init_fn"))

    def __iter__(self) -> Iterator[Any]:
        while True:
            first, data, batches = self._stretch()
            skip = self._step() - first
            starts, stops = data.reader.state.batch_bounds()
            loader = DataLoader(data, batch_sampler=list(batches[skip:]), **self.options)
            for k, collated in enumerate(loader, start=skip):
                if self._step() != first + k:
                    raise StateError(f"the loader yielded step {first + k}, but the job is at step {self._step()}: "
                                     f"call step_done() once after each batch")
                ids = data.sample_ids[batches[k]].tolist()
                yield self._make(first + k, ids, collated, len(ids) / int(stops[k] - starts[k]))

    def state_dict(self) -> dict[str, Any]:
        return self._state().to_dict()

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if not isinstance(saved, dict) or saved.get("format") != STATE_FORMAT:
            raise StateError(f"not a loader state of tenplex (format {STATE_FORMAT!r}); the job restores its data "
                             f"position from its own checkpoint")
        mine, theirs = self._state(), DatasetState.from_dict(saved, source="the loader state")
        if theirs != mine:
            raise StateError(f"the loader state is at position {theirs.position} of dataset {theirs.dataset[:12]}…, "
                             f"but the job restored position {mine.position} of {mine.dataset[:12]}…")
