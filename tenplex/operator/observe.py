"""Raw Kubernetes Nodes and Pods reduced to what a decision needs.

May import: the package constants and the standard library. Pure: these take
the JSON objects the API server returns (dicts) and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from . import JOB_LABEL, NODE_ANNOTATION, STORE_NODE_LABELS


@dataclass(frozen=True)
class Taint:
    key: str
    value: str = ""
    effect: str = "NoSchedule"  # NoSchedule, PreferNoSchedule or NoExecute


@dataclass(frozen=True)
class NodeState:
    name: str
    ready: bool
    schedulable: bool  # false when cordoned (spec.unschedulable)
    allocatable: int  # of the accelerator resource, e.g. nvidia.com/gpu
    store: bool = True  # labelled for the store DaemonSet (and its FUSE view): a worker needs both
    taints: tuple[Taint, ...] = ()


@dataclass(frozen=True)
class PodState:
    name: str
    uid: str
    node: str | None  # the node the operator placed it on (or, failing that, where it was scheduled)
    phase: str  # Pending, Running, Succeeded, Failed, Unknown
    terminating: bool = False  # deletionTimestamp set: on its way out
    crash_looping: bool = False  # a container waits in CrashLoopBackOff (restartPolicy OnFailure/Always)
    unschedulable_since: str | None = None  # PodScheduled=False, reason Unschedulable: since when
    unschedulable_message: str = ""  # the scheduler's reason, e.g. "0/3 nodes are available: ..."
    gpus: int | None = None  # units of the accelerator resource it requests (None: not read, never resized)

    @property
    def failed(self) -> bool:
        return self.phase == "Failed" or self.crash_looping


def quantity(value: Any) -> int:
    """A whole-unit Kubernetes quantity (``"8"``, ``8``, ``"4000m"``) as an integer; fractions round down."""
    if value is None:
        return 0
    text = str(value)
    if text.endswith("m"):
        return int(text[:-1]) // 1000
    suffixes = {"k": 10**3, "M": 10**6, "G": 10**9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    for suffix, factor in suffixes.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(float(text))


def node_state(node: Mapping[str, Any], resource: str,
               store_labels: Mapping[str, str] = STORE_NODE_LABELS) -> NodeState:
    status = node.get("status") or {}
    spec = node.get("spec") or {}
    labels = (node.get("metadata") or {}).get("labels") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    taints = tuple(Taint(t.get("key", ""), t.get("value") or "", t.get("effect") or "NoSchedule")
                   for t in spec.get("taints") or [])
    return NodeState(name=node["metadata"]["name"], ready=ready, schedulable=not spec.get("unschedulable", False),
                     allocatable=quantity((status.get("allocatable") or {}).get(resource)),
                     store=all(labels.get(k) == v for k, v in store_labels.items()), taints=taints)


def tolerates(tolerations: Iterable[Mapping[str, Any]], taint: Taint) -> bool:
    """Whether a pod with ``tolerations`` tolerates ``taint``, by the scheduler's matching rules."""
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.effect:
            continue
        if not t.get("key"):  # an empty key with operator Exists tolerates every taint
            if t.get("operator") == "Exists":
                return True
            continue
        if t["key"] != taint.key:
            continue
        if t.get("operator") == "Exists" or (t.get("value") or "") == taint.value:
            return True
    return False


def blocking_taints(node: NodeState, tolerations: Iterable[Mapping[str, Any]]) -> list[Taint]:
    """The node's taints that keep a pod with ``tolerations`` off it (PreferNoSchedule only steers)."""
    tolerations = list(tolerations)
    return [t for t in node.taints if t.effect != "PreferNoSchedule" and not tolerates(tolerations, t)]


def pod_state(pod: Mapping[str, Any], resource: str | None = None) -> PodState:
    """The pod as a decision sees it; with ``resource``, how many units of it the pod requests."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    node = (meta.get("annotations") or {}).get(NODE_ANNOTATION) or (pod.get("spec") or {}).get("nodeName")
    crash = any((cs.get("state") or {}).get("waiting", {}).get("reason") == "CrashLoopBackOff"
                for cs in status.get("containerStatuses") or [])
    unschedulable = next((c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"
                          and c.get("status") == "False" and c.get("reason") == "Unschedulable"), None)
    return PodState(name=meta["name"], uid=meta.get("uid", ""), node=node, phase=status.get("phase") or "Pending",
                    terminating=bool(meta.get("deletionTimestamp")), crash_looping=crash,
                    unschedulable_since=None if unschedulable is None else
                    unschedulable.get("lastTransitionTime") or meta.get("creationTimestamp") or "",
                    unschedulable_message=(unschedulable or {}).get("message") or "",
                    gpus=None if resource is None else _requested(pod, resource))


def pod_requests(pod: Mapping[str, Any], resource: str) -> int:
    """How many units of ``resource`` a pod holds on its node (0 once it has finished)."""
    if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return 0
    return _requested(pod, resource)


def _requested(pod: Mapping[str, Any], resource: str) -> int:
    """The units of ``resource`` a pod's containers request (a limit alone counts as the request, as in the API)."""
    spec = pod.get("spec") or {}
    total = 0
    for c in spec.get("containers") or []:
        res = c.get("resources") or {}
        total += quantity((res.get("requests") or {}).get(resource, (res.get("limits") or {}).get(resource)))
    return total


def gpu_claim(pod: Mapping[str, Any], resource: str) -> tuple[str, tuple[str | None, str | None], int] | None:
    """``(node, (namespace, job), units)`` of ``resource`` a pod holds on a node (job None: not a tenplex worker)."""
    meta = pod.get("metadata") or {}
    # A pod another operator placed but the scheduler has not bound yet already claims its node.
    node = (pod.get("spec") or {}).get("nodeName") or (meta.get("annotations") or {}).get(NODE_ANNOTATION)
    units = pod_requests(pod, resource)
    if not node or not units:
        return None
    return node, (meta.get("namespace"), (meta.get("labels") or {}).get(JOB_LABEL)), units


def used_by_others(claims: Iterable[tuple[str, tuple, int]], job: tuple[str, str]) -> dict[str, int]:
    """Units per node held by pods that are not workers of ``job`` = (namespace, name), from :func:`gpu_claim`."""
    used: dict[str, int] = {}
    for node, holder, units in claims:
        if holder != job:
            used[node] = used.get(node, 0) + units
    return used
