"""Test harness for the operator: the realistic KMock API server in a thread, a kubelet stand-in, the operator.

The API server runs on its own event loop in a thread (kopf's KopfRunner runs
the operator in another); the tests talk to it through the official
``kubernetes`` client, as kubectl would. Waiting is bounded polling on a
condition, never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
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

NS = "ml"


@contextlib.contextmanager
def api_server():
    """The realistic KMock server on 127.0.0.1 (port 0), yielding its URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="kmock", daemon=True)
    thread.start()
    handler = RealisticKubernetes()
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
    def add_node(self, name: str, gpus: int = 8, ready: bool = True, ip: str | None = None) -> None:
        self.core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
        self.core.patch_node_status(name, {"status": {
            "addresses": [{"type": "InternalIP", "address": ip}] if ip else [],
            "allocatable": {"nvidia.com/gpu": str(gpus), "cpu": "16"},
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}})

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
    def pods(self, job: str) -> list[dict]:
        selector = f"{JOB_LABEL}={job},{ROLE_LABEL}=worker"
        return self._raw(self.core.list_namespaced_pod, NS, label_selector=selector)["items"]

    def pods_by_node(self, job: str, *, live_only: bool = True) -> dict[str, dict]:
        return {p["metadata"]["annotations"][NODE_ANNOTATION]: p for p in self.pods(job)
                if not (live_only and p["metadata"].get("deletionTimestamp"))}

    def kubelet(self, job: str) -> None:
        """Bind and start pending pods on ready nodes; finish graceful deletions (as the kubelet would)."""
        for p in self.pods(job):
            name = p["metadata"]["name"]
            if p["metadata"].get("deletionTimestamp"):
                with contextlib.suppress(kubernetes.client.ApiException):
                    self.core.delete_namespaced_pod(name, NS, grace_period_seconds=0)
            elif (p.get("status") or {}).get("phase") in (None, "Pending"):
                node = p["metadata"]["annotations"][NODE_ANNOTATION]
                self.core.patch_namespaced_pod(name, NS, {"spec": {"nodeName": node}})
                self.core.patch_namespaced_pod_status(name, NS, {"status": {"phase": "Running"}})

    def set_pod_phase(self, name: str, phase: str) -> None:
        self.core.patch_namespaced_pod_status(name, NS, {"status": {"phase": phase}})


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
