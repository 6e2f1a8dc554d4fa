"""Elastic jobs on torchrun: the parallel-configuration policy, the training-loop API and ``tenplex run``.

May import: every tenplex layer below the command line (``parallel``, ``errors``,
``integration``, ``dataset``, ``store``, ``runtime``), torch and the standard
library. ``tenplex.elastic.policy`` is pure: it imports only ``tenplex.parallel``,
``tenplex.devices`` and ``tenplex.errors``, so that the Kubernetes operator can
use it without torch; this package therefore loads :class:`Job` (torch) only
when it is first used.

Modules: :mod:`.policy` (which configuration a world trains with), :mod:`.job` (the training-loop API, with
:mod:`.worlds`, :mod:`.batches`, :mod:`.idle` and :mod:`.saves`), :mod:`.launcher` (``tenplex run``; in place
without torchrun: :mod:`.light_launch` and :mod:`.supervisor`), :mod:`.entry` (how each worker starts),
:mod:`.faults` (device fault, lost peer or crash), :mod:`.devices` (a node's devices and
their health), :mod:`.restarts` (the agent's restart accounting), :mod:`.rendezvous` (``tenplex rendezvous serve``),
:mod:`.gpt_train` (the example training script that ``tenplex demo --elastic`` runs).
"""

from .policy import Choice, choose

__all__ = ["Choice", "choose", "Job", "Batch", "auto_interval"]


def __getattr__(name: str):
    if name in ("Job", "Batch", "auto_interval"):
        from . import job

        return getattr(job, name)
    raise AttributeError(f"module 'tenplex.elastic' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
