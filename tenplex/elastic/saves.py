"""What an elastic job's saves cost and protect: the time they block, the newest committed and protected steps.

May import: the standard library.

:class:`SaveAccounting` is that part of :class:`~tenplex.elastic.job.Job` (which inherits it): its
:meth:`~SaveAccounting.save_cost`, and the committed and protected steps that the job's saves record and its
metrics report, read from the checkpointer's snapshot statistics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any


class SaveAccounting:
    """The job's save costs and committed/protected steps. The job provides the attributes declared below."""

    if TYPE_CHECKING:
        _tracked: dict[str, Any] | None
        _cost: dict[str, Any]
        _next_save: int | None
        _saved_step: int | None
        _committed_blocking: int | None
        _replication_lag: int
        _step_waited: float
        restored: Any

    def _snapshot_stat(self, key: str, default=None):
        """One of this rank's :meth:`tenplex.Checkpointer.snapshot_stats` (``default`` before a restore, or with
        blocking saves only)."""
        t = self._tracked
        return default if t is None else t["checkpointer"].snapshot_stats().get(key, default)

    def _snapshot_boundary(self) -> tuple[int, float]:
        """At a step boundary: this rank's replication lag, and the seconds its optimizer steps waited since the
        last boundary for a snapshot's background copies (``tenplex.integration.snapshot_defer``): they stopped
        training, so they count as the save's blocking time."""
        t = self._tracked
        stats = {} if t is None else t["checkpointer"].snapshot_stats()
        total = float(stats.get("step_waited_s", 0.0))
        before, self._step_waited = self._step_waited, total
        # A new checkpointer (a world in place) counts from 0 again
        return int(stats.get("replication_lag", 0)), total - before if total >= before else total

    def _last_committed_step(self) -> int | None:
        """The step of this job's newest committed save: the last blocking one, or a newer committed snapshot."""
        steps = [s for s in (self._committed_blocking, self._snapshot_stat("committed_step")) if s is not None]
        return max(steps, default=None)

    def _protected_step(self) -> int | None:
        """The newest committed step that survives the loss of any one host: the committed one when every region is
        on two hosts or more (DDP, HSDP); else the committed one less the agreed replication lag, when copies are
        made; None when nothing protects it (one host, or ``replicas=0`` without replicas across hosts)."""
        committed = self._last_committed_step()
        if committed is None or self._snapshot_stat("spread", False):
            return committed
        return committed - self._replication_lag if self._snapshot_stat("copies", 0) else None

    def _background_s(self) -> float:
        """Seconds of this rank's last finished background snapshot write (0: none yet, or blocking saves only)."""
        return float(self._snapshot_stat("last_write_s", 0.0))

    def save_cost(self) -> dict:
        """Saves so far and the seconds they blocked training (``save_s``), steps and their total time (agreed
        over the ranks, without saves), the ratio of the two times, and the current interval. With snapshots
        also: this rank's seconds of background writing (``background_s``), snapshots committed and failed, its
        staging memory (``staging_bytes``) and the replication lag in steps (agreed: the largest over the ranks)
        between the newest committed snapshot and the newest whose copies are committed. ``lost_steps``: the
        steps an earlier world finished beyond the restored one, ``lost_steps_total``: the job's in all.
        ``committed_step``: the newest committed save's step; ``protected_step``: the newest that survives the loss
        of any one host (the elastic guide, "Committed is not the same as protected")."""
        c: dict[str, Any] = dict(self._cost)
        c["fraction"] = c["save_s"] / c["train_s"] if c["train_s"] else 0.0
        c["interval"] = None if self._next_save is None else max(1, self._next_save - (self._saved_step or 0))
        c["lost_steps"] = 0 if self.restored is None else self.restored.lost_steps
        c["lost_steps_total"] = 0 if self.restored is None else self.restored.lost_steps_total
        c["committed_step"], c["protected_step"] = self._last_committed_step(), self._protected_step()
        stats = {} if self._tracked is None else self._tracked["checkpointer"].snapshot_stats()
        if stats:
            c.update(background_s=stats["write_s"], snapshots=stats["committed"], failed_snapshots=stats["failed"],
                     staging_bytes=stats["staging_bytes"], replication_lag=self._replication_lag)
        return c
