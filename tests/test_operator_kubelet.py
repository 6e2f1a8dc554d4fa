"""The operator against the kubelet stand-in: the store token in any namespace, nodes without a store or with
taints, workers the scheduler cannot place, and Events an operator killed mid-round still posts."""

import asyncio
import logging
from pathlib import Path

import pytest

pytest.importorskip("kmock")  # Python 3.11+ (setup.cfg installs it there)

import kubernetes  # noqa: E402
import yaml  # noqa: E402
from k8s_harness import (NS, Cluster, api_server, daemonset_nodes, operator, running, start_job,  # noqa: E402
                         wait_for)

from tenplex.operator.handlers import Operator  # noqa: E402
from tenplex.operator.settings import WorkerSettings  # noqa: E402


K8S = Path(__file__).resolve().parents[1] / "k8s"


@pytest.fixture
def cluster():
    with api_server() as url:
        yield Cluster(url)


def test_kubelet_stand_in_leaves_a_pod_whose_secret_is_missing_in_container_creating(cluster):
    c = cluster
    c.add_node("n1")
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "p", "labels": {"tenplex.io/job": "x", "tenplex.io/role": "worker"}},
           "spec": {"containers": [{"name": "c", "image": "i"}],
                    "volumes": [{"name": "token", "secret": {"secretName": "tenplex-store-token"}}]}}
    c.core.create_namespaced_pod(NS, pod)
    c.kubelet("x")
    st = c.pods("x")[0]["status"]
    assert (st["phase"], st["reason"]) == ("Pending", "ContainerCreating")
    failed = c.events("FailedMount")
    assert [e["message"] for e in failed] == [
        'MountVolume.SetUp failed for volume "token" : secret "tenplex-store-token" not found']
    c.core.create_namespaced_secret(NS, {"metadata": {"name": "tenplex-store-token"}, "data": {}})
    c.kubelet("x")
    assert c.pods("x")[0]["status"]["phase"] == "Running"


def test_worker_in_a_namespace_without_the_token_secret_runs(cluster):
    """The Secret lives in tenplex-system only (the operator's quick start): the job's namespace has none."""
    c = cluster
    with operator(c.url):
        start_job(c, nodes=("n1",))
    assert c.events("FailedMount") == []
    with pytest.raises(kubernetes.client.ApiException):
        c.core.read_namespaced_secret("tenplex-store-token", NS)


def test_only_nodes_with_a_store_and_tolerated_taints_get_workers(cluster):
    c = cluster
    c.add_node("n1")
    c.add_node("n2", labels={})  # not labelled: no store DaemonSet pod, no FUSE view
    c.add_node("n3", taints=[{"key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule"}])  # kind
    c.add_node("n4", taints=[{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}])
    with operator(c.url):
        c.create_job("j", minNodes=1, maxNodes=4, gpusPerNode=8)
        st = running(c, "j", ["n1", "n4"])
    cond = next(x for x in st["conditions"] if x["type"] == "NodesAvailable")
    assert cond["status"] == "True"
    store = next(d for d in yaml.safe_load_all((K8S / "store.yaml").read_text()) if d and d["kind"] == "DaemonSet")
    nodes = c._raw(c.core.list_node)["items"]
    assert daemonset_nodes(store, nodes) == ["n1", "n4"]  # exactly where the stores run


def test_unschedulable_worker_is_replaced_and_its_node_left_out(cluster):
    c = cluster
    c.add_node("n1", labels={"tenplex.io/gpu-node": "true", "zone": "a"})
    c.add_node("n2")
    with operator(c.url, settings=WorkerSettings(unschedulable_grace=1)):
        # a selector in the template that the operator does not know about: the scheduler refuses n2
        c.create_job("j", minNodes=1, maxNodes=2, gpusPerNode=8, template={"spec": {"nodeSelector": {"zone": "a"}}})
        st = running(c, "j", ["n1"])
        warned = wait_for(lambda: c.events("WorkerUnschedulable"), "the WorkerUnschedulable event")
    assert sorted(c.pods_by_node("j")) == ["n1"]
    assert list(st["unschedulable"]) == ["n2"] and "0/2 nodes are available" in st["unschedulable"]["n2"]
    cond = next(x for x in st["conditions"] if x["type"] == "WorkersScheduled")
    assert (cond["status"], cond["reason"]) == ("False", "Unschedulable") and "n2: 0/2 nodes" in cond["message"]
    assert len(warned) == 1 and warned[0]["type"] == "Warning" and warned[0]["message"].startswith("node n2 left out")


