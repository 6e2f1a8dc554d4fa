"""This rank's data of an elastic job: the data position, its share of each global batch, the loader.

May import: ``tenplex.elastic`` (dataview), ``tenplex.dataset``, ``tenplex.parallel``, ``tenplex.errors`` and
the standard library.

:class:`JobData` is the data half of :class:`~tenplex.elastic.job.Job` (which inherits it): :meth:`Job.restore`
opens the position it restored (``_open_data``), :meth:`~JobData.batch` and :meth:`~JobData.loader` read this
rank's data-parallel share from :attr:`step` on (through the node's dataset view with ``tenplex run
--data-mount``: :mod:`tenplex.elastic.dataview`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from . import dataview

if TYPE_CHECKING:
    from ..dataset import DatasetState
    from ..dataset.torch_data import RankDataset, StepLoader
    from ..parallel import ParallelConfig


@dataclass(frozen=True)
class Batch:
    """This rank's micro-batch of the global batch at ``step``: sample ids, collated data, loss weight."""

    step: int
    ids: list[int]
    data: Any            # collated samples (a tensor for token datasets); None when the micro-batch is empty
    weight: float        # len(ids) / global batch size: multiply the mean loss by it, then sum over dp


class JobData:
    """The data position and this rank's batches of a :class:`~tenplex.elastic.job.Job`. The job provides the
    attributes declared below and :attr:`config`, :attr:`coords` of its world."""

    if TYPE_CHECKING:
        dataset: str | os.PathLike | None
        seed: int
        global_batch: int
        drop_last: bool
        step: int
        host: str
        world_id: str
        group: Any
        _tracked: dict[str, Any] | None
        _data: tuple[int, RankDataset, list[list[int]]] | None
        _data_start: int
        _state0: DatasetState | None
        _data_view: Path | None

        @property
        def config(self) -> ParallelConfig: ...

        @property
        def coords(self) -> dict[str, int]: ...

    def _open_data(self, saved: dict | None) -> None:
        from ..dataset import DatasetState, open_dataset

        if self.dataset is None:
            raise ConfigError("this job has no dataset to position; pass dataset= to Job")
        info = open_dataset(self.dataset)
        if saved is not None:
            state = DatasetState.from_dict(saved, source="the restored data position")
            if state.dataset != info.identity:
                raise ConfigError(f"the saved data position belongs to dataset {state.dataset[:12]}…, but "
                                  f"{self.dataset} is {info.identity[:12]}…; pass the dataset the job trained on")
        else:
            state = DatasetState(info.identity, info.num_samples, self.seed, 0, self.global_batch, self.drop_last)
        if state.global_batch != self.global_batch:
            raise ConfigError(f"the job was saved with global batch {state.global_batch}, not {self.global_batch}")
        self._info, self._state0, self._data_start = info, state, self.step
        self._data = None

    @property
    def data_view(self) -> Path | None:
        """This rank's directory of its node's dataset view, switched to this world (``tenplex run --data-mount``);
        None without a view. Before :meth:`restore` (which switches it) a job with a view raises, in one line."""
        return dataview.checked(self._data_view, restored=self._tracked is not None)

    @property
    def data_state(self):
        """The dataset state (position) at :attr:`step`; None without a dataset."""
        if self._state0 is None:
            return None
        return self._state0.advance(self.step - self._data_start)

    def batch(self) -> Batch:
        """This rank's data-parallel share of the global batch at :attr:`step` (its tp/pp peers get the same)."""
        from ..dataset.torch_data import collate

        first, data, batches = self._stretch()
        positions = batches[self.step - first]
        starts, stops = data.reader.state.batch_bounds()
        size = int(stops[self.step - first] - starts[self.step - first])
        ids = data.sample_ids[positions].tolist()
        return Batch(self.step, ids, collate([data[i] for i in positions]), len(ids) / size)

    def _stretch(self) -> tuple[int, "RankDataset", list[list[int]]]:
        """(first step, RankDataset, micro-batches) of this epoch's rest from :attr:`step` on (the view's, if any)."""
        from ..dataset.torch_data import RankBatchSampler, RankDataset

        if self._state0 is None:
            raise ConfigError("this Job has no dataset: pass dataset= to Job, or read your data yourself")
        if self._data is not None and 0 <= self.step - self._data[0] < len(self._data[2]):
            return self._data
        # A reader per stretch of steps within one epoch: it yields the rest of that epoch's micro-batches.
        first, state = self.step, self.data_state
        if self._data_view is None:
            data = RankDataset.fallback(self._info, state, self.config.dp, self.coords["dp"])
        else:
            if self._data is not None:  # a new epoch: the view held the rest of the last one
                self._data_view = dataview.follow(self, state)
            data = dataview.open_rank(self._data_view, state)
        self._data = (first, data, list(RankBatchSampler(data)))
        return self._data

    def loader(self, **options: Any) -> "StepLoader":
        """This rank's batches from :attr:`step` on through a ``torch.utils.data.DataLoader`` (``options``:
        ``num_workers``, ``prefetch_factor``, ``pin_memory``, ``collate_fn``, …): one :class:`Batch` per step,
        across epochs; call :meth:`step_done` after each. Samples its workers prefetched but the job did not
        train on are not counted: the position is the steps done (see ``tenplex.dataset.torch_data``)."""
        from ..dataset.torch_data import StepLoader

        return StepLoader(self._stretch, lambda: self.step, lambda: self.data_state, Batch, **options)
