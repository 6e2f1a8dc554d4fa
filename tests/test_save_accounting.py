"""The elastic job counts the seconds ``optimizer.step()`` waited for a snapshot's background copies as save time.

:meth:`tenplex.elastic.saves.SaveAccounting._snapshot_boundary` reads the checkpointer's cumulative
``step_waited_s`` once per step boundary and gives what was added since the last boundary (a new checkpointer,
as in a new world in place, counts from 0 again), with the replication lag read from the same statistics.
"""

from __future__ import annotations

from tenplex.elastic.saves import SaveAccounting


class Stats:
    """A checkpointer as far as the accounting reads it."""

    def __init__(self, waited: float, lag: int = 0) -> None:
        self.waited, self.lag = waited, lag

    def snapshot_stats(self) -> dict:
        return {"step_waited_s": self.waited, "replication_lag": self.lag}


class Accounting(SaveAccounting):
    def __init__(self, checkpointer) -> None:
        self._tracked = None if checkpointer is None else {"checkpointer": checkpointer}
        self._step_waited = 0.0


def test_each_boundary_gets_the_waits_since_the_last_one():
    ckpt = Stats(0.25, lag=2)
    job = Accounting(ckpt)
    assert job._snapshot_boundary() == (2, 0.25)
    assert job._snapshot_boundary() == (2, 0.0)
    ckpt.waited = 0.75
    assert job._snapshot_boundary() == (2, 0.5)
    job._tracked = {"checkpointer": Stats(0.125)}  # the next world's checkpointer starts from 0
    assert job._snapshot_boundary() == (0, 0.125)
    assert Accounting(None)._snapshot_boundary() == (0, 0.0)
