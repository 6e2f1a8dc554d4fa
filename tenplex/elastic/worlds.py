"""Worlds in place: a :class:`~tenplex.elastic.job.Job` that lives through several worlds in one process.

May import: ``tenplex.elastic`` (protocol, reform, faults), ``tenplex.errors``, torch.distributed and the standard
library.

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
from dataclasses import dataclass, field

from ..errors import ConfigError
from . import faults
from .protocol import Generation
from .reform import Membership

log = logging.getLogger(__name__)

IN_PLACE_ENV = "TENPLEX_IN_PLACE"
ENDPOINT_ENV = "TENPLEX_RDZV_ENDPOINT"
JOB_ENV = "TENPLEX_RDZV_ID"
MIN_WORKERS_ENV = "TENPLEX_MIN_WORKERS"
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
                      timeout=timeout, dead_after=float(os.environ.get(DEAD_AFTER_ENV, "2.0")), backend=backend)


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

    def end(self, why: str) -> None:
        self.active, self.ended = False, why

    def __enter__(self) -> "World":
        return self

    def __exit__(self, kind, error, tb) -> bool:
        """Swallow an error a lost peer raised in the user's code while in place: the world is over, not the
        process. Device faults and crashes propagate (the agent excludes the device, or restarts the worker)."""
        if error is None or not isinstance(error, Exception) or self.generation == 0:
            return False
        if faults.classify(error) != faults.PEER:
            return False
        log.warning("world %d: a peer is gone (%s: %s); on to the next world", self.generation,
                    type(error).__name__, error)
        self.end("lost")
        return True


def generation_world(generation: Generation | None, rank: int, world_size: int, config) -> World:
    return World(generation.number if generation else 0, rank, world_size, config,
                 generation.reasons if generation else ())

