"""The operator for real: kopf (KopfRunner, a fresh registry per test) against KMock with the realism layer.

The tests play the kubelet (pod phases, node readiness, finishing graceful
deletions) and wait on conditions with bounded polling.
"""

import asyncio
import json
import logging
import sys
from pathlib import Path

import pytest

pytest.importorskip("kmock")  # Python 3.11+ (setup.cfg installs it there)

import kopf  # noqa: E402
import kubernetes  # noqa: E402
from k8s_harness import NS, Cluster, api_server, operator, running, start_job, wait_for  # noqa: E402

from store_helpers import StoreProcess, tiny_layout  # noqa: E402

import tenplex  # noqa: E402
from tenplex.operator.handlers import Operator  # noqa: E402
from tenplex.operator.progress import STATE_DOC, committed_step  # noqa: E402
from tenplex.store import Store, fill  # noqa: E402
from tenplex.operator.settings import WorkerSettings  # noqa: E402


@pytest.fixture
def cluster():
    with api_server() as url:
        yield Cluster(url)


def test_create_gives_one_labelled_worker_per_node_and_status(cluster):
    c = cluster
    with operator(c.url):
        st = start_job(c)
        pods = c.pods_by_node("j")
        assert sorted(pods) == ["n1", "n2"]
        p = pods["n1"]
        assert p["metadata"]["labels"] == {"tenplex.io/job": "j", "tenplex.io/role": "worker"}
        owner = p["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == \
            ("TenplexJob", "j", c.job("j")["metadata"]["uid"], True)
        cmd = p["spec"]["containers"][0]["command"]
        assert cmd[:2] == ["tenplex", "run"] and cmd[cmd.index("--host") + 1] == "$(NODE_NAME)"
        assert cmd[-3:] == ["train.py", "--steps", "9"]
        assert cmd[cmd.index("--nnodes") + 1] == "1:3" and cmd[cmd.index("--rdzv-id") + 1] == owner["uid"]
        assert p["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "8"}
        assert (st["nodes"], st["worldSize"], st["parallel"], st["observedGeneration"]) == (2, 16, "dp=2,tp=8,pp=1", 1)
        wait_for(lambda: c.events("Started"), "the Started event")
        assert len(c.events("WorkerCreated")) == 2


def test_node_joins_scales_up(cluster):
    c = cluster
    with operator(c.url):
        start_job(c)
        c.add_node("n3")
        wait_for(lambda: c.status("j").get("phase") == "Rescaling", "Rescaling")
        st = running(c, "j", ["n1", "n2", "n3"])
        rec = st["lastRescale"]
        assert (rec["type"], rec["reason"], rec["from"]["nodes"], rec["to"]["nodes"]) == \
            ("Rescale", "node n3 added", 2, 3)
        assert rec["finishedAt"] >= rec["startedAt"] and st["worldSize"] == 24
        wait_for(lambda: c.events("Rescaled"), "the Rescaled event")
        assert len(c.events("RescaleStarted")) == 1


def test_failed_pod_is_replaced(cluster):
    c = cluster
    with operator(c.url):
        start_job(c)
        old = c.pods_by_node("j")["n2"]
        c.set_pod_phase(old["metadata"]["name"], "Failed")

        def replaced():
            new = c.pods_by_node("j").get("n2")
            return new and new["metadata"]["uid"] != old["metadata"]["uid"]
        wait_for(replaced, "a new worker on n2")
        st = running(c, "j", ["n1", "n2"])
        assert st["failures"] == {"n2": [old["metadata"]["uid"]]}
        assert st["lastRescale"]["type"] == "Recovery" and "failed on n2" in st["lastRescale"]["reason"]
        wait_for(lambda: c.events("Recovered"), "the Recovered event")


def test_node_not_ready_continues_smaller(cluster):
    c = cluster
    with operator(c.url):
        start_job(c)
        c.set_ready("n2", False)
        st = running(c, "j", ["n1"])
        assert "n2" not in c.pods_by_node("j", live_only=False)  # force-deleted: no kubelet to finish it
        assert (st["lastRescale"]["type"], st["lastRescale"]["reason"]) == ("Recovery", "node n2 is NotReady")
        assert st["worldSize"] == 8 and st["parallel"] == "dp=1,tp=8,pp=1"
        c.set_ready("n2", True)  # it comes back: the job grows again
        running(c, "j", ["n1", "n2"])


def test_edit_of_max_nodes_scales_down_gracefully(cluster):
    c = cluster
    with operator(c.url):
        start_job(c, nodes=("n1", "n2", "n3"))
        c.patch_spec("j", maxNodes=2)
        gone = wait_for(lambda: [p for p in c.pods("j") if p["metadata"].get("deletionTimestamp")],
                        "a terminating worker")
        assert [p["metadata"]["name"] for p in gone] == ["j-n3"]
        assert gone[0]["metadata"]["deletionGracePeriodSeconds"] == 120  # SIGTERM: save at a step boundary
        st = running(c, "j", ["n1", "n2"])
        assert st["observedGeneration"] == 2 and st["lastRescale"]["reason"] == "node n3 removed: maxNodes=2"


def test_operator_restart_mid_rescale_finishes_the_same_rescale(cluster):
    c = cluster
    with operator(c.url):
        start_job(c)
        c.add_node("n3")
        wait_for(lambda: "n3" in c.pods_by_node("j"), "the new worker on n3")
        started = c.status("j")["lastRescale"]["startedAt"]
    # no operator: the kubelet starts the new worker meanwhile
    c.kubelet("j")
    with operator(c.url):
        st = running(c, "j", ["n1", "n2", "n3"])
        wait_for(lambda: c.events("Rescaled"), "the Rescaled event")  # kopf posts events in the background
    assert st["lastRescale"]["startedAt"] == started and st["lastRescale"]["finishedAt"]
    assert len(c.events("RescaleStarted")) == 1 and len(c.events("Rescaled")) == 1
    assert len(c.pods("j")) == 3


def test_invalid_spec_fails_with_the_field_and_the_operator_keeps_going(cluster):
    c = cluster
    c.add_node("n1")
    with operator(c.url) as runner:
        c.create_job("j", minNodes=3, maxNodes=2)
        st = wait_for(lambda: c.status("j").get("phase") == "Failed" and c.status("j"), "phase Failed")
        cond = next(x for x in st["conditions"] if x["type"] == "SpecValid")
        assert cond["status"] == "False" and cond["message"].startswith("spec.minNodes:")
        assert c.pods("j") == []
        c.patch_spec("j", minNodes=1)  # corrected: the same operator runs it
        running(c, "j", ["n1"])
    assert "fix spec.minNodes" in runner.output  # kopf's PermanentError: retrying the same spec cannot help
    assert runner.exception is None


def test_pod_the_api_server_rejects_fails_the_job_naming_the_template(cluster):
    c = cluster
    c.add_node("n1")
    with operator(c.url):
        c.create_job("j", minNodes=1, maxNodes=1, template={"spec": {"containers": [{"name": "sidecar"}]}})
        st = wait_for(lambda: c.status("j").get("phase") == "Failed" and c.status("j"), "phase Failed")
        cond = next(x for x in st["conditions"] if x["type"] == "SpecValid")
        assert cond["message"] == ('spec.template: the API server rejected the worker pod: '
                                   'Pod "j-n1" is invalid: spec.containers[1].image: Required value')
        c.patch_spec("j", template={"spec": {"containers": [{"name": "sidecar", "image": "busybox"}]}})
        running(c, "j", ["n1"])
        assert [x["name"] for x in c.pods("j")[0]["spec"]["containers"]] == ["worker", "sidecar"]


def test_pod_name_taken_by_another_pod_fails_the_job_naming_its_name(cluster):
    c = cluster
    c.add_node("n1")
    c.core.create_namespaced_pod(NS, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "j-n1"},
                                      "spec": {"containers": [{"name": "x", "image": "busybox"}]}})
    with operator(c.url):
        c.create_job("j", minNodes=1, maxNodes=1)
        st = wait_for(lambda: c.status("j").get("phase") == "Failed" and c.status("j"), "phase Failed")
        cond = next(x for x in st["conditions"] if x["type"] == "SpecValid")
        assert cond["message"] == ("metadata.name: the worker pod name j-n1 is taken by a pod that is not this "
                                   "job's worker: rename the TenplexJob")


