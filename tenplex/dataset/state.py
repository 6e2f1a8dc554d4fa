"""The dataset's part of the PTC: which samples each data-parallel rank reads, as a pure function.

May import: numpy, the standard library and ``tenplex.errors``. PURE: no file, network or
process-group access; everything here is recomputed from the state, never stored.

State: (dataset identity, number of samples N, seed, position, global batch B,
drop_last). ``position`` counts the samples consumed since the start of training
(epoch 0), across epochs; the epoch is derived from it::

    samples_per_epoch L = N                 if the final partial batch is kept
                        = floor(N / B) * B  if it is dropped (the default)
    epoch               = position // L
    offset in epoch     = position %  L     (always a multiple of B: a batch boundary)

Epoch ``e`` reads the permutation ``default_rng([seed, e]).permutation(N)``;
global batch ``k`` of an epoch is ``order[k*B : min((k+1)*B, L)]``. Each global
batch is split into ``dp`` contiguous micro-batches whose sizes differ by at
most one (the first ``b % dp`` ranks get one more), so the global batch
sequence depends on neither the dp degree nor the history of dp changes. A
training loop weights rank r's mean loss by ``size_r / b`` to recover the
global-batch mean exactly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from ..errors import TenplexError

STATE_FORMAT = "tenplex.dataset-state/1"


class StateError(TenplexError, ValueError):
    """An inconsistent dataset state or data-parallel configuration (says which value and why)."""


def samples_per_epoch(num_samples: int, global_batch: int, drop_last: bool) -> int:
    """L: the samples consumed by one epoch (the partial tail batch is dropped or kept)."""
    return (num_samples // global_batch) * global_batch if drop_last else num_samples


def epoch_order(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The epoch's sample order: a permutation of 0..N-1 seeded from (seed, epoch); int64, shape (N,)."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples).astype(np.int64)


def split_sizes(batch: int, dp: int) -> np.ndarray:
    """Micro-batch size of each rank for a global batch of ``batch`` samples; shape (dp,), differ by ≤ 1."""
    sizes = np.full(dp, batch // dp, dtype=np.int64)
    sizes[: batch % dp] += 1
    return sizes


@dataclass(frozen=True)
class DatasetState:
    dataset: str           # dataset identity (content hash); "" when not bound to a packed dataset
    num_samples: int
    seed: int
    position: int          # samples consumed since the start of epoch 0
    global_batch: int
    drop_last: bool = True

    def __post_init__(self) -> None:
        for name in ("num_samples", "global_batch"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise StateError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("seed", "position"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise StateError(f"{name} must be a non-negative integer, got {getattr(self, name)!r}")
        if self.epoch_length == 0:
            raise StateError(f"global batch {self.global_batch} is larger than the dataset ({self.num_samples} "
                             "samples) and the partial batch is dropped: an epoch would be empty; "
                             "use a smaller global batch or keep the last batch")
        if self.offset % self.global_batch:
            raise StateError(f"position {self.position} is not at a global-batch boundary: it is "
                             f"{self.offset} samples into epoch {self.epoch}, not a multiple of "
                             f"global batch {self.global_batch}")

    @property
    def epoch_length(self) -> int:
        return samples_per_epoch(self.num_samples, self.global_batch, self.drop_last)

    @property
    def epoch(self) -> int:
        return self.position // self.epoch_length

    @property
    def offset(self) -> int:
        """Samples already consumed in the current epoch."""
        return self.position % self.epoch_length

    def batch_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """Start and stop (within the epoch order) of this epoch's remaining global batches."""
        starts = np.arange(self.offset, self.epoch_length, self.global_batch, dtype=np.int64)
        return starts, np.minimum(starts + self.global_batch, self.epoch_length)

    def advance(self, steps: int) -> "DatasetState":
        """The state after ``steps`` more global batches (crossing epochs as needed)."""
        per_epoch = -(-self.epoch_length // self.global_batch)  # batches per epoch, the tail included
        done = self.epoch * per_epoch + self.offset // self.global_batch + steps  # batches since epoch 0
        return replace(self, position=(done // per_epoch) * self.epoch_length
                       + (done % per_epoch) * self.global_batch)

    def to_dict(self) -> dict[str, Any]:
        return {"format": STATE_FORMAT, **asdict(self), "epoch": self.epoch}

    @classmethod
    def from_dict(cls, doc: dict[str, Any], source: str = "state") -> "DatasetState":
        if not isinstance(doc, dict) or doc.get("format") != STATE_FORMAT:
            raise StateError(f"{source}: format is not {STATE_FORMAT!r}")
        try:
            state = cls(**{k: doc[k] for k in ("dataset", "num_samples", "seed", "position", "global_batch",
                                               "drop_last")})
        except KeyError as e:
            raise StateError(f"{source}: missing field {e}") from None
        if "epoch" in doc and doc["epoch"] != state.epoch:
            raise StateError(f"{source}: epoch {doc['epoch']} does not match position {state.position} "
                             f"(which is in epoch {state.epoch}); the position counts samples since epoch 0")
        return state


def _check_rank(dp: int, rank: int) -> None:
    if not isinstance(dp, int) or dp <= 0:
        raise StateError(f"dp degree must be a positive integer, got {dp!r}")
    if not 0 <= rank < dp:
        raise StateError(f"dp rank {rank} is outside 0..{dp - 1}")


def rank_part(starts: np.ndarray, stops: np.ndarray, dp: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Start and size (in the epoch order) of ``rank``'s micro-batch in each global batch [start, stop)."""
    _check_rank(dp, rank)
    b = stops - starts                      # (batches,) global batch sizes
    base, extra = b // dp, b % dp           # (batches,) each
    first = starts + rank * base + np.minimum(rank, extra)
    return first, base + (rank < extra)


def _gather(order: np.ndarray, first: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Concatenate order[first[i] : first[i]+sizes[i]] for all i, without a Python loop."""
    total = int(sizes.sum())
    if total == 0:
        return np.empty(0, dtype=np.int64)
    # (total,) position of each output element: its run's start plus its index inside the run.
    run_start = np.repeat(first - np.concatenate(([0], np.cumsum(sizes)[:-1])), sizes)
    return order[run_start + np.arange(total)]


def remaining_in_epoch(state: DatasetState, dp: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """``rank``'s remaining sample ids of the current epoch in read order, and its micro-batch size per step."""
    starts, stops = state.batch_bounds()
    first, sizes = rank_part(starts, stops, dp, rank)
    order = epoch_order(state.num_samples, state.seed, state.epoch)
    return _gather(order, first, sizes), sizes


def upcoming_batches(state: DatasetState, dp: int, steps: int) -> dict[str, Any]:
    """The next ``steps`` global batches, each rank's ids in read order, and the position afterwards.

    This is the ``tenplex data plan --json`` contract:
    ``{"ranks": [[ids of rank r]...], "batches": [[ids of batch k]...], "position": P'}``.
    """
    _check_rank(dp, 0)
    if steps < 0:
        raise StateError(f"steps must be non-negative, got {steps}")
    batches: list[list[int]] = []
    ranks: list[list[int]] = [[] for _ in range(dp)]
    current, orders = state, {}
    for _ in range(steps):
        epoch = current.epoch
        if epoch not in orders:
            orders = {epoch: epoch_order(state.num_samples, state.seed, epoch)}
        start = current.offset
        stop = min(start + state.global_batch, current.epoch_length)
        batch = orders[epoch][start:stop]
        batches.append(batch.tolist())
        cut = np.concatenate(([0], np.cumsum(split_sizes(stop - start, dp))))
        for r in range(dp):
            ranks[r].extend(batch[cut[r]:cut[r + 1]].tolist())
        current = current.advance(1)
    return {"ranks": ranks, "batches": batches, "position": current.position}