def test_operator_killed_after_the_status_write_posts_the_events_on_its_next_round(cluster, monkeypatch):
    c = cluster
    with operator(c.url):
        start_job(c)
    c.add_node("n3")
    # One round that dies right after writing the status (the rescale record): no pod, no Event.
    op = Operator(kubernetes.client.ApiClient(kubernetes.client.Configuration(host=c.url)), WorkerSettings())
    monkeypatch.setattr(op, "_act", lambda *a: None)
    asyncio.run(op.reconcile(NS, "j", {}, logging.getLogger("test")))
    assert c.status("j")["phase"] == "Rescaling" and c.events("RescaleStarted") == []
    monkeypatch.undo()
    # Its successor creates the pod, but dies before posting (kopf's posting is not reached either).
    op = Operator(kubernetes.client.ApiClient(kubernetes.client.Configuration(host=c.url)), WorkerSettings())
    monkeypatch.setattr(op, "_post", lambda *a: False)
    asyncio.run(op.reconcile(NS, "j", {}, logging.getLogger("test")))
    assert "n3" in c.pods_by_node("j") and c.events("WorkerCreated") and not [
        e for e in c.events("WorkerCreated") if e["message"].startswith("j-n3")]
    monkeypatch.undo()
    with operator(c.url):
        running(c, "j", ["n1", "n2", "n3"])
        wait_for(lambda: c.events("Rescaled"), "the Rescaled event")
    assert len(c.events("RescaleStarted")) == 1 and len(c.events("Rescaled")) == 1
    assert len([e for e in c.events("WorkerCreated") if e["message"].startswith("j-n3 ")]) == 1
    assert len(c.events("WorkerCreated")) == 3 and len(c.events("Started")) == 1


def test_node_that_lost_a_gpu_keeps_a_worker_with_the_gpus_left(cluster):
    """The device plugin marks one of n2's GPUs unhealthy (allocatable 8 -> 7): with minGpusPerNode=6 the worker there
    stays (its tenplex run drops the device); when it fails later, it is replaced requesting 7 and running 7
    workers: the scheduler would not place one asking for 8."""
    c = cluster
    with operator(c.url):
        start_job(c, minGpusPerNode=6, parallel={"maxTp": 1})
        old = c.pods_by_node("j")["n2"]
        c.set_gpus("n2", 7)
        st = wait_for(lambda: (c.kubelet("j"), c.status("j"))[1].get("nodeGpus") == {"n1": 8, "n2": 7}
                      and c.status("j"), "the world of 8+7")
        assert c.pods_by_node("j")["n2"]["metadata"]["uid"] == old["metadata"]["uid"]
        c.set_pod_phase(old["metadata"]["name"], "Failed")

        def replaced():
            c.kubelet("j")
            new = c.pods_by_node("j").get("n2")
            return new and new["metadata"]["uid"] != old["metadata"]["uid"]
        wait_for(replaced, "the replacement on n2")
        running(c, "j", ["n1", "n2"])
        started, resized = c.events("ResizeStarted"), c.events("Resized")
    assert (st["phase"], st["worldSize"], st["parallel"]) == ("Running", 15, "dp=15,tp=1,pp=1")
    rec = st["lastRescale"]
    assert (rec["type"], rec["reason"], rec["finishedAt"] is not None) == \
        ("Resize", "node n2: 8 -> 7 nvidia.com/gpu, in place", True)
    pod = c.pods_by_node("j")["n2"]
    assert pod["status"]["phase"] == "Running" and c.status("j")["nodeGpus"] == {"n1": 8, "n2": 7}
    container = pod["spec"]["containers"][0]
    assert container["resources"]["requests"] == {"nvidia.com/gpu": "7"}
    assert container["command"][container["command"].index("--nproc-per-node") + 1] == "7"
    assert c.pods_by_node("j")["n1"]["spec"]["containers"][0]["resources"]["requests"] == {"nvidia.com/gpu": "8"}
    assert len(started) == len(resized) == 1 and resized[0]["message"].startswith("2 -> 2 nodes, world 16 -> 15")
    deleted = [e["message"] for e in c.events("WorkerDeleted")]
    assert deleted == ["j-n2 (grace 0s): worker j-n2 failed on n2"]