def test_conflicting_edit_is_read_again_and_decided_again(cluster, monkeypatch):
    """A 409 on the status write (the job changed after it was read) is retried on the new spec, not lost."""
    c = cluster
    c.add_node("n1")
    c.add_node("n2")
    c.create_job("j", minNodes=1, maxNodes=2, gpusPerNode=8)
    op = Operator(kubernetes.client.ApiClient(kubernetes.client.Configuration(host=c.url)), WorkerSettings())
    real_get, edits = op._get, []

    def racing_get(call, *args, **kwargs):
        out = real_get(call, *args, **kwargs)
        if call == op.custom.get_namespaced_custom_object and not edits:
            edits.append(out["metadata"]["resourceVersion"])
            c.patch_spec("j", maxNodes=1)  # someone edits the job right after the operator read it
        return out
    monkeypatch.setattr(op, "_get", racing_get)
    asyncio.run(op.reconcile(NS, "j", {}, logging.getLogger("test")))
    st = c.status("j")
    assert len(edits) == 1 and st["observedGeneration"] == 2  # the first write was refused (409)
    assert sorted(c.pods_by_node("j")) == ["n1"] and len(c.events("WorkerCreated")) == 1


def test_unreachable_api_is_a_temporary_error():
    config = kubernetes.client.Configuration(host="http://127.0.0.1:9")  # discard port: nothing listens
    config.retries = 0
    op = Operator(kubernetes.client.ApiClient(config), WorkerSettings())
    with pytest.raises(kopf.TemporaryError, match="unreachable"):
        asyncio.run(op.reconcile(NS, "j", {}, logging.getLogger("test")))


