"""Staging off the training thread: a snapshot's copies of what only ``optimizer.step()`` changes.

May import: this package's :mod:`.pieces`, :mod:`.snapshot_buffers` and :mod:`.snapshot_pieces`, torch and the
standard library.

At a step boundary between exchanges (:mod:`.snapshot`) the training thread need not copy a CPU piece whose
tensor only the optimizer changes (a parameter of its parameter groups, a tensor of its ``state``), nor read the
optimizer's scalar states (Adam's ``step``): nothing changes them before the next ``optimizer.step()``. So the
boundary records those pieces' in-place version counters and hands them to the snapshot's writer thread
(:class:`Capture`), which copies them into buffers of their own (numpy copies, which release the GIL while the
next step's forward and backward run), reads the scalars and compares the counters. An optimizer step
pre-hook makes the next ``optimizer.step()`` wait until that is done (``snapshot_stats()["step_waited_s"]``,
counted in the save's blocking time by :class:`tenplex.elastic.Job`; with steps of some milliseconds the copies
are done long before). A counter that moved meanwhile (the loop changed a parameter in place outside
``optimizer.step()``: a ``load_state_dict``, an EMA update, a clamp) means the copy may mix two steps: the rank
does not write its part (the snapshot fails, as a failed write does) and this snapshotter stages everything at
the boundary from then on. Not seen, as for the unchanged pieces' fingerprints: a change through ``.data``
(it bumps no counter).

Staged at the boundary as before: everything when the optimizer is not a ``torch.optim.Optimizer`` whose step
runs hooks, model buffers (a forward changes BatchNorm's statistics), pieces on a GPU (their copies are already
asynchronous: :mod:`.snapshot_buffers`), canonical buffers, and every piece of a snapshot that exchanges.
"""

from __future__ import annotations

import operator
import threading
import time
import weakref
from typing import Any, Callable

import torch

from .pieces import Piece, version_of
from .snapshot_buffers import SnapshotBuffers
from .snapshot_pieces import tracked_sources


class Torn(Exception):
    """A tensor handed to the writer thread changed before its copy was made: the part would mix two steps."""


class Capture:
    """One snapshot's work left to the writer thread (see the module docstring); ``done`` once it is over."""

    def __init__(self, owner: "DeferredStaging", pieces: list[Piece], sources: list[torch.Tensor], structure: Any,
                 scalars: Callable[[], dict] | None) -> None:
        self.owner, self.pieces, self.sources, self.structure = owner, pieces, sources, structure
        self._scalars = scalars
        self.versions = version_of(*sources)  # at the boundary
        self.done = threading.Event()

    def run(self) -> dict | None:
        """Copy the pieces, read the optimizer's scalars, check the counters: the scalars (None: not asked).
        Raises :class:`Torn` when a counter moved since the boundary (and stages at the boundary from then on)."""
        try:
            self.owner.buffers.stage(self.pieces, self.structure)
            self.owner.report()
            scalars = self._scalars() if self._scalars is not None else None
            now = version_of(*self.sources)
            if now != self.versions:
                assert now is not None and self.versions is not None  # (the split took only counted tensors)
                changed = {id(s) for s, before, after in zip(self.sources, self.versions, now) if before != after}
                moved = sorted({p.name for p in self.pieces
                                if any(id(s) in changed for s in _sources(p, self.structure))})
                self.owner.enabled = False
                raise Torn(f"{', '.join(moved[:3])} changed in place between the step boundary and its copy, outside "
                           f"optimizer.step(); this rank's snapshots stage at the boundary from now on")
            return scalars
        finally:
            self.done.set()
            # A training thread waiting in the step hook gets the GIL now, not after this thread's next switch
            # interval (5 ms) of the write's Python work
            time.sleep(0)


def _sources(piece: Piece, structure: Any) -> tuple[torch.Tensor, ...]:
    sources = tracked_sources(piece, structure)
    assert sources is not None  # the split leaves only cached pieces of the structure to the thread
    return sources


def hooks_steps(optimizer) -> bool:
    """Whether ``optimizer.step()`` runs step pre-hooks (a ``torch.optim.Optimizer`` that patched its class)."""
    return isinstance(optimizer, torch.optim.Optimizer) and bool(getattr(type(optimizer).step, "hooked", False))


