"""Test harness for the operator: the realistic KMock API server in a thread, a kubelet stand-in, the operator.

The API server runs on its own event loop in a thread (kopf's KopfRunner runs
the operator in another); the tests talk to it through the official
``kubernetes`` client, as kubectl would. Waiting is bounded polling on a
condition, never a fixed sleep.

TEST DOUBLE: :meth:`Cluster.kubelet` plays the scheduler and the kubelet where
it matters to the operator, written from the Kubernetes documentation, not
from the operator's code: a pod is bound only to a node whose labels match its
``nodeSelector`` and node affinity, whose NoSchedule/NoExecute taints it
tolerates and whose allocatable ``nvidia.com/gpu`` minus what the pods bound
there request covers the pod's request (else Pending, ``PodScheduled=False``
reason ``Unschedulable``); a bound pod keeps running when its node's
allocatable drops below its request (the kubelet evicts nothing for it); a
bound pod whose Secret volume names a Secret missing in the pod's namespace
stays Pending in ``ContainerCreating`` with a ``FailedMount`` Event, as the
kubelet leaves it. :func:`daemonset_nodes` is where a DaemonSet runs pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import threading
import time
from typing import Any, Callable

import kmock
import kopf
import kubernetes
from kopf.testing import KopfRunner

from kmock_realism import RealisticKubernetes
from tenplex.operator import GROUP, JOB_LABEL, NODE_ANNOTATION, PLURAL, ROLE_LABEL, VERSION
from tenplex.operator.handlers import Operator
from tenplex.operator.settings import WorkerSettings

STORE_LABEL = "tenplex.io/gpu-node"  # k8s/store.yaml's nodeSelector (the README's quick start labels the nodes)
NS = "ml"
GPU = "nvidia.com/gpu"


@contextlib.contextmanager
def api_server(requests: list | None = None):
    """The realistic KMock server on 127.0.0.1 (port 0), yielding its URL; ``requests`` collects its RBAC log."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="kmock", daemon=True)
    thread.start()
    handler = RealisticKubernetes()
    if requests is not None:
        handler.requests = requests
    # KMock cannot parse POST /api/v1/namespaces (it reads "namespaces" as a namespace prefix): seed it.
    handler.objects["v1/namespaces", None, NS] = {"apiVersion": "v1", "kind": "Namespace",
                                                   "metadata": {"name": NS, "resourceVersion": "0", "uid": NS}}
    server = kmock.Server(handler)

    async def start() -> str:
        await handler.__aenter__()
        await server.__aenter__()
        return str(server.url).rstrip("/")

    async def stop() -> None:
        await server.__aexit__(None, None, None)
        await handler.__aexit__(None, None, None)

    url = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield url
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}; last value: {last!r}")


