"""PyTorch integration: save a parallel job's state into the tensor stores and restore it under another configuration.

May import: every lower layer (``tenplex.store``, ``tenplex.transform``,
``tenplex.planner``, ``tenplex.ptc``, ``tenplex.layout``, ``tenplex.box``, …),
torch and torch.distributed. Nothing below imports this package.

Use::

    ckpt = tenplex.Checkpointer()            # store dir, host, device from the environment
    step = tenplex.restore(model, optimizer, scheduler=sched, checkpointer=ckpt) or 0
    ...
    tenplex.save(model, optimizer, step=step, scheduler=sched, checkpointer=ckpt)

Modules: :mod:`.pieces` (state -> named global tensors with boxes),
:mod:`.annotate` (plain local tensors), :mod:`.nontensor` (RNG, scheduler,
scaler, optimizer hyper-parameters as JSON), :mod:`.exchange` (JSON between
ranks without pickles), :mod:`.shardio` (pieces <-> store files),
:mod:`.checkpointer` (the collective save and restore), :mod:`.savedoc` (the save's JSON documents),
:mod:`.commit` (commit on every host or on none), :mod:`.snapshot`, :mod:`.jobstore` and
:mod:`.staging` (snapshots: staged at a step boundary, stored and committed in the
background), :mod:`.layouts` (what each rank holds, who writes what, whether a
restore matches the save), :mod:`.versions` (which saved version a restore reads), :mod:`.restoring` (the
restore's steps after that), :mod:`.moves` (read-through and transformation when a restore moves state between
devices).
"""

from __future__ import annotations

from typing import Any

from .annotate import Annotation, ShardMap, annotations_from_layout, annotations_from_ptc
from .checkpointer import Checkpointer, RestoreInfo
from .exchange import CollectiveError
from .nontensor import StateMismatchError
from .snapshot import SnapshotError

__all__ = ["Checkpointer", "RestoreInfo", "save", "restore", "Annotation", "ShardMap", "annotations_from_layout",
           "annotations_from_ptc", "StateMismatchError", "CollectiveError", "SnapshotError"]

# The checkpointer of save() and restore() called without one: built from the environment on first use and kept
# for the life of the process (README, "The default checkpointer"). Pass checkpointer= to be explicit.
_default: Checkpointer | None = None


def _checkpointer(given: Checkpointer | None) -> Checkpointer:
    global _default
    if given is not None:
        return given
    if _default is None:
        _default = Checkpointer()
    return _default


def save(model, optimizer=None, *, step: int, extra: Any = None, scheduler=None, scaler=None,
         annotations=None, rng: bool = True, checkpointer: Checkpointer | None = None, blocking: bool = True):
    """Save model, optimizer and training state at ``step`` as a new version; returns the version.

    Collective: every rank of the job calls it. See :meth:`Checkpointer.save`. Without ``checkpointer``
    it uses the process-wide default, built from the environment on the first call and then kept.
    ``blocking=False`` takes a snapshot instead (:meth:`Checkpointer.async_save`): it returns once the state
    is staged in host memory, with a future of the version.
    """
    ckpt = _checkpointer(checkpointer)
    if not blocking:
        return ckpt.async_save(model, optimizer, step=step, extra=extra, scheduler=scheduler, scaler=scaler,
                               annotations=annotations, rng=rng)
    return ckpt.save(model, optimizer, step=step, extra=extra, scheduler=scheduler, scaler=scaler,
                     annotations=annotations, rng=rng)


def restore(model, optimizer=None, *, extra: dict | None = None, scheduler=None, scaler=None, annotations=None,
            rng: bool = True, layout=None, version: int | None = None,
            checkpointer: Checkpointer | None = None) -> int | None:
    """Restore the newest saved state in place, under this job's configuration; returns its step (None: nothing saved).

    Collective: every rank of the job calls it. See :meth:`Checkpointer.restore`. Without ``checkpointer``
    it uses the process-wide default, built from the environment on the first call and then kept.
    """
    return _checkpointer(checkpointer).restore(model, optimizer, extra=extra, scheduler=scheduler, scaler=scaler,
                                               annotations=annotations, rng=rng, layout=layout, version=version)