class DeferredStaging:
    """Which pieces a snapshot leaves to the writer thread, their buffers, and the hook that waits for them."""

    def __init__(self, stats: dict, boundary: SnapshotBuffers) -> None:
        self.boundary = boundary  # the buffers staged at the boundary
        self.buffers = SnapshotBuffers(release_gil=True)
        self.enabled = True  # False once a copy was torn (see the module docstring)
        self.stats = stats
        self._owned: tuple[Any, int, frozenset[int]] | None = None  # (structure, optimizer id, piece ids)
        self._split: tuple[Any, int, list[Piece], list[Piece], list[Piece]] | None = None  # the last split's
        self._sources: tuple[list[Piece], list[torch.Tensor]] | None = None  # the last hand-over's
        self._hook: tuple[weakref.ref, Any] | None = None  # (the hooked optimizer, its handle)
        self._current: Capture | None = None

    def report(self) -> None:
        """The staging memory in ``stats``: the buffers of both kinds, and those this thread staged."""
        self.stats.update(staging_bytes=self.boundary.nbytes + self.buffers.nbytes, deferred_bytes=self.buffers.nbytes)

    def usable(self, optimizer, structure: Any) -> bool:
        return self.enabled and structure is not None and hooks_steps(optimizer)

    def split(self, pieces: list[Piece], optimizer, structure: Any, every: list[Piece],
              keep: set | frozenset = frozenset()) -> tuple[list[Piece], list[Piece]]:
        """``pieces`` (some of ``every``, this rank's pieces) as (staged at the boundary, left to the writer
        thread): the latter are the cached CPU pieces (of ``structure``) of a tensor the optimizer holds, but
        ``keep``'s (tensor, box) keys."""
        if not self.usable(optimizer, structure):
            return pieces, []
        last = self._split
        if last is not None and last[0] is structure and last[1] == id(optimizer) and not keep \
                and len(last[2]) == len(pieces) and all(map(operator.is_, last[2], pieces)):
            return last[3], last[4]  # the same pieces as last time (the cached ones: the same objects)
        owned = self._owned
        if owned is None or owned[0] is not structure or owned[1] != id(optimizer):
            owned = self._owned = (structure, id(optimizer), _optimizer_pieces(every, optimizer, structure))
        ids = owned[2]
        now = [p for p in pieces if id(p) not in ids or (keep and (p.name, p.box) in keep)]
        later = [p for p in pieces if id(p) in ids and not (keep and (p.name, p.box) in keep)] if now else pieces
        self._split = (structure, id(optimizer), list(pieces), now, later) if not keep else None
        return now, later

    def hand_over(self, pieces: list[Piece], optimizer, structure: Any, scalars: Callable[[], dict] | None) -> Capture:
        """At the boundary: what the writer thread does before the next ``optimizer.step()``."""
        self._ensure_hook(optimizer)
        known = self._sources
        if known is None or known[0] is not pieces:  # the same list while the split is (see split)
            known = self._sources = (pieces, [s for p in pieces for s in _sources(p, structure)])
        capture = self._current = Capture(self, pieces, known[1], structure, scalars)
        return capture

    def wait(self, timeout: float | None = None) -> float:
        """Until the last hand-over's copies are made (a restore, close: before they change tensors); the seconds
        it waited."""
        capture = self._current
        if capture is None or capture.done.is_set():
            return 0.0
        begin = time.monotonic()
        capture.done.wait(timeout)
        return time.monotonic() - begin

    def _before_step(self) -> None:
        """The step hook: wait for the copies, and count the wait as the step's (``step_waited_s``)."""
        waited = self.wait()
        if waited:
            self.stats.update(step_waited_s=self.stats["step_waited_s"] + waited, last_step_wait_s=waited)

    def _ensure_hook(self, optimizer) -> None:
        hooked = self._hook
        if hooked is not None and hooked[0]() is optimizer:
            return
        self.remove_hook()
        this = weakref.ref(self)  # the optimizer outlives a world in place; this, its pieces and meshes must not

        def before_step(_optimizer, _args, _kwargs) -> None:
            staging = this()
            if staging is not None:
                staging._before_step()
        self._hook = (weakref.ref(optimizer), optimizer.register_step_pre_hook(before_step))

    def remove_hook(self) -> None:
        if self._hook is not None:
            self._hook[1].remove()
            self._hook = None
        self._current = None


def _optimizer_pieces(pieces: list[Piece], optimizer, structure: Any) -> frozenset[int]:
    """The ids of those cached CPU ``pieces`` whose tensor the optimizer holds (a parameter of its groups, a tensor
    of its state) and whose counters can be read."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    held.update(id(v) for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))
    found = set()
    for piece in pieces:
        sources = tracked_sources(piece, structure)
        # (an inference tensor tracks no version: version_of gives None)
        if sources and id(sources[0]) in held and piece.local.device.type == "cpu" and version_of(*sources):
            found.add(id(piece))
    return frozenset(found)
