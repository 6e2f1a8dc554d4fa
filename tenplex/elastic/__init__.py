"""Elastic jobs on torchrun: the parallel-configuration policy, the training-loop API and ``tenplex run``.

May import: every tenplex layer below the command line (``parallel``, ``errors``,
``integration``, ``dataset``, ``store``, ``runtime``), torch and the standard
library. ``tenplex.elastic.policy`` is pure: it imports only ``tenplex.parallel``,
``tenplex.devices`` and ``tenplex.errors``, so that the Kubernetes operator can
use it without torch; this package therefore imports nothing eagerly.
"""

from .policy import Choice, choose

__all__ = ["Choice", "choose"]
