"""Worlds in place: a :class:`~tenplex.elastic.job.Job` that lives through several worlds in one process.

May import: ``tenplex.elastic`` (protocol, reform, faults, leftovers), ``tenplex.errors``,
``tenplex.integration.memory``, torch.distributed and the standard library.

:class:`InPlaceWorlds` is the in-place half of :class:`~tenplex.elastic.job.Job` (which inherits it):
:meth:`~InPlaceWorlds.worlds`, ending a world at a step boundary, entering the next generation's, and the record
of each change's pause (``job.reconfigurations``).

The loop form (works under ``tenplex run`` with and without ``--in-place``)::

    job = tenplex.elastic.Job(dataset=..., global_batch=...)
    for world in job.worlds():                       # once per world, in the same process
        with world:                                  # a lost peer ends this world, not the process
            model, optimizer = build(world.config)   # everything that depends on the layout, built per world
            job.restore(model, optimizer)
            while job.step < total_steps and world.active:
                train_step(model, optimizer, job.batch())
                job.step_done()
    job.finish()

Without ``--in-place`` (torchrun restarts the workers) :meth:`Job.worlds` yields
one world and a change ends the process as in the script form. With it
(``TENPLEX_IN_PLACE=1``, set by ``tenplex run --in-place``, and the rendezvous
store's address in ``TENPLEX_RDZV_ENDPOINT``), a change ends the world at a step
boundary instead: the ranks save, leave the group, form the next generation's
(:mod:`tenplex.elastic.reform`) and the loop's body runs again with the new
rank, world size and configuration. ``with world`` turns an error that a lost
peer raised in the user's code (gloo's "Connection reset by peer" in
``backward()``) into the end of the world; any other error propagates (a
crash: the agent restarts the process). A script that does not loop (the
script form) under ``--in-place`` exits at a change as before, and its agent
starts it again as a warm joiner.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

from ..errors import ConfigError
from . import faults, leftovers
from .protocol import Event, Generation, State
from .reform import Membership

log = logging.getLogger(__name__)
job_log = logging.getLogger("tenplex.elastic.job")  # a Job's own records keep its logger's name

IN_PLACE_ENV = "TENPLEX_IN_PLACE"
ENDPOINT_ENV = "TENPLEX_RDZV_ENDPOINT"
JOB_ENV = "TENPLEX_RDZV_ID"
MIN_WORKERS_ENV = "TENPLEX_MIN_WORKERS"
MAX_WORKERS_ENV = "TENPLEX_MAX_WORKERS"
LAST_CALL_ENV = "TENPLEX_LAST_CALL"
DEAD_AFTER_ENV = "TENPLEX_DEAD_AFTER"


def membership_from_environment(timeout: float, backend: str) -> Membership | None:
    """This worker's :class:`Membership` when ``tenplex run --in-place`` started it, else None."""
    if os.environ.get(IN_PLACE_ENV, "") in ("", "0"):
        return None
    endpoint = os.environ.get(ENDPOINT_ENV)
    if not endpoint:
        raise ConfigError(f"{IN_PLACE_ENV} is set but {ENDPOINT_ENV} is not: in-place worlds form on the "
                          f"rendezvous store (tenplex run --in-place --rdzv-endpoint HOST:PORT sets both)")
    # The job's key-value store (snapshot commits: tenplex.integration.jobstore) is the rendezvous store too:
    # torchrun's own store (MASTER_ADDR) is only this node's in place.
    host, _, port = endpoint.rpartition(":")
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=port)
    return Membership(endpoint, os.environ.get(JOB_ENV, "default"), os.environ.get("TENPLEX_HOST", "h0"),
                      int(os.environ.get("LOCAL_RANK", "0")), min_workers=int(os.environ.get(MIN_WORKERS_ENV, "1")),
                      timeout=timeout, dead_after=float(os.environ.get(DEAD_AFTER_ENV, "2.0")), backend=backend,
                      last_call=float(os.environ.get(LAST_CALL_ENV, "0")),
                      max_workers=int(os.environ[MAX_WORKERS_ENV]) if os.environ.get(MAX_WORKERS_ENV) else None)


