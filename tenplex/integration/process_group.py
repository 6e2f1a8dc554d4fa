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
import time
from datetime import timedelta
from pathlib import Path

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


def leave_process_group(*, together: bool = True) -> None:
    """Leave together (a barrier over the default group, unless ``together`` is False: a caller whose ranks
    leave in a subgroup barriers there itself), destroy every group, and free them.

    Call it as the last collective step of a rank, after dropping your own
    references to subgroups: freeing a group joins its gloo threads.
    """
    if together:
        dist.barrier()
    dist.destroy_process_group()
    _wait_for_idle_gloo_threads()
    gc.collect()


def _wait_for_idle_gloo_threads(timeout: float = 5.0) -> None:
    """Wait, without the GIL, until every gloo worker thread is asleep (parked waiting for work).

    A worker thread releases a finished collective's tensors under the group's
    lock and needs the GIL to do it. A group freed by the garbage collector
    from an object that holds it without releasing the GIL (a DDP ``Reducer``)
    waits for that lock while holding the GIL: a deadlock, seen here as a hung
    rank. Sleeping lets such a thread finish; a thread seen asleep twice in a
    row, 10 ms apart, while this thread held no GIL, is parked.
    """
    deadline = time.monotonic() + timeout
    asleep_before: set[str] = set()
    while time.monotonic() < deadline:
        time.sleep(0.01)
        states = _gloo_thread_states()
        asleep = {tid for tid, state in states.items() if state == "S"}
        if asleep == set(states) and asleep == asleep_before:
            return
        asleep_before = asleep


def _gloo_thread_states() -> dict[str, str]:
    """Thread id -> scheduler state (R, S, D, …) of this process's gloo worker threads (Linux /proc)."""
    states = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().strip() == "pt_gloo_runloop":
                # "pid (comm) state ...": the state follows the last ")" (a name may hold spaces)
                states[task.name] = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # the thread ended meanwhile
            continue
    return states