class Cluster:
    """kubectl and kubelet for the tests: nodes, jobs, and pod phases (there is no kubelet here)."""

    def __init__(self, url: str):
        self.url = url
        self.api = kubernetes.client.ApiClient(kubernetes.client.Configuration(host=url))
        self.core = kubernetes.client.CoreV1Api(self.api)
        self.custom = kubernetes.client.CustomObjectsApi(self.api)

    def _raw(self, call, *args, **kwargs) -> Any:
        return json.loads(call(*args, _preload_content=False, **kwargs).data)

    # nodes
    def add_node(self, name: str, gpus: int = 8, ready: bool = True, ip: str | None = None,
                 labels: dict | None = None, taints: list | None = None) -> None:
        """A node; labelled for the store DaemonSet (as the operator's quick start says) unless ``labels`` says."""
        labels = {STORE_LABEL: "true"} if labels is None else labels
        self.core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels},
                               "spec": {"taints": taints or []}})
        self.core.patch_node_status(name, {"status": {
            "addresses": [{"type": "InternalIP", "address": ip}] if ip else [],
            "allocatable": {"nvidia.com/gpu": str(gpus), "cpu": "16"},
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}})

    def set_gpus(self, name: str, gpus: int) -> None:
        """The node's allocatable GPUs, as the device plugin reports them (fewer when it marks one unhealthy)."""
        self.core.patch_node_status(name, {"status": {"allocatable": {"nvidia.com/gpu": str(gpus), "cpu": "16"}}})

    def set_ready(self, name: str, ready: bool) -> None:
        self.core.patch_node_status(name, {"status": {"conditions": [
            {"type": "Ready", "status": "True" if ready else "False"}]}})

    # jobs
    def create_job(self, name: str, **spec: Any) -> None:
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TenplexJob", "metadata": {"name": name},
                "spec": {"image": "tenplex:test", "command": ["train.py", "--steps", "9"], **spec}}
        self.custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, body)

    def patch_spec(self, name: str, **spec: Any) -> None:
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name, {"spec": spec})

    def job(self, name: str) -> dict:
        return self._raw(self.custom.get_namespaced_custom_object, GROUP, VERSION, NS, PLURAL, name)

    def status(self, name: str) -> dict:
        return self.job(name).get("status") or {}

    def events(self, reason: str) -> list[dict]:
        return [e for e in self._raw(self.core.list_namespaced_event, NS)["items"] if e.get("reason") == reason]

    # pods
    def pods(self, job: str, namespace: str = NS) -> list[dict]:
        selector = f"{JOB_LABEL}={job},{ROLE_LABEL}=worker"
        return self._raw(self.core.list_namespaced_pod, namespace, label_selector=selector)["items"]

    def pods_by_node(self, job: str, *, live_only: bool = True) -> dict[str, dict]:
        return {p["metadata"]["annotations"][NODE_ANNOTATION]: p for p in self.pods(job)
                if not (live_only and p["metadata"].get("deletionTimestamp"))}

    def kubelet(self, job: str, namespace: str = NS) -> None:
        """Schedule, mount and start pending pods; finish graceful deletions (the scheduler's and kubelet's part)."""
        nodes = self._raw(self.core.list_node)["items"]
        for p in self.pods(job, namespace):
            name = p["metadata"]["name"]
            if p["metadata"].get("deletionTimestamp"):
                with contextlib.suppress(kubernetes.client.ApiException):
                    self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
            elif (p.get("status") or {}).get("phase") in (None, "Pending"):
                node = p["spec"].get("nodeName") or self._schedule(p, nodes, namespace)
                if node is not None:
                    self._start(p, namespace)

    def _schedule(self, pod: dict, nodes: list[dict], namespace: str) -> str | None:
        """Bind ``pod`` to the first node that fits it, or mark it Unschedulable saying why."""
        bound = [p for p in self._raw(self.core.list_namespaced_pod, namespace)["items"]
                 if p["spec"].get("nodeName") and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
        fits = [n["metadata"]["name"] for n in nodes if fits_node(pod["spec"], n) and
                _gpus(pod) <= int(n["status"]["allocatable"].get(GPU, 0)) -
                sum(_gpus(p) for p in bound if p["spec"]["nodeName"] == n["metadata"]["name"])]
        name = pod["metadata"]["name"]
        if fits:
            self.core.patch_namespaced_pod(name, namespace, {"spec": {"nodeName": fits[0]}})
            return fits[0]
        old = next((c for c in (pod.get("status") or {}).get("conditions") or [] if c["type"] == "PodScheduled"),
                   None)
        if old is None:
            message = (f"0/{len(nodes)} nodes are available: {len(nodes)} node(s) didn't match Pod's node "
                       f"affinity/selector, had untolerated taints or Insufficient {GPU}")
            self.core.patch_namespaced_pod_status(name, namespace, {"status": {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message,
                 "lastTransitionTime": _now()}]}})
        return None

    def _start(self, pod: dict, namespace: str) -> None:
        """Run a bound pod, unless a Secret volume names a Secret missing in its namespace (FailedMount)."""
        name = pod["metadata"]["name"]
        for volume in pod["spec"].get("volumes") or []:
            secret = (volume.get("secret") or {}).get("secretName")
            if secret and not self._exists(self.core.read_namespaced_secret, secret, namespace):
                if (pod.get("status") or {}).get("reason") != "ContainerCreating":
                    self.core.patch_namespaced_pod_status(name, namespace, {"status": {
                        "phase": "Pending", "reason": "ContainerCreating"}})
                    self.core.create_namespaced_event(namespace, {
                        "metadata": {"generateName": f"{name}."}, "type": "Warning", "reason": "FailedMount",
                        "involvedObject": {"kind": "Pod", "name": name, "namespace": namespace},
                        "message": f'MountVolume.SetUp failed for volume "{volume["name"]}" : '
                                   f'secret "{secret}" not found'})
                return
        self.core.patch_namespaced_pod_status(name, namespace, {"status": {"phase": "Running", "conditions": [
            {"type": "PodScheduled", "status": "True"}]}})

    @staticmethod
    def _exists(read, *args) -> bool:
        try:
            read(*args)
            return True
        except kubernetes.client.ApiException as e:
            if e.status == 404:
                return False
            raise

    def set_pod_phase(self, name: str, phase: str) -> None:
        self.core.patch_namespaced_pod_status(name, NS, {"status": {"phase": phase}})


