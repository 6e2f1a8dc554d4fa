"""The reconciliation step as a pure function: observed state in, desired state out.

May import: :mod:`.spec`, :mod:`.observe`, :mod:`.outcome`, ``tenplex.errors`` and the standard library. Pure: no
clock (``now`` is an argument), no I/O, so it is tested as a function and an
operator restarted at any point decides the same thing again from what it
observes (level-based: the previous ``status`` only carries what cannot be
observed, the last world that ran, the open rescale and the failures so far).

The rules (docs/guides/operator.md):

* A node qualifies when it runs a store (labelled for the store DaemonSet),
  is Ready, not cordoned and has no NoSchedule taint the worker does not
  tolerate (unless it already runs this job's worker; an untolerated
  NoExecute taint always disqualifies), has fewer than
  :data:`NODE_FAILURE_LIMIT` failed workers, was not left out because a
  worker stayed Unschedulable there, and has at least ``minGpusPerNode``
  (default ``gpusPerNode``) free units of the accelerator resource (free:
  allocatable minus what other pods request; our own worker's units count as
  free). The node gets ``min(gpusPerNode, free)``. The target is the most
  qualifying nodes up to ``maxNodes``, nodes that run a worker (or replace one) first,
  then those with more free units, then by name: the job never moves a worker to
  get the same size.
* A rescale never recreates a surviving worker's pod: a pod carries nothing
  that changes with the world, so only joining pods are created and only
  leaving ones deleted.
* A worker on a node that lost units (the device plugin took an unhealthy GPU
  out of the node's allocatable) stays while the node qualifies: its ``tenplex
  run`` drops the failed device itself; ``status.resizedInPlace`` records the
  units it runs on (a ``Resize``, events ``ResizeStarted`` and ``Resized``).
  A worker with fewer units than its node's (a GPU came back, ``gpusPerNode``
  grew) is deleted with the grace period and recreated with the node's count
  (a pod's request cannot grow): a ``Resize`` (phase ``Resizing``) when no
  node joins, leaves or fails with it.
* Fewer than ``minNodes`` qualify: phase ``Pending``, condition
  ``NodesAvailable=False`` saying what is missing; running workers stay
  (their agents wait in the rendezvous), no worker is added.
* A worker on a node that is gone or NotReady is lost: force-deleted (a
  graceful delete never completes without a kubelet). A failed or
  crash-looping worker is deleted and replaced once its pod is gone (same
  name) if its node still qualifies. Failures count per pod uid;
  more than ``backoffLimit`` in all is phase ``Failed``.
* Scale-down deletes workers with the spec's grace period, so that they save
  at a step boundary on SIGTERM.
* A worker that stays Pending with ``Unschedulable`` longer than
  ``unschedulable_grace`` seconds is deleted and its node left out until the
  spec changes (``status.unschedulable``, condition ``WorkersScheduled``).
* A change of the world opens ``status.lastRescale`` (type Rescale or
  Recovery); it finishes when every target node runs a worker and no other
  does. A restarted operator that finds the same target keeps the record
  (and its ``startedAt``) instead of starting a new one. A record whose
  target moves on is dropped: when the job is back at the world that ran,
  the record is closed with ``abandoned`` saying why.
* Every event has a ``key`` that names what it reports (a record's start, a
  condition's transition): posting is idempotent, so events are decided
  again from the observed state and an operator that died before posting
  them posts them on its next round.
"""

from __future__ import annotations

import datetime
from typing import Any, Mapping, Sequence

from .observe import NodeState, PodState, blocking_taints
from .outcome import Decision, Deletion, Event, replacing
from . import STORE_NODE_LABELS
from ..errors import ConfigError
from .spec import JobSpec, SpecError

# Status fields that a decision writes whole (node-keyed maps inside): their patch removes what is gone.
REPLACED = {"nodeGpus", "lastRescale", "resizedInPlace"}
NODE_FAILURE_LIMIT = 3  # a node whose workers failed this often is left out (a bad GPU, a full disk)