@dataclass
class World:
    """One world of the job: its generation (0 without ``--in-place``), this rank, the size, the configuration.

    ``active`` turns False when the world ends at a step boundary (a change was agreed) or a peer was lost;
    ``ended`` says why (``change``, ``lost``). ``pause`` holds the parts of the pause that led into this world:
    ``re_form_s`` (leaving the old group to the new one formed), ``restore_s`` and ``first_step_s`` as they
    happen, and ``pause_s`` (the old world's last step boundary to this world's first one).
    """

    generation: int
    rank: int
    world_size: int
    config: object
    reasons: tuple[str, ...] = ()
    active: bool = True
    ended: str | None = None
    pause: dict = field(default_factory=dict)
    on_device_fault: Callable[[], None] | None = None  # in place: tell the others at once that this worker leaves

    def end(self, why: str) -> None:
        self.active, self.ended = False, why

    def __enter__(self) -> "World":
        return self

    def __exit__(self, kind, error, tb) -> bool:
        """Swallow an error a lost peer raised in the user's code while in place: the world is over, not the
        process. Device faults and crashes propagate (the agent excludes the device, or restarts the worker)."""
        if error is None or not isinstance(error, Exception) or self.generation == 0:
            return False
        kind = faults.classify(error)
        if kind == faults.DEVICE and self.on_device_fault is not None:
            self.on_device_fault()  # the process ends (its agent drops the device); the others go on without it
        if kind != faults.PEER:
            return False
        log.warning("world %d: a peer is gone (%s: %s); on to the next world", self.generation,
                    type(error).__name__, error)
        self.end("lost")
        return True


def generation_world(generation: Generation | None, rank: int, world_size: int, config) -> World:
    return World(generation.number if generation else 0, rank, world_size, config,
                 generation.reasons if generation else ())


