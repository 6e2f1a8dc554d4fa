"""Join and leave a torch.distributed process group so that the process can always exit cleanly.

May import: torch, torch.distributed and the standard library.

A gloo worker thread releases each collective's tensors after the collective
completes. If that happens while the interpreter finalizes (the rank exits
right after its last collective), the thread needs the GIL, cannot get it,
and aborts the whole process: "terminate called without an active
exception", exit status -6, after everything was saved (pytorch issue
190489). The threads are joined when the group is freed, so a clean exit
frees every group before the interpreter finalizes. Two things stand in the
way, and these functions deal with both:

* some torch functions take ``dist.group.WORLD`` as a default argument, so a
  module imported after ``init_process_group`` keeps the default group alive
  for good (torch.distributed.fsdp, pulled in by torch._dynamo, which the
  first optimizer imports): :func:`init_process_group` imports them first;
* references held by the caller: :func:`leave_process_group` destroys the
  groups and collects garbage once the caller has dropped its own.
"""

from __future__ import annotations

import gc
from datetime import timedelta

import torch.distributed as dist


def import_world_capturing_modules() -> None:
    """Import the torch modules that would capture the default group if imported after it exists."""
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401


def init_process_group(backend: str = "gloo", *, timeout: float | None = None, **kwargs) -> None:
    """``dist.init_process_group`` after :func:`import_world_capturing_modules`; ``timeout`` in seconds."""
    import_world_capturing_modules()
    if timeout is not None:
        kwargs["timeout"] = timedelta(seconds=timeout)
    dist.init_process_group(backend, **kwargs)


def leave_process_group(group=None, *, together: bool = True) -> None:
    """Leave together (a barrier over ``group``, unless ``together`` is False), destroy every group, and free them.

    Call it as the last collective step of a rank, after dropping your own
    references to subgroups: freeing a group joins its gloo threads.
    """
    if together:
        dist.barrier(group=group)
    dist.destroy_process_group()
    del group
    gc.collect()