@pytest.fixture
def saved_store(tmp_path):
    """A real store process (token) holding versions 1 (step 7), 2 (step 9) and 3 (no training state)."""
    import numpy as np
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    root = tmp_path / "stores" / "n1"
    layout = tiny_layout({"w": ((4,), "float32")}, {"n1/0": [("w", (0,), (4,))]})
    store = Store(root, "n1")
    for version, docs in ((1, {STATE_DOC: {"step": 7}}), (2, {STATE_DOC: {"step": 9}}), (3, None)):
        fill.write_version({"n1": store}, layout, version, lambda t, box: np.zeros(box.lengths, "float32"), docs)
    proc = StoreProcess(root, "n1", token_file=token)
    try:
        yield proc, token
    finally:
        proc.stop()


def test_committed_step_is_read_from_a_real_store(saved_store):
    proc, token = saved_store
    # the name the checkpointer saves under (read from its source: importing it would load torch, ~2-20 s)
    source = Path(tenplex.__file__).with_name("integration") / "versions.py"
    assert f'STATE_DOC = "{STATE_DOC}"' in source.read_text()
    assert committed_step(proc.address, "s3cret") == 9  # version 3 has no training state: the newest with one
    assert committed_step(proc.address, "wrong") is None
    proc.stop()
    assert committed_step(proc.address, "s3cret") is None  # a store that is down: unknown, not an error


def test_status_step_comes_from_the_nodes_store(cluster, saved_store):
    c = cluster
    proc, token = saved_store
    c.add_node("n1", ip="127.0.0.1")
    with operator(c.url, settings=WorkerSettings(store_port=proc.port, token_file=str(token))):
        c.create_job("j", minNodes=1, maxNodes=1, gpusPerNode=8)
        st = running(c, "j", ["n1"])
        assert wait_for(lambda: c.status("j").get("step"), "status.step") == 9
    assert st["nodes"] == 1


def test_kopf_run_of_the_module_with_kubeconfig_login(cluster, tmp_path, monkeypatch):
    """`kopf run -m tenplex.operator.main`: kopf's own login through the kubernetes client and a kubeconfig."""
    from kopf.testing import KopfRunner
    c = cluster
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": c.url}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "u"}}]}))
    # the client reads $KUBECONFIG once, when it is imported (earlier in this process): point it there directly
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("TENPLEX_RECONCILE_INTERVAL", "0.5")
    monkeypatch.setenv("TENPLEX_GPU_RESOURCE", "cpu")
    c.add_node("n1")  # 16 cpu allocatable (see Cluster.add_node)
    # `kopf run -m` registers into kopf's default registry, which KopfRunner sets to this fresh one; with kopf's
    # own kubeconfig login (the one its default registry has), and a fresh import of the module.
    registry = kopf.OperatorRegistry()
    kopf.on.login(registry=registry)(kopf.login_via_client)
    monkeypatch.delitem(sys.modules, "tenplex.operator.main", raising=False)
    with KopfRunner(["run", "-m", "tenplex.operator.main", "--standalone", "--namespace", NS], registry=registry,
                    timeout=60):
        c.create_job("j", minNodes=1, maxNodes=1, gpusPerNode=4)
        st = running(c, "j", ["n1"])
        assert st["worldSize"] == 4
        assert c.pods("j")[0]["spec"]["containers"][0]["resources"]["limits"] == {"cpu": "4"}