def _gpus(pod: dict) -> int:
    """The GPUs a pod requests (a limit alone is the request)."""
    total = 0
    for c in pod["spec"].get("containers") or []:
        res = c.get("resources") or {}
        total += int((res.get("requests") or {}).get(GPU, (res.get("limits") or {}).get(GPU, 0)))
    return total


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _tolerated(tolerations: list[dict], taint: dict) -> bool:
    """The scheduler's rule: same effect (or none given), same key (or none, with Exists), Exists or equal value."""
    for t in tolerations:
        if t.get("effect") not in (None, "", taint.get("effect")):
            continue
        if not t.get("key") and t.get("operator") == "Exists":
            return True
        if t.get("key") == taint.get("key") and (t.get("operator") == "Exists" or
                                                  t.get("value", "") == taint.get("value", "")):
            return True
    return False


def fits_node(pod_spec: dict, node: dict) -> bool:
    """Whether the scheduler may bind a pod with ``pod_spec`` to ``node`` (selector, affinity, taints)."""
    labels = node["metadata"].get("labels") or {}
    if any(labels.get(k) != v for k, v in (pod_spec.get("nodeSelector") or {}).items()):
        return False
    required = (((pod_spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = required.get("nodeSelectorTerms") or []
    fields = {"metadata.name": node["metadata"]["name"]}

    def matches(req: dict, values: dict) -> bool:
        if req["operator"] == "In":
            return values.get(req["key"]) in req["values"]
        if req["operator"] == "Exists":
            return req["key"] in values
        raise AssertionError(f"this test double knows only In and Exists: {req}")
    if terms and not any(all(matches(r, fields) for r in term.get("matchFields") or []) and
                         all(matches(r, labels) for r in term.get("matchExpressions") or []) for term in terms):
        return False
    taints = [t for t in (node.get("spec") or {}).get("taints") or [] if t.get("effect") != "PreferNoSchedule"]
    return all(_tolerated(pod_spec.get("tolerations") or [], t) for t in taints)


def daemonset_nodes(daemonset: dict, nodes: list[dict]) -> list[str]:
    """The nodes a DaemonSet runs a pod on: those its pod template fits."""
    return [n["metadata"]["name"] for n in nodes if fits_node(daemonset["spec"]["template"]["spec"], n)]


def running(c: Cluster, job: str, nodes: list[str]) -> dict:
    """Play the kubelet until the job runs on exactly ``nodes``; returns its status."""
    def check():
        c.kubelet(job)
        st = c.status(job)
        return st if st.get("phase") == "Running" and st.get("nodeNames") == nodes else None
    return wait_for(check, f"{job} Running on {nodes}")


def start_job(c: Cluster, nodes=("n1", "n2"), **spec: Any) -> dict:
    """Nodes ``nodes`` and the job ``j`` (1 to 3 nodes of 8 GPUs) running on them."""
    for n in nodes:
        c.add_node(n)
    c.create_job("j", **{"minNodes": 1, "maxNodes": 3, "gpusPerNode": 8, **spec})
    return running(c, "j", list(nodes))


@contextlib.contextmanager
def operator(url: str, interval: float = 0.5, settings: WorkerSettings | None = None):
    """The operator under test: a fresh kopf registry, KopfRunner, standalone, watching namespace NS."""
    registry = kopf.OperatorRegistry()
    api = kubernetes.client.ApiClient(kubernetes.client.Configuration(host=url))
    Operator(api, settings or WorkerSettings(), interval=interval).register(registry)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=url)

    kopf_settings = kopf.OperatorSettings()
    kopf_settings.scanning.disabled = True  # no CRD discovery: the test double declares its resources
    with KopfRunner(["run", "--standalone", "--namespace", NS], registry=registry, settings=kopf_settings,
                    timeout=60) as runner:
        yield runner