def decide(spec: JobSpec | SpecError, nodes: Sequence[NodeState], pods: Sequence[PodState], *,
           used_by_others: Mapping[str, int], status: Mapping[str, Any] | None, generation: int | None,
           now: str, resource: str, unschedulable_grace: int = 60) -> Decision:
    """The desired state of one TenplexJob (see the module docstring for the rules)."""
    return _Decider(spec, nodes, pods, used_by_others, dict(status or {}), generation, now, resource,
                    unschedulable_grace).run()


def _record_id(record: Mapping[str, Any]) -> str:
    """A rescale record's name in its events' keys: its type, start and worlds. Times are whole seconds, so a
    record that opens and closes at once (a resize in place) may start in the second another one started."""
    def world(part: str) -> str:
        return ",".join(f"{n}={g}" for n, g in sorted(((record.get(part) or {}).get("nodeGpus") or {}).items()))
    return f"{record['type']}/{record['startedAt']}/{world('from')}/{world('to')}"


def _seconds_between(start: str, end: str) -> float:
    """Seconds from ``start`` to ``end``, both RFC 3339 times as the API server writes them."""
    def parse(t: str) -> datetime.datetime:
        return datetime.datetime.fromisoformat(t.replace("Z", "+00:00"))
    return (parse(end) - parse(start)).total_seconds()