class InPlaceWorlds:
    """The worlds of a :class:`~tenplex.elastic.job.Job` in one process (``tenplex run --in-place``): the loop
    over them, a world's end at a step boundary, the next generation's world, and each change's pause. The job
    provides the attributes declared below and ``_enter_world`` (this rank's place in a world that just formed)."""

    if TYPE_CHECKING:
        world: World
        _membership: Membership | None
        _tracked: dict[str, Any] | None
        group: Any
        _data: Any
        _cost: dict[str, Any]
        _save_s: float
        _step_s: float
        restored: Any
        metrics: Any
        _terminated_at: float | None
        step: int
        world_size: int

        @property
        def idle(self) -> bool: ...

        def _enter_world(self, generation: Generation | None) -> None: ...

        def wait_idle(self) -> None: ...

        def _idle_through_world(self) -> None: ...

        def _tell_idle(self, word: str) -> None: ...

    def _init_worlds(self) -> None:
        """What the worlds carry from one to the next: whether the script loops, the changes' records."""
        self._looping = False         # the script iterates job.worlds()
        self._kept: Any = None        # the old world's model and optimizer, kept for the next restore (in place)
        self._last_saved: tuple[int, tuple] | None = None  # in place: (version, counters) of the last save
        self.reconfigurations: list[dict] = []  # one per world change in place: its pause and parts
        self._step_finished_at = self._world_ended_at = time.monotonic()  # the pause's parts start here

    @property
    def _in_place(self) -> bool:
        """Whether a change ends only the world (``tenplex run --in-place`` and a script that loops over
        :meth:`worlds`), not the process."""
        return self._membership is not None and self._looping

    def worlds(self) -> Iterator[World]:
        """The worlds this process trains in (see :mod:`tenplex.elastic.worlds`): one without ``--in-place``;
        with it, a new one after every change, until the loop's body ends with its world still active. A world
        in which the policy leaves this rank idle is not yielded: the rank waits through it here
        (:meth:`~tenplex.elastic.idle.IdleRanks.wait_idle` without ``--in-place``, which exits)."""
        self._looping = True
        while True:
            if self.idle:  # the policy leaves this rank idle: the loop's body never sees such a world
                if not self._in_place:
                    self.wait_idle()  # exits when the training ranks finish or stop (the script form's way)
                self._idle_through_world()  # returns once the world ended; exits when the job finished
                self._next_world()
                continue
            world = self.world
            if self._membership is not None:
                world.on_device_fault = self._membership.mark_leaving
            yield world
            if world.active or self._membership is None:
                return
            self._next_world()

    @property
    def change_pending(self) -> bool:
        """Whether this world will end at the next step boundary as far as this rank knows (SIGTERM, or in place
        a join, leave or loss the membership saw): a script that waits between steps should go on to it."""
        return self._terminated_at is not None or bool(self._in_place and self._membership.wanted)  # type: ignore

    def _end_world(self, why: str) -> None:
        job_log.info("world %d ends at step %d: %s", self.world.generation, self.step, why)
        self.world.end(why)
        self._tell_idle("change")  # a training rank, in a world with idle ranks: they go on to the next world too
        self._membership.protocol.on(Event.CHANGE_AGREED if why == "change" else Event.PEER_LOST)  # type: ignore
        self._world_ended_at = time.monotonic()  # after the stopping save of a change

    def _next_world(self) -> None:
        """Leave the world that ended (its group, its checkpointer) and enter the next generation's."""
        m, old = self._membership, self.world
        assert m is not None
        if m.protocol.state == State.TRAINING:  # World.__exit__ ended it: a lost peer raised in the user's code
            self._end_world("lost")
        begin = time.monotonic()
        self._keep_if_unchanged()  # the stopping save's values after a change; maybe the last save's after a loss
        if self._tracked is not None:  # a change settled its snapshot in the stopping save; a loss drops it
            self._tracked["checkpointer"].group = None
            self._tracked["checkpointer"].close()
            self._tracked = None
        self.group, self._data = None, None  # freeing the group joins its gloo threads: drop every reference
        # The save schedule follows from numbers every rank must share; a joiner has no history: start afresh.
        self._cost = {"saves": 0, "save_s": 0.0, "steps": 0, "train_s": 0.0}
        self._save_s = self._step_s = 0.0
        leftovers.forget_world()  # DTensor's caches would hand the old meshes' shapes to the new ones
        groups = leftovers.watch_groups()
        m.leave_group()
        pinned = leftovers.report_pinned(groups, old.generation)  # the user's code still holds some: warn, count
        generation = m.join()
        self._enter_world(generation)
        self.world.pause = {"reasons": list(generation.reasons), "ended": old.ended, "pid": os.getpid(),
                            "agree_s": self._world_ended_at - self._step_finished_at,
                            "re_form_s": time.monotonic() - begin, "since": self._step_finished_at,
                            "lost_by": {str(w): how for w, how in generation.lost_by},  # closed / heartbeat
                            "pinned_groups": pinned}

    def _first_step_done(self) -> None:
        """The first step of a world entered in place finished: its pause is over (old world's end to now)."""
        p, done = self.world.pause, time.monotonic()
        p["restore_s"] = self.restored.seconds if self.restored is not None else 0.0
        # This rank's restored bytes by where they came from: its own memory (what it kept of the old world's
        # tensors), this host's store, other hosts' stores; planned: whether the change needed a plan.
        restored = self.restored
        p["bytes"] = dict(restored.bytes if restored is not None else {"memory": 0, "this_host": 0, "other_hosts": 0},
                          planned=bool(restored is not None and restored.plan_stats))
        p["pause_s"] = done - p.pop("since")  # the old world's last step finished -> this world's first one
        p["first_step_s"] = max(0.0, p["pause_s"] - p["agree_s"] - p["re_form_s"] - p["restore_s"])
        p.update(generation=self.world.generation, step=self.step, world_size=self.world_size)
        self.reconfigurations.append(dict(p))
        self.metrics.observe_reconfiguration("+".join(p["reasons"]), "in_place", p["pause_s"])
        job_log.info("world %d in place after %s: pause %.2f s (re-form %.2f, restore %.2f)", self.world.generation,
                     "+".join(p["reasons"]) or "a re-formation", p["pause_s"], p["re_form_s"], p["restore_s"])

    def _remember_save(self, version: int | None) -> None:
        """In place: the version this rank's tensors hold right now (it just saved, staged or restored it; None:
        none) and their in-place version counters, so that a world lost later can tell whether its tensors still
        hold that version (about 0.3 ms for 800 tensors; not done outside in place, where nothing is kept)."""
        if self._membership is not None and self._tracked is not None:
            from ..integration.memory import state_counters

            self._last_saved = None if version is None else (
                version, state_counters(self._tracked["model"], self._tracked["optimizer"]))

    def _keep_if_unchanged(self) -> None:
        """Keep the old world's model and optimizer for the next restore (:mod:`tenplex.integration.memory`) when
        nothing changed them since the last save: always after a change (its stopping save), after a lost peer
        when it died before this rank's next optimizer step. The restore takes from them only if that save is
        the version it restores (committed everywhere)."""
        from ..integration.memory import Kept, state_counters

        t, saved = self._tracked, self._last_saved
        if t is not None and saved is not None and state_counters(t["model"], t["optimizer"]) == saved[1]:
            self._kept = Kept.capture(t["model"], t["optimizer"], t["annotations"], saved[0], saved[1])

    def _change_in_place(self, leaving: bool) -> bool:
        """After the stopping save: whether only this world ends and the process goes on in the next one (in
        place, for every rank that is not leaving)."""
        if not self._in_place or leaving:
            return False
        if self.world.active:  # a change in place: every rank saved this step and goes on in the next world
            self._end_world("change")
        # else a peer died during the save: the world is lost already
        return True
