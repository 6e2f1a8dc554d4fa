"""What a decision asks for: pods to create and delete, the status patch, the Events; and the merge patches.

May import: :mod:`.observe` and the standard library. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from .observe import PodState


@dataclass(frozen=True)
class Deletion:
    pod: str
    grace_seconds: int
    reason: str
    uid: str = field(default="", compare=False)  # names the WorkerDeleted event (one per pod)


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: str
    message: str
    key: str = ""  # what it reports, e.g. "RescaleStarted/<startedAt>": the same key is the same event


@dataclass(frozen=True)
class Decision:
    phase: str
    target: tuple[str, ...]  # nodes that should run a worker
    create: tuple[str, ...]  # nodes to create a worker on now
    delete: tuple[Deletion, ...]
    status: dict  # the TenplexJob's new status (a merge patch: None removes a key)
    events: tuple[Event, ...]
    gpus: Mapping[str, int] = field(default_factory=dict)  # units of the resource per target node


def merge_patch(old: Any, patch: Any) -> Any:
    """``patch`` applied to ``old`` as a JSON merge patch (RFC 7386), as the API server applies a status patch."""
    if not isinstance(patch, Mapping):
        return patch
    out = dict(old) if isinstance(old, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def replacing(old: Any, new: Any) -> Any:
    """The merge patch that turns ``old`` into ``new``: keys that ``new`` lacks are removed (a plain merge patch
    would keep a node that left in ``nodeGpus``)."""
    if not isinstance(new, Mapping) or not isinstance(old, Mapping):
        return new
    patch: dict = {key: None for key in old if key not in new}
    patch.update({key: replacing(old.get(key), value) for key, value in new.items()})
    return patch


def worker_created(pod: PodState) -> Event:
    """The WorkerCreated event of a worker pod (one per pod uid)."""
    return Event("Normal", "WorkerCreated", f"{pod.name} on node {pod.node}", key=f"WorkerCreated/{pod.uid}")


def observed_events(pods: Sequence[PodState]) -> tuple[Event, ...]:
    """The events the observed workers stand for: a worker that exists was created (posted once, by its key)."""
    return tuple(worker_created(p) for p in pods if not p.terminating)