class _Decider:
    def __init__(self, spec, nodes, pods, used, status, generation, now, resource, unschedulable_grace):
        self.spec, self.pods, self.used, self.old = spec, sorted(pods, key=lambda p: p.name), used, status
        self.nodes = {n.name: n for n in nodes}
        self.generation, self.now, self.resource = generation, now, resource
        self.unschedulable_grace = unschedulable_grace
        # node -> why a worker could not be scheduled there; kept until the spec changes (a new generation)
        same_spec = status.get("observedGeneration") == generation
        self.unschedulable: dict[str, str] = dict(status.get("unschedulable") or {}) if same_spec else {}
        self.events: list[Event] = []
        self.conditions: list[dict] = []
        self.gpus: dict[str, int] = {}  # qualifying node -> the units of the resource its worker gets

    # -- helpers -----------------------------------------------------------------------------------------------
    def condition(self, type_: str, ok: bool, reason: str, message: str) -> None:
        old: dict = next((c for c in self.old.get("conditions") or [] if c.get("type") == type_), {})
        value = "True" if ok else "False"
        since = old.get("lastTransitionTime") if old.get("status") == value else None
        self.conditions.append({"type": type_, "status": value, "reason": reason, "message": message,
                                "lastTransitionTime": since or self.now})

    def emit(self, event: Event) -> None:
        if all(e.key != event.key for e in self.events):
            self.events.append(event)

    def condition_event(self, type_: str, reason: str, message: str) -> None:
        """The event of the condition just set to False: keyed by its transition, so posted once per transition."""
        since = next(c["lastTransitionTime"] for c in self.conditions if c["reason"] == reason)
        self.events.append(Event(type_, reason, message, key=f"{reason}/{since}"))

    def world(self, names: Sequence[str]) -> dict:
        counts = [self.gpus[n] for n in names]
        return {"nodes": len(names), "nodeNames": list(names), "nodeGpus": dict(zip(names, counts)),
                "worldSize": sum(counts), "parallel": self.spec.parallel(counts)}

    def finish(self, phase: str, target=(), create=(), delete=(), **status) -> Decision:
        for type_ in ("SpecValid", "NodesAvailable", "WorkersHealthy", "WorkersScheduled"):
            if not any(c["type"] == type_ for c in self.conditions):
                self.condition(type_, True, "OK", "")
        self.condition("Ready", phase == "Running", phase, f"the job is {phase}")
        for key in REPLACED & set(status):
            status[key] = replacing(self.old.get(key), status[key])
        out = {"phase": phase, "observedGeneration": self.generation, "conditions": self.conditions,
               "unschedulable": self.unschedulable or None, **status}
        return Decision(phase, tuple(target), tuple(create), tuple(delete), out, tuple(self.events),
                        {n: self.gpus[n] for n in target})

    # -- the decision --------------------------------------------------------------------------------------------
    def run(self) -> Decision:
        spec = self.spec
        if isinstance(spec, SpecError):
            self.condition("SpecValid", False, "InvalidSpec", str(spec))
            self.condition_event("Warning", "InvalidSpec", str(spec))
            return self.finish("Failed")
        # A worker deleted on scale-down may exit 0 too (a planned leave): only the others mean the script finished.
        finished = [p.name for p in self.pods if p.phase == "Succeeded" and not p.terminating]
        if self.old.get("phase") == "Succeeded" or finished:
            if self.old.get("phase") != "Succeeded":
                done = finished[0] if finished else "a worker"
                self.events.append(Event("Normal", "Succeeded", f"the training script finished ({done} succeeded)",
                                         key="Succeeded"))
            return self.finish("Succeeded")

        deletions, failures, lost, failed, active, busy = self.classify()
        if sum(len(v) for v in failures.values()) > spec.backoff_limit:
            n = sum(len(v) for v in failures.values())
            message = (f"{n} workers failed, more than backoffLimit={spec.backoff_limit}; "
                       f"see the pods' logs, then raise spec.backoffLimit to retry")
            self.condition("WorkersHealthy", False, "BackoffLimitExceeded", message)
            self.condition_event("Warning", "BackoffLimitExceeded", message)
            deletions += [Deletion(p.name, spec.grace_seconds, "the job failed") for p in active.values()]
            return self.finish("Failed", delete=deletions, failures=failures)

        self.report_unschedulable()
        eligible, why_not = self.qualify(failures, active)
        # Nodes that hold our worker come first (also while it is being replaced): a worker never moves for less.
        order = sorted(eligible, key=lambda name: (name not in active and name not in busy, -self.gpus[name], name))
        target = tuple(sorted(order[: spec.max_nodes]))
        for name in order[spec.max_nodes:]:
            why_not[name] = f"maxNodes={spec.max_nodes}"

        if len(target) < spec.min_nodes:
            message = (f"needs minNodes={spec.min_nodes} nodes with {spec.min_gpus_per_node} free {self.resource} "
                       f"each; {len(target)} qualify" + (f" ({', '.join(target)})" if target else "")
                       + "".join(f"; {n}: {why}" for n, why in sorted(why_not.items())))
            self.condition("NodesAvailable", False, "InsufficientNodes", message)
            self.condition_event("Warning", "InsufficientNodes", message)
            return self.finish("Pending", target, (), deletions, failures=failures)
        try:
            self.world(target)
        except ConfigError as e:  # a pin that does not fit nodes of uneven sizes (parse_spec checks even ones)
            gpus = ", ".join(f"{n}: {self.gpus[n]}" for n in target)
            message = f"no parallel configuration for the {len(target)} nodes that qualify ({gpus}): {e}"
            self.condition("NodesAvailable", False, "NoConfiguration", message)
            self.condition_event("Warning", "NoConfiguration", message)
            return self.finish("Pending", target, (), deletions, failures=failures)

        resized, in_place = self.resize(active, target, why_not, deletions)
        create = tuple(n for n in target if n not in active and n not in busy)
        running = {n for n, p in active.items() if p.phase == "Running" and n not in resized}
        return self.progress(target, create, deletions, failures, running, lost, failed, why_not, resized, in_place)

    def resize(self, active, target, why_not, deletions) -> tuple[dict[str, str], dict[str, dict]]:
        """Scale-down deletions, and the workers whose units differ from their node's: ``resized`` (node -> why;
        deleted, to be recreated with the node's units) and ``in_place`` (node -> {pod, gpus}: fewer units than
        the pod requests, which its ``tenplex run`` runs by dropping the failed devices itself)."""
        resized: dict[str, str] = {}
        in_place: dict[str, dict] = {}
        for node, pod in active.items():
            if node not in target:
                why = why_not.get(node, "not needed")
                deletions.append(Deletion(pod.name, self.spec.grace_seconds, f"scale down: {why}"))
                continue
            runs = self.runs(pod)
            if runs is None:
                continue
            if runs > self.gpus[node] and pod.phase == "Running":
                # The node lost units (the device plugin took an unhealthy GPU out). A running pod keeps what it
                # was given; its tenplex run excludes a failed device and re-joins with the others: no new pod.
                in_place[node] = {"pod": pod.uid, "gpus": self.gpus[node]}
            elif runs != self.gpus[node]:
                # Units came back or gpusPerNode grew (a pod's request cannot grow), or a pod not running yet asks
                # for more than the node has now (the scheduler would never place it): recreated (same name, once
                # gone) with the node's units; SIGTERM first, so it saves.
                resized[node] = f"node {node}: {runs} -> {self.gpus[node]} {self.resource}"
                deletions.append(Deletion(pod.name, self.spec.grace_seconds, f"resize: {resized[node]}"))
            elif runs != pod.gpus:
                in_place[node] = {"pod": pod.uid, "gpus": runs}
        return resized, in_place

    def runs(self, pod: PodState) -> int | None:
        """The units a worker runs on: fewer than it requests once it was resized in place (None: not read)."""
        kept = (self.old.get("resizedInPlace") or {}).get(pod.node) or {}
        return kept["gpus"] if kept.get("pod") == pod.uid else pod.gpus

    def classify(self):
        """Split our pods: lost (node gone), failed, terminating (busy) and active; what to delete now."""
        deletions: list[Deletion] = []
        failures = {node: list(uids) for node, uids in (self.old.get("failures") or {}).items()}
        lost: dict[str, str] = {}
        failed: dict[str, str] = {}
        active: dict[str, PodState] = {}
        busy: set[str] = set()  # a pod of ours still holds the name and GPUs there
        for p in self.pods:
            node = self.nodes.get(p.node)
            if node is None or not node.ready:
                lost[p.node] = f"node {p.node} is {'gone' if node is None else 'NotReady'}"
                # A graceful delete never completes without a kubelet: force it (grace 0).
                deletions.append(Deletion(p.name, 0, f"{lost[p.node]}: worker lost", p.uid))
            elif p.terminating:
                busy.add(p.node)
            elif self.stuck(p):
                # Never bound to the node, so nothing runs there: delete it at once and leave the node out.
                self.unschedulable[p.node] = p.unschedulable_message or "Unschedulable"
                deletions.append(Deletion(p.name, 0, f"worker {p.name} could not be scheduled on {p.node} for "
                                          f"{self.unschedulable_grace}s: {self.unschedulable[p.node]}", p.uid))
                busy.add(p.node)
            elif p.failed or p.node in active:
                if p.failed:
                    failed[p.node] = p.name
                    if p.uid not in failures.setdefault(p.node, []):
                        failures[p.node].append(p.uid)
                # A Failed pod runs nothing, so no grace; a crash-looping one may still be saving.
                grace = 0 if p.phase == "Failed" else self.spec.grace_seconds
                what = f"worker {p.name} failed on {p.node}" if p.failed else f"second worker on {p.node}"
                deletions.append(Deletion(p.name, grace, what, p.uid))
                busy.add(p.node)
            else:
                active[p.node] = p
        return deletions, failures, lost, failed, active, busy

    def stuck(self, p: PodState) -> bool:
        """Pending as Unschedulable for the grace period (a taint, a selector, a resource the scheduler sees)."""
        if p.phase != "Pending" or p.unschedulable_since is None:
            return False
        return not p.unschedulable_since or \
            _seconds_between(p.unschedulable_since, self.now) >= self.unschedulable_grace

    def report_unschedulable(self) -> None:
        if not self.unschedulable:
            return
        message = "; ".join(f"{n}: {why}" for n, why in sorted(self.unschedulable.items()))
        self.condition("WorkersScheduled", False, "Unschedulable",
                       f"workers could not be scheduled ({message}); these nodes are left out until the spec "
                       f"changes (a toleration or a selector in spec.template)")
        for node, why in sorted(self.unschedulable.items()):
            self.emit(Event("Warning", "WorkerUnschedulable", f"node {node} left out: {why}",
                            key=f"Unschedulable/{self.generation}/{node}"))

    def qualify(self, failures, active):
        eligible: list[str] = []
        why_not: dict[str, str] = {}
        tolerations = self.spec.tolerations(self.resource)
        for name, n in sorted(self.nodes.items()):
            free = n.allocatable - self.used.get(name, 0)
            taints = blocking_taints(n, tolerations)
            if name in active:  # a running worker stays, as under a cordon, unless a NoExecute taint evicts it
                taints = [t for t in taints if t.effect == "NoExecute"]
            if not n.store:
                why_not[name] = "no tenplex store (not labelled " + \
                    ",".join(f"{k}={v}" for k, v in STORE_NODE_LABELS.items()) + ")"
            elif not n.ready:
                why_not[name] = "NotReady"
            elif taints:
                why_not[name] = "taint " + ", ".join(f"{t.key}={t.value}:{t.effect}" for t in taints) + \
                    " not tolerated"
            elif name in self.unschedulable:
                why_not[name] = f"worker unschedulable there: {self.unschedulable[name]}"
            elif not n.schedulable and name not in active:
                why_not[name] = "cordoned"
            elif len(failures.get(name, ())) >= NODE_FAILURE_LIMIT:
                why_not[name] = f"{len(failures[name])} failed workers"
            elif free < self.spec.min_gpus_per_node:
                why_not[name] = f"{max(free, 0)} free {self.resource}"
            else:
                eligible.append(name)
                self.gpus[name] = min(free, self.spec.gpus_per_node)
        return eligible, why_not

    def ran(self) -> dict[str, int]:
        """The world that last ran, node -> units (a status written before nodeGpus: equal nodes)."""
        names = list(self.old.get("nodeNames") or ())
        if "nodeGpus" in self.old:
            return {n: self.old["nodeGpus"].get(n, 0) for n in names}
        return {n: (self.old.get("worldSize") or 0) // len(names) for n in names}

    def progress(self, target, create, deletions, failures, running, lost, failed, why_not, resized,
                 in_place) -> Decision:
        stable = tuple(self.old.get("nodeNames") or ())
        wanted = {n: self.gpus[n] for n in target}
        record = self.old.get("lastRescale") or None
        open_record = record if record and not record.get("finishedAt") else None
        complete = set(target) == running
        keep: dict = {"failures": failures, "resizedInPlace": in_place or None}
        abandoned = None
        to = (open_record or {}).get("to", {})
        if open_record and (to.get("nodeNames") != list(target) or to.get("nodeGpus", wanted) != wanted):
            # The target moved on (a joining node went NotReady, another failed): this record is dropped.
            record = abandoned = self.abandon(open_record, why_not, lost)
            open_record = None
        if not stable and not open_record:
            # The first world: starting, not a rescale.
            if complete:
                world = f"{len(target)} nodes, {self.world(target)['parallel']}"
                self.events.append(Event("Normal", "Started", world, key="Started"))
                return self.finish("Running", target, create, deletions, **keep, **self.world(target))
            return self.finish("Pending", target, create, deletions, **keep)
        if complete and not open_record and wanted == self.ran():
            self.record_events(record)
            if abandoned:
                keep["lastRescale"] = abandoned  # back where it was: the dropped record, closed, says why
            elif record is None:
                self.events.append(Event("Normal", "Started", f"{len(stable)} nodes, {self.old.get('parallel')}",
                                         key="Started"))
            return self.finish("Running", target, create, deletions, **keep, **self.world(target))
        if not open_record:
            open_record = self.new_record(stable, target, running, lost, failed, why_not, resized, in_place)
        if complete:
            open_record = {**open_record, "finishedAt": self.now}
            self.record_events(open_record)
            return self.finish("Running", target, create, deletions, lastRescale=open_record, **keep,
                               **self.world(target))
        self.record_events(open_record)
        phase = {"Rescale": "Rescaling", "Resize": "Resizing", "Recovery": "Recovering"}[open_record["type"]]
        return self.finish(phase, target, create, deletions, lastRescale=open_record, **keep)

    def abandon(self, record: dict, why_not: dict, lost: dict) -> dict:
        """``record`` closed as dropped, saying which of its nodes fell out and why."""
        gone = [n for n in record.get("to", {}).get("nodeNames") or [] if n in why_not or n in lost]
        why = "; ".join(f"{n}: {lost.get(n) or why_not[n]}" for n in gone) or "the target changed"
        closed = {**record, "finishedAt": self.now, "abandoned": why}
        if gone:  # (a record superseded by a larger target needs no event: the new RescaleStarted says it)
            self.emit(Event("Warning", "RescaleAbandoned", f"{self.describe(closed)}: dropped, {why}",
                            key=f"Abandoned/{_record_id(record)}"))
        return closed

    def record_events(self, record: dict | None) -> None:
        """The events a rescale record stands for (its start, its end or abandonment), keyed by the record."""
        if not record:
            return
        started, finished = {"Rescale": ("RescaleStarted", "Rescaled"), "Resize": ("ResizeStarted", "Resized"),
                             "Recovery": ("RecoveryStarted", "Recovered")}[record["type"]]
        rid = _record_id(record)
        self.emit(Event("Normal", started, self.describe(record), key=f"Started/{rid}"))
        if record.get("abandoned"):
            self.emit(Event("Warning", "RescaleAbandoned", f"{self.describe(record)}: dropped, "
                            f"{record['abandoned']}", key=f"Abandoned/{rid}"))
        elif record.get("finishedAt"):
            self.emit(Event("Normal", finished, self.describe(record), key=f"Finished/{rid}"))

    def new_record(self, stable, target, running, lost, failed, why_not, resized, in_place) -> dict:
        parts = [f"node {n} added" for n in target if n not in stable]
        was = self.ran()
        for n in stable:
            if n not in target:
                parts.append(lost.get(n) or (f"worker {failed[n]} failed on {n}" if n in failed else None)
                             or f"node {n} removed: {why_not.get(n, 'not needed')}")
            elif n in in_place and was[n] != self.gpus[n]:
                parts.append(f"node {n}: {was[n]} -> {self.gpus[n]} {self.resource}, in place")
            elif n in resized or (n not in running and n not in failed and was[n] != self.gpus[n]):
                # (a resize in flight when the operator restarted: the worker is gone, the counts say why)
                parts.append(resized.get(n) or f"node {n}: {was[n]} -> {self.gpus[n]} {self.resource}")
            elif n not in running:
                parts.append(f"worker {failed[n]} failed on {n}" if n in failed else f"worker on {n} missing")
        recovery = bool(lost or failed) or any(n in stable and n not in running and n not in resized
                                               and was[n] == self.gpus[n] for n in target)
        kind = "Recovery" if recovery else "Rescale" if set(stable) != set(target) else "Resize"
        # `from` is the world as it ran (the status says so): the current spec may not even allow its size.
        ran = {key: self.old.get(key) for key in ("nodes", "nodeNames", "worldSize", "parallel")}
        ran["nodeGpus"] = was
        return {"type": kind, "reason": "; ".join(parts),
                "from": ran, "to": self.world(target), "startedAt": self.now, "finishedAt": None, "abandoned": None}

    @staticmethod
    def describe(record: dict) -> str:
        f, t = record["from"], record["to"]
        return (f"{f['nodes']} -> {t['nodes']} nodes, world {f['worldSize']} -> {t['worldSize']} "
                f"({f['parallel'] or '-'} -> {t['parallel']}): {record['reason']}")
