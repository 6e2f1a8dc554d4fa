"""Replicated state: copies of each saved version's host-unique regions on other hosts, and recovery from them.

May import: ``tenplex.store``, ``tenplex.layout``, ``tenplex.box``, ``tenplex.devices``,
``tenplex.errors`` and the standard library; never torch or ``tenplex.integration``
(the checkpointer above uses this package). ``plan`` is pure.

Modules: :mod:`.plan` (which regions are copied where; what a set of available
hosts can assemble; :class:`LostStateError`), :mod:`.copier` (the on-disk
format of copies and the background :class:`~.copier.Replicator`),
:mod:`.promote` (a version made of surviving shards and copies, by hard
links), :mod:`.stores` (the store addresses recorded with every save).
Importing this package loads neither grpc nor the store client.

POSIX: the copies are stores nested in the host's store directory, and
``promote`` hard-links them; ``copier`` and ``promote`` say where.
"""

from .plan import Assembly, Copy, Lost, LostStateError, assemble, copies, effective_replicas

__all__ = ["Assembly", "Copy", "Lost", "LostStateError", "assemble", "copies", "effective_replicas"]
