"""The kopf handlers: observe, decide (pure), act.

May import: ``kopf``, ``kubernetes``, the package's modules, ``tenplex.ops`` (its metrics and log context) and the
standard library.

Each TenplexJob gets a kopf daemon that reconciles it: read the job, its
worker pods (label selector) and the Nodes; :func:`.decide.decide`; write the
status (optimistic concurrency: the job's ``resourceVersion`` is part of the
patch, so a decision made on a stale spec is never written; a 409 re-reads
and decides again); then delete and create pods and post the Events. Events
are named by the job and their key, so posting one again is a harmless 409:
the decision and the observed workers name them again every round, and an
operator that died before posting posts them on its next round. The loop
runs again when a worker pod, a Node or the spec changes (kopf watch events
poke it) and every ``interval`` seconds anyway: it is
level-based, so a missed poke only delays it.

Errors say whether retrying helps: API trouble (5xx, timeouts, repeated
409s) raises :class:`kopf.TemporaryError` and kopf restarts the daemon after
a delay; a spec that cannot run is a :class:`kopf.PermanentError` for the
spec handler (retrying the same spec cannot help; an edit runs it again) and
the ``Failed`` phase with a condition naming the field for the daemon, which
keeps watching for a corrected spec.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import logging
import time
from typing import Any, Mapping

import kopf
import urllib3
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from ..ops import logs
from ..ops.metrics import OperatorMetrics
from . import GROUP, JOB_LABEL, PLURAL, ROLE_LABEL, VERSION, WORKER_ROLE
from .decide import decide
from .outcome import Decision, Event, merge_patch, observed_events, worker_created
from .observe import PodState, gpu_claim, node_state, pod_state, used_by_others
from .pods import worker_pod
from .progress import committed_state, store_address
from .views import view_status
from .settings import WorkerSettings
from .spec import SpecError, check_name, parse_spec

CONFLICT_RETRIES = 5
PEERING_LIFETIME = 15  # seconds; see _register_settings
EVENT_MESSAGE_LIMIT = 1024  # the API server's limit on an Event's message


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _spec_or_error(job: Mapping[str, Any]):
    try:
        check_name(job["metadata"]["name"])
        return parse_spec(job.get("spec") or {})
    except SpecError as e:
        return e


class Operator:
    """The handlers of one operator, bound to one Kubernetes API client (the tests make one per test)."""

    def __init__(self, api: k8s.ApiClient, settings: WorkerSettings | None = None, *, interval: float = 10.0):
        self.api = api
        self.core = k8s.CoreV1Api(api)
        self.custom = k8s.CustomObjectsApi(api)
        self.settings = settings or WorkerSettings()
        self.interval = interval
        self.pokes: dict[tuple[str, str], asyncio.Event] = {}
        self.node_view: dict[str, Any] = {}  # node name -> its NodeState (None once deleted)
        # (namespace, name) -> (generation, SpecError): the API server refused this spec's worker pod
        self.rejected: dict[tuple[str, str], tuple[int, SpecError]] = {}
        # (namespace, name) -> keys of the Events posted (or found posted): saves a 409 per event and round
        self.posted: dict[tuple[str, str], set[str]] = {}
        self.metrics = OperatorMetrics()  # served by `tenplex operator run --metrics-port`

    # -- kopf wiring ---------------------------------------------------------------------------------------------
    def register(self, registry: kopf.OperatorRegistry) -> kopf.OperatorRegistry:
        """The operator's handlers in ``registry``: its settings, the jobs' handlers, the pod and node watches."""
        self._register_settings(registry)
        self._register_jobs(registry)
        self._register_watches(registry)
        return registry

    def _register_settings(self, registry: kopf.OperatorRegistry) -> None:
        # Handlers take **kw: kopf passes many keyword arguments and types its handlers as protocols of all of them.
        @kopf.on.startup(registry=registry)
        def configure(**kw: Any) -> None:
            settings: kopf.OperatorSettings = kw["settings"]
            # Handler progress in our own annotations (the CRD's status schema has no room for kopf's).
            settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
            settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
                prefix=GROUP, key="last-handled-configuration")
            settings.posting.level = logging.WARNING  # our own events say what happened; kopf's add noise
            settings.scanning.disabled = True  # the resources are known: no CRD discovery (and no RBAC for it)
            # A killed operator's peering entry blocks its successor until the entry expires (kopf's default 60 s):
            # a short lifetime bounds the takeover, at one heartbeat patch every 5-10 s.
            settings.peering.lifetime = PEERING_LIFETIME

    def _register_jobs(self, registry: kopf.OperatorRegistry) -> None:
        job = (GROUP, VERSION, PLURAL)

        @kopf.on.create(*job, id="spec", registry=registry)
        @kopf.on.update(*job, id="spec", field="spec", registry=registry)
        @kopf.on.resume(*job, id="spec", registry=registry)
        def spec_changed(**kw: Any) -> None:
            self.poke(kw["namespace"], kw["name"])
            spec = _spec_or_error(kw["body"])
            if isinstance(spec, SpecError):
                raise kopf.PermanentError(f"invalid spec, fix {spec.field}: {spec}")

        @kopf.daemon(*job, id="reconcile", cancellation_timeout=1.0, backoff=2.0, registry=registry)
        async def reconcile_loop(**kw: Any) -> None:
            namespace, name, stopped = kw["namespace"], kw["name"], kw["stopped"]
            poke = self.pokes.setdefault((namespace, name), asyncio.Event())
            with logs.scope(job=f"{namespace}/{name}"):  # JSON log lines of this job's reconciliations say so
                while not stopped:
                    poke.clear()
                    await self.reconcile(namespace, name, kw["gpu_pods"], kw["logger"])
                    try:
                        await asyncio.wait_for(poke.wait(), timeout=self.interval)
                    except asyncio.TimeoutError:
                        pass

        @kopf.on.delete(*job, id="forget", optional=True, registry=registry)
        def forget(**kw: Any) -> None:
            self.pokes.pop((kw["namespace"], kw["name"]), None)
            self.posted.pop((kw["namespace"], kw["name"]), None)

    def _register_watches(self, registry: kopf.OperatorRegistry) -> None:
        @kopf.index("pods", id="gpu_pods", registry=registry)
        def gpu_pods(**kw: Any) -> dict | None:
            """Accelerator units per node and the job holding them: the other jobs' share of each node."""
            claim = gpu_claim(kw["body"], self.settings.resource)
            return None if claim is None else {claim[0]: claim}

        @kopf.on.event("pods", id="worker_changed", labels={ROLE_LABEL: WORKER_ROLE}, registry=registry)
        def worker_changed(**kw: Any) -> None:
            meta = kw["body"].get("metadata") or {}
            self.poke(meta.get("namespace"), (meta.get("labels") or {}).get(JOB_LABEL))

        @kopf.on.event("nodes", id="node_changed", registry=registry)
        def node_changed(**kw: Any) -> None:
            # Heartbeats rewrite a node's status all the time; only readiness, cordons, capacity, labels and
            # taints matter.
            body = kw["body"]
            name = str((body.get("metadata") or {}).get("name"))
            view = None if kw["type"] == "DELETED" else node_state(body, self.settings.resource)
            if self.node_view.get(name) != view:
                self.node_view[name] = view
                for key in list(self.pokes):
                    self.poke(*key)

    def poke(self, namespace: str | None, name: str | None) -> None:
        event = self.pokes.get((str(namespace), str(name)))
        if event is not None:
            event.set()

    # -- one reconciliation --------------------------------------------------------------------------------------
    async def reconcile(self, namespace: str, name: str, gpu_pods: kopf.Index, logger: logging.Logger) -> None:
        # A snapshot of the other pods' accelerator units per node, taken here: the index changes on the loop.
        used = used_by_others([claim for claims in gpu_pods.values() for claim in claims], (namespace, name))
        for _ in range(CONFLICT_RETRIES):
            try:
                begin = time.monotonic()
                job, decision, pods = await asyncio.to_thread(self._decide_and_write, namespace, name, used)
                self.metrics.decision_seconds.observe(time.monotonic() - begin)
                if job is not None and decision is not None:
                    await asyncio.to_thread(self._act, job, decision, pods, logger)
                self.metrics.reconciliations.labels("ok").inc()
                return
            except ApiException as e:
                self.metrics.observe_api_error(e.status)
                if e.status == 409:
                    continue  # the job changed since we read it: read it again and decide again
                if e.status == 404:
                    return  # deleted meanwhile; kopf stops this daemon
                raise kopf.TemporaryError(f"Kubernetes API: {e.status} {e.reason}", delay=5) from e
            except (OSError, urllib3.exceptions.HTTPError) as e:
                self.metrics.observe_api_error(0)
                raise kopf.TemporaryError(f"Kubernetes API unreachable: {e}", delay=5) from e
        raise kopf.TemporaryError(f"TenplexJob {namespace}/{name} kept changing ({CONFLICT_RETRIES} conflicts)",
                                  delay=1)

    def _get(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        """The raw JSON of a read: the decision works on what the API server says, field for field."""
        return json.loads(call(*args, _preload_content=False, **kwargs).data)

    def _decide_and_write(self, namespace: str, name: str, used: dict[str, int]) -> tuple[Any, Any, list[PodState]]:
        """Observe, decide and write the status: the job as read, the decision, the workers as observed."""
        job = self._get(self.custom.get_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL, name)
        if (job.get("metadata") or {}).get("deletionTimestamp"):
            return None, None, []  # being deleted: the garbage collector removes the workers (owner references)
        selector = f"{JOB_LABEL}={name},{ROLE_LABEL}={WORKER_ROLE}"
        pods = [pod_state(p, self.settings.resource) for p in
                self._get(self.core.list_namespaced_pod, namespace, label_selector=selector)["items"]]
        nodes = self._get(self.core.list_node)["items"]
        spec = _spec_or_error(job)
        rejected = self.rejected.get((namespace, name))
        if rejected and rejected[0] == job["metadata"].get("generation") and not isinstance(spec, SpecError):
            spec = rejected[1]  # until the spec is edited: the same pod would fail again
        decision = decide(spec, [node_state(n, self.settings.resource) for n in nodes],
                          pods, used_by_others=used, status=job.get("status"),
                          generation=job["metadata"].get("generation"), now=_now(),
                          resource=self.settings.resource, unschedulable_grace=self.settings.unschedulable_grace)
        status = dict(decision.status)
        state = self._committed_state(nodes, decision)
        if state is not None:
            status["step"] = int(state["step"])
            view = view_status(state)
            if view is not None:
                status["dataView"] = view
        old = job.get("status") or {}
        if merge_patch(old, status) != old:  # skip writes that change nothing
            body = {"metadata": {"resourceVersion": job["metadata"]["resourceVersion"]}, "status": status}
            self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name, body)
        return job, decision, pods

    def _committed_state(self, nodes: list[dict], decision: Decision) -> dict | None:
        """The job's last committed training state (its step, its view) from the store of one of its nodes (None:
        not known now)."""
        if not decision.target:
            return None
        token = None
        if self.settings.token_file:
            with open(self.settings.token_file, encoding="utf-8") as f:
                token = f.read().strip()
        # One node is enough (each holds the state document of every save); a store that does not answer
        # leaves the step as it was rather than slowing every reconciliation down.
        by_name = {n["metadata"]["name"]: n for n in nodes}
        addresses = (store_address(by_name.get(name, {}), self.settings.store_port) for name in decision.target)
        address = next((a for a in addresses if a is not None), None)
        return None if address is None else committed_state(address, token)

    def _refused(self, job: dict, pod: dict, e: ApiException) -> SpecError | None:
        """The user error behind a refused create, or None (a 409 for our own pod: an earlier round made it)."""
        name = pod["metadata"]["name"]
        if e.status == 422:  # the pod is invalid: the spec's template
            why = (json.loads(e.body).get("message") if e.body else None) or e.reason
            return SpecError("spec.template", f"the API server rejected the worker pod: {why}")
        if e.status == 409:
            other = self._get(self.core.read_namespaced_pod, name, pod["metadata"]["namespace"])
            if (other["metadata"].get("labels") or {}).get(JOB_LABEL) != job["metadata"]["name"]:
                return SpecError("metadata.name", f"the worker pod name {name} is taken by a pod that is not this "
                                 f"job's worker: rename the TenplexJob")
        return None

    def _act(self, job: dict, decision: Decision, pods: list[PodState], logger: logging.Logger) -> None:
        """Delete and create pods, then post the events: those decided, and those of the workers observed.

        The status was written first; an operator that dies before the end posts what it missed on its next
        round, since the events are decided again from what it observes and posting is idempotent.
        """
        namespace = job["metadata"]["namespace"]
        for d in decision.delete:
            try:
                self.core.delete_namespaced_pod(d.pod, namespace, grace_period_seconds=d.grace_seconds)
            except ApiException as e:
                if e.status != 404:  # already gone: what we wanted
                    raise
            else:
                self._post(job, Event("Normal", "WorkerDeleted", f"{d.pod} (grace {d.grace_seconds}s): {d.reason}",
                                      key=f"WorkerDeleted/{d.uid or d.pod}"))
        if decision.create and not self._create(job, {n: decision.gpus[n] for n in decision.create}):
            return
        for ev in (*observed_events(pods), *decision.events):
            if self._post(job, ev):  # decide() repeats its events every round: count each once, when posted
                self.metrics.observe_events([ev.reason])
                logger.info("%s: %s", ev.reason, ev.message)

    def _create(self, job: dict, nodes: Mapping[str, int]) -> bool:
        """Create the workers on ``nodes`` (node -> units of the resource); False when the API server refused one
        for the spec's fault."""
        namespace = job["metadata"]["namespace"]
        spec = parse_spec(job["spec"])  # decide() only asks for pods when the spec is valid
        for node, gpus in nodes.items():
            pod = worker_pod(job, spec, node, self.settings, gpus)
            try:
                created = self._get(self.core.create_namespaced_pod, namespace, pod)
            except ApiException as e:
                error = self._refused(job, pod, e)
                if error is not None:
                    key = (namespace, job["metadata"]["name"])
                    self.rejected[key] = (job["metadata"].get("generation"), error)
                    self.poke(*key)
                    return False
                if e.status != 409:
                    raise
            else:
                self._post(job, worker_created(pod_state(created)))
        return True

    def _post(self, job: dict, event: Event) -> bool:
        """Post ``event`` on ``job`` once: its name derives from the job and the event's key (a 409: posted).

        Returns whether it was posted now.
        """
        meta = job["metadata"]
        posted = self.posted.setdefault((meta["namespace"], meta["name"]), set())
        key = event.key or f"{event.reason}/{event.message}"
        if key in posted:
            return False
        digest = hashlib.sha256(f"{meta['uid']}/{key}".encode()).hexdigest()[:16]
        now = _now()
        body = {"apiVersion": "v1", "kind": "Event",
                "metadata": {"name": f"{meta['name']}.{digest}", "namespace": meta["namespace"]},
                "involvedObject": {"apiVersion": job["apiVersion"], "kind": job["kind"], "name": meta["name"],
                                   "namespace": meta["namespace"], "uid": meta["uid"]},
                "type": event.type, "reason": event.reason, "message": event.message[:EVENT_MESSAGE_LIMIT],
                "source": {"component": "tenplex-operator"}, "firstTimestamp": now, "lastTimestamp": now,
                "count": 1}
        try:
            self.core.create_namespaced_event(meta["namespace"], body)  # type: ignore[arg-type]  # JSON works too
        except ApiException as e:
            if e.status != 409:
                raise
            posted.add(key)
            return False
        posted.add(key)
        return True
