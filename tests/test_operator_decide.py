"""The operator's pure decision: observed nodes, pods and status in, desired pods, status and events out."""

import subprocess
import sys

import pytest

from tenplex.operator.decide import NODE_FAILURE_LIMIT, decide
from tenplex.operator.observe import (NodeState, PodState, Taint, gpu_claim, node_state, pod_state, quantity,
                                      used_by_others)
from tenplex.operator.outcome import Deletion, merge_patch
from tenplex.operator.spec import SpecError, check_name, parse_spec

GPU = "nvidia.com/gpu"
T0, T1, T2 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z", "2026-01-01T00:02:00Z"


def spec(**over):
    return parse_spec({"image": "img", "command": ["train.py", "--steps", "9"], "minNodes": 1, "maxNodes": 3,
                       "gpusPerNode": 8, **over})


def node(name, gpus=8, ready=True, schedulable=True):
    return NodeState(name, ready, schedulable, gpus)


def pod(n, phase="Running", **kw):
    return PodState(f"j-{n}", f"uid-{n}{kw.pop('gen', '')}", n, phase, **kw)


def run(s, nodes, pods, status=None, used=None, now=T1):
    return decide(s, nodes, pods, used_by_others=used or {}, status=status, generation=1, now=now, resource=GPU)


def stable(*names, gpus=8):
    """The status of a job that runs on ``names``, as an earlier decision left it."""
    d = run(spec(), [node(n, gpus) for n in names], [pod(n) for n in names], now=T0)
    assert d.phase == "Running"
    return d.status


def reasons(d):
    return [e.reason for e in d.events]


def fresh(d, *earlier):
    """The reasons of ``d``'s events that no earlier decision had: events are decided again from the state
    each round, and posting them is idempotent by key, so only these are new Events on the job."""
    seen = {e.key for x in earlier for e in x.events}
    return [e.reason for e in d.events if e.key not in seen]


# -- start ----------------------------------------------------------------------------------------------------------
def test_first_start_creates_one_worker_per_qualifying_node_and_is_pending():
    d = run(spec(), [node("n1"), node("n2")], [])
    assert (d.phase, d.target, d.create, d.delete) == ("Pending", ("n1", "n2"), ("n1", "n2"), ())
    assert "lastRescale" not in d.status and "nodeNames" not in d.status


def test_running_once_every_worker_runs_with_the_policy_configuration():
    d = run(spec(), [node("n1"), node("n2")], [pod("n1"), pod("n2", phase="Pending")])
    assert d.phase == "Pending" and d.create == ()
    d = run(spec(), [node("n1"), node("n2")], [pod("n1"), pod("n2")])
    assert d.phase == "Running" and reasons(d) == ["Started"]
    # golden: 2 nodes x 8 GPUs -> tenplex.elastic.policy: tp within the node (8), dp the rest
    assert (d.status["nodes"], d.status["nodeNames"], d.status["worldSize"], d.status["parallel"]) == \
        (2, ["n1", "n2"], 16, "dp=2,tp=8,pp=1")
    ready = next(c for c in d.status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True" and ready["lastTransitionTime"] == T1


def test_parallel_configuration_follows_spec_policy_inputs():
    s = spec(gpusPerNode=4, parallel={"maxTp": 2, "pp": 2, "pinned": {"12": "tp=4,pp=3"}})
    assert s.parallel(2) == "dp=2,tp=2,pp=2"  # 8 ranks: tp capped at 2, pp 2, dp the rest
    assert s.parallel(3) == "dp=1,tp=4,pp=3"  # 12 ranks: the pinned configuration


# -- scale up / down ------------------------------------------------------------------------------------------------
def test_node_joins_scale_up_opens_and_finishes_a_rescale():
    old = stable("n1", "n2")
    nodes = [node("n1"), node("n2"), node("n3")]
    d = run(spec(), nodes, [pod("n1"), pod("n2")], old)
    assert (d.phase, d.target, d.create, d.delete) == ("Rescaling", ("n1", "n2", "n3"), ("n3",), ())
    rec = d.status["lastRescale"]
    assert (rec["type"], rec["reason"], rec["from"]["nodes"], rec["to"]["nodes"], rec["startedAt"]) == \
        ("Rescale", "node n3 added", 2, 3, T1)
    assert rec["to"]["worldSize"] == 24 and rec["to"]["parallel"] == "dp=3,tp=8,pp=1"
    assert reasons(d) == ["RescaleStarted"]
    assert "nodes" not in d.status  # the old world stays in status until the new one runs
    mid = merge_patch(old, d.status)
    assert mid["nodes"] == 2

    d2 = run(spec(), nodes, [pod("n1"), pod("n2"), pod("n3", phase="Pending")], mid, now=T2)
    assert d2.phase == "Rescaling" and d2.create == () and fresh(d2, d) == []
    d3 = run(spec(), nodes, [pod("n1"), pod("n2"), pod("n3")], merge_patch(mid, d2.status), now=T2)
    assert d3.phase == "Running" and fresh(d3, d, d2) == ["Rescaled"]
    assert d3.status["lastRescale"]["finishedAt"] == T2 and d3.status["lastRescale"]["startedAt"] == T1
    assert d3.status["nodes"] == 3 and d3.status["worldSize"] == 24


def test_scale_up_is_capped_at_max_nodes_and_never_moves_a_worker():
    nodes = [node(n) for n in ("n1", "n2", "n3", "n4")]
    d = run(spec(), nodes, [pod("n2"), pod("n3"), pod("n4")], stable("n2", "n3", "n4"))
    assert (d.phase, d.target, d.create, d.delete) == ("Running", ("n2", "n3", "n4"), (), ())
    assert [e.key for e in d.events] == ["Started"]  # decided again from the state: posted once (by its key)


def test_max_nodes_lowered_below_current_deletes_with_grace_period():
    old = stable("n1", "n2", "n3")
    nodes = [node("n1"), node("n2"), node("n3")]
    s = spec(maxNodes=2, terminationGracePeriodSeconds=90)
    d = run(s, nodes, [pod("n1"), pod("n2"), pod("n3")], old)
    assert d.phase == "Rescaling" and d.target == ("n1", "n2") and d.create == ()
    assert d.delete == (Deletion("j-n3", 90, "scale down: maxNodes=2"),)
    assert d.status["lastRescale"]["reason"] == "node n3 removed: maxNodes=2"
    # the next round sees the worker terminating: the smaller world is what runs
    d2 = run(s, nodes, [pod("n1"), pod("n2"), pod("n3", terminating=True)], merge_patch(old, d.status), now=T2)
    assert d2.phase == "Running" and d2.delete == () and d2.status["nodes"] == 2 and fresh(d2, d) == ["Rescaled"]


def test_cordoned_node_gets_no_new_worker_but_keeps_its_own():
    nodes = [node("n1", schedulable=False), node("n2")]
    assert run(spec(), nodes, []).target == ("n2",)
    d = run(spec(), nodes, [pod("n1"), pod("n2")], stable("n1", "n2"))
    assert d.target == ("n1", "n2") and d.delete == ()


def test_pod_deleted_by_someone_else_is_recreated_as_a_recovery():
    old = stable("n1", "n2")
    d = run(spec(), [node("n1"), node("n2")], [pod("n1"), pod("n2", terminating=True)], old)
    assert d.create == () and d.delete == () and d.phase == "Recovering"  # same name: wait until it is gone
    assert d.status["lastRescale"]["reason"] == "worker on n2 missing"
    d2 = run(spec(), [node("n1"), node("n2")], [pod("n1")], merge_patch(old, d.status))
    assert d2.create == ("n2",) and fresh(d2, d) == []


# -- lost nodes and failed pods -------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["NotReady", "gone"])
def test_node_lost_force_deletes_its_worker_and_continues_smaller(how):
    old = stable("n1", "n2", "n3")
    nodes = [node("n1"), node("n3")] + ([node("n2", ready=False)] if how == "NotReady" else [])
    d = run(spec(), nodes, [pod("n1"), pod("n2"), pod("n3")], old)
    assert d.delete == (Deletion("j-n2", 0, f"node n2 is {how}: worker lost"),)
    assert d.phase == "Running" and d.target == ("n1", "n3") and d.status["nodes"] == 2
    rec = d.status["lastRescale"]
    assert (rec["type"], rec["reason"], rec["finishedAt"]) == ("Recovery", f"node n2 is {how}", T1)
    assert reasons(d) == ["RecoveryStarted", "Recovered"]
    assert "n2" not in d.status["failures"]  # a lost node is not a failed worker


def test_node_lost_below_min_nodes_waits_pending_and_keeps_the_survivors():
    s = spec(minNodes=3)
    d = run(s, [node("n1"), node("n2", ready=False), node("n3")], [pod("n1"), pod("n2"), pod("n3")],
            stable("n1", "n2", "n3"))
    assert d.phase == "Pending" and d.create == ()
    assert d.delete == (Deletion("j-n2", 0, "node n2 is NotReady: worker lost"),)
    cond = next(c for c in d.status["conditions"] if c["type"] == "NodesAvailable")
    assert cond["status"] == "False" and cond["reason"] == "InsufficientNodes"
    assert "needs minNodes=3" in cond["message"] and "n2: NotReady" in cond["message"]
    assert reasons(d) == ["InsufficientNodes"]
    # the same observation again (the next round, or a restarted operator) posts no second event
    again = run(s, [node("n1"), node("n2", ready=False), node("n3")], [pod("n1"), pod("n3")],
                merge_patch(stable("n1", "n2", "n3"), d.status), now=T2)
    assert fresh(again, d) == [] and [e.key for e in again.events] == [f"InsufficientNodes/{T1}"]


def test_failed_pod_is_deleted_then_replaced_on_its_healthy_node():
    old = stable("n1", "n2", "n3")
    nodes = [node("n1"), node("n2"), node("n3")]
    d = run(spec(), nodes, [pod("n1"), pod("n2", phase="Failed"), pod("n3")], old)
    assert d.delete == (Deletion("j-n2", 0, "worker j-n2 failed on n2"),)
    assert d.create == () and d.target == ("n1", "n2", "n3")  # same name: created once the failed pod is gone
    assert d.phase == "Recovering" and d.status["failures"] == {"n2": ["uid-n2"]}
    assert d.status["lastRescale"]["reason"] == "worker j-n2 failed on n2" and reasons(d) == ["RecoveryStarted"]
    st = merge_patch(old, d.status)
    d2 = run(spec(), nodes, [pod("n1"), pod("n3")], st, now=T2)
    assert d2.create == ("n2",) and d2.phase == "Recovering" and fresh(d2, d) == []
    assert d2.status["lastRescale"]["startedAt"] == T1
    st = merge_patch(st, d2.status)
    d3 = run(spec(), nodes, [pod("n1"), pod("n2", gen="b"), pod("n3")], st, now=T2)
    assert d3.phase == "Running" and fresh(d3, d, d2) == ["Recovered"] and d3.status["failures"] == {"n2": ["uid-n2"]}


def test_crash_looping_pod_counts_once_and_a_node_that_keeps_failing_is_left_out():
    old = stable("n1", "n2", "n3")
    nodes = [node("n1"), node("n2"), node("n3")]
    looping = pod("n2", crash_looping=True)
    d = run(spec(), nodes, [pod("n1"), looping, pod("n3")], old)
    assert d.delete == (Deletion("j-n2", 120, "worker j-n2 failed on n2"),)  # it may still be saving: grace
    again = run(spec(), nodes, [pod("n1"), looping, pod("n3")], merge_patch(old, d.status))
    assert again.status["failures"] == {"n2": ["uid-n2"]}  # the same pod seen twice is one failure
    flaky = merge_patch(old, {"failures": {"n2": [f"u{i}" for i in range(NODE_FAILURE_LIMIT)]}})
    d = run(spec(), nodes, [pod("n1"), pod("n3")], flaky)
    assert d.target == ("n1", "n3") and d.create == () and d.phase == "Running"
    assert "n2 removed: 3 failed workers" in d.status["lastRescale"]["reason"]


def test_more_failures_than_backoff_limit_fails_the_job():
    s = spec(backoffLimit=2)
    old = merge_patch(stable("n1", "n2"), {"failures": {"n1": ["a"], "n2": ["b"]}})
    d = run(s, [node("n1"), node("n2")], [pod("n1", phase="Failed", gen="c"), pod("n2")], old)
    assert d.phase == "Failed" and d.create == ()
    assert set(d.delete) == {Deletion("j-n1", 0, "worker j-n1 failed on n1"), Deletion("j-n2", 120, "the job failed")}
    assert reasons(d) == ["BackoffLimitExceeded"]
    cond = next(c for c in d.status["conditions"] if c["type"] == "WorkersHealthy")
    assert cond["status"] == "False" and cond["message"].startswith("3 workers failed, more than backoffLimit=2")


# -- GPUs -------------------------------------------------------------------------------------------------------------
def test_too_few_gpus_for_min_nodes_is_pending_and_names_what_is_missing():
    s = spec(minNodes=2)
    d = run(s, [node("n1", gpus=4), node("n2"), node("n3")], [], used={"n2": 4, "n3": 1})
    assert d.phase == "Pending" and d.create == () and d.target == ()
    msg = next(c for c in d.status["conditions"] if c["type"] == "NodesAvailable")["message"]
    assert msg == ("needs minNodes=2 nodes with 8 free nvidia.com/gpu each; 0 qualify; "
                   "n1: 4 free nvidia.com/gpu; n2: 4 free nvidia.com/gpu; n3: 7 free nvidia.com/gpu")
    d = run(s, [node("n1", gpus=4), node("n2"), node("n3")], [], used={"n3": 1, "n2": 0})
    assert d.phase == "Pending" and "1 qualify (n2)" in next(
        c for c in d.status["conditions"] if c["type"] == "NodesAvailable")["message"]


def test_gpu_accounting_from_raw_objects():
    raw_node = {"metadata": {"name": "n1", "labels": {"tenplex.io/gpu-node": "true"}},
                "spec": {"unschedulable": True, "taints": [{"key": GPU, "effect": "NoSchedule"}]},
                "status": {"allocatable": {GPU: "8"}, "conditions": [{"type": "Ready", "status": "True"}]}}
    assert node_state(raw_node, GPU) == NodeState("n1", True, False, 8, True, (Taint(GPU, "", "NoSchedule"),))
    raw_node["metadata"]["labels"] = {}
    assert not node_state(raw_node, GPU).store  # no store DaemonSet pod there
    assert node_state(raw_node, "cpu").allocatable == 0
    assert [quantity(q) for q in ("8", 8, "3500m", "2k", "1Ki", None)] == [8, 8, 3, 2000, 1024, 0]

    def p(ns, job, node, gpus, phase="Running"):
        return {"metadata": {"namespace": ns, "name": f"{job}-{node}", "labels": {"tenplex.io/job": job}},
                "spec": {"nodeName": node, "containers": [{"resources": {"limits": {GPU: str(gpus)}}}]},
                "status": {"phase": phase}}
    pods = [p("ml", "j", "n1", 8), p("ml", "other", "n1", 2), p("team", "j", "n1", 1), p("ml", "x", "n2", 4, "Failed")]
    claims = [c for c in (gpu_claim(pod, GPU) for pod in pods) if c]
    assert claims[1] == ("n1", ("ml", "other"), 2) and len(claims) == 3  # a finished pod holds nothing
    assert used_by_others(claims, ("ml", "j")) == {"n1": 3}
    unbound = {"metadata": {"annotations": {"tenplex.io/node": "n3"}}, "spec": {"containers": [
        {"resources": {"requests": {GPU: "8"}}}]}}
    assert gpu_claim(unbound, GPU) == ("n3", (None, None), 8)  # placed by an operator, not yet bound
    raw_pod = {"metadata": {"name": "j-n1", "uid": "u", "annotations": {"tenplex.io/node": "n1"},
                            "deletionTimestamp": "x"},
               "status": {"phase": "Running",
                          "containerStatuses": [{"state": {"waiting": {"reason": "CrashLoopBackOff"}}}]}}
    assert pod_state(raw_pod) == PodState("j-n1", "u", "n1", "Running", terminating=True, crash_looping=True)


# -- restarts, idempotency ------------------------------------------------------------------------------------------
def test_operator_restart_mid_rescale_continues_the_same_rescale():
    old = stable("n1", "n2")
    nodes = [node("n1"), node("n2"), node("n3")]
    first = run(spec(), nodes, [pod("n1"), pod("n2")], old, now=T1)
    # the operator died after writing the status, before creating the pod; a new one starts at T2
    d = run(spec(), nodes, [pod("n1"), pod("n2")], merge_patch(old, first.status), now=T2)
    assert d.create == ("n3",) and d.phase == "Rescaling"
    # it died before posting too: the same RescaleStarted is decided again (same key: posted once in all)
    key = f"Started/Rescale/{T1}/n1=8,n2=8/n1=8,n2=8,n3=8"
    assert [(e.reason, e.key) for e in d.events] == [("RescaleStarted", key)] == \
        [(e.reason, e.key) for e in first.events]
    assert merge_patch({}, d.status)["lastRescale"] == merge_patch({}, first.status)["lastRescale"]  # startedAt T1


def test_deciding_twice_on_the_same_observation_is_the_same_decision():
    old = stable("n1", "n2", "n3")
    nodes = [node("n1"), node("n2"), node("n3", ready=False)]
    pods = [pod("n1"), pod("n2", phase="Failed"), pod("n3")]
    assert run(spec(), nodes, pods, old) == run(spec(), nodes, pods, old)
    d = run(spec(), nodes, pods, old)
    applied = merge_patch(old, d.status)
    assert merge_patch(applied, run(spec(), nodes, pods, applied).status) == applied  # a fixed point


def test_spec_that_no_longer_allows_the_running_world_still_decides():
    # 2 nodes of 8 ran; now pp=24 needs at least 3 nodes: the record's `from` is what ran, not recomputed
    d = run(spec(minNodes=3, parallel={"pp": 24}), [node(n) for n in ("n1", "n2", "n3")], [pod("n1"), pod("n2")],
            stable("n1", "n2"))
    assert d.phase == "Rescaling" and d.create == ("n3",)
    assert d.status["lastRescale"]["from"] == {"nodes": 2, "nodeNames": ["n1", "n2"], "nodeGpus": {"n1": 8, "n2": 8},
                                               "worldSize": 16, "parallel": "dp=2,tp=8,pp=1"}
    assert d.status["lastRescale"]["to"]["parallel"] == "dp=1,tp=1,pp=24"


def test_target_change_mid_rescale_starts_a_new_record():
    old = stable("n1", "n2")
    nodes = [node("n1"), node("n2"), node("n3")]
    first = run(spec(), nodes, [pod("n1"), pod("n2")], old)
    d = run(spec(maxNodes=4), nodes + [node("n4")], [pod("n1"), pod("n2"), pod("n3", phase="Pending")],
            merge_patch(old, first.status), now=T2)
    assert d.status["lastRescale"]["to"]["nodes"] == 4 and d.status["lastRescale"]["startedAt"] == T2
    assert d.create == ("n4",) and reasons(d) == ["RescaleStarted"]


def test_decision_modules_need_neither_kopf_nor_kubernetes():
    code = ("import sys, tenplex.operator.decide, tenplex.operator.outcome, tenplex.operator.spec, "
            "tenplex.operator.observe, tenplex.operator.settings, tenplex.cli; tenplex.cli.build_parser(); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'kopf', 'kubernetes'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


# -- spec --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("over, field", [
    ({"minNodes": 4, "maxNodes": 2}, "spec.minNodes"),
    ({"minNodes": 0}, "spec.minNodes"),
    ({"maxNodes": None}, "spec.maxNodes"),
    ({"image": ""}, "spec.image"),
    ({"command": "train.py"}, "spec.command"),
    ({"gpusPerNode": "8"}, "spec.gpusPerNode"),
    ({"parallel": {"pinned": {"16": "dp=4,tp=8"}}}, "spec.parallel.pinned['16']"),
    ({"parallel": {"pinned": {"12": "tp=4"}}}, "spec.parallel.pinned['12']"),
    ({"parallel": {"pp": 16}}, "spec.parallel"),
    ({"env": [{"value": "x"}]}, "spec.env[0]"),
    ({"backoffLimit": -1}, "spec.backoffLimit"),
    ({"inPlace": "true"}, "spec.inPlace"),
])
def test_invalid_spec_names_the_field(over, field):
    with pytest.raises(SpecError) as e:
        spec(**over)
    assert e.value.field == field and str(e.value).startswith(field)


def test_invalid_spec_is_failed_with_a_condition_and_touches_no_pod():
    with pytest.raises(SpecError) as e:
        spec(minNodes=4, maxNodes=2)
    d = run(e.value, [node("n1")], [pod("n1")], stable("n1"))
    assert (d.phase, d.create, d.delete) == ("Failed", (), ())
    cond = next(c for c in d.status["conditions"] if c["type"] == "SpecValid")
    assert cond["status"] == "False" and cond["message"] == "spec.minNodes: minNodes=4 is greater than maxNodes=2"
    assert reasons(d) == ["InvalidSpec"]
    with pytest.raises(SpecError, match="metadata.name"):
        check_name("x" * 64)


def test_succeeded_worker_finishes_the_job():
    d = run(spec(), [node("n1"), node("n2")], [pod("n1", phase="Succeeded"), pod("n2")], stable("n1", "n2"))
    assert (d.phase, d.create, d.delete, reasons(d)) == ("Succeeded", (), (), ["Succeeded"])
    assert run(spec(), [node("n1")], [], merge_patch(stable("n1"), d.status)).phase == "Succeeded"
    # a worker that left on scale-down (deleted, then exited 0) is not the end of the job
    left = run(spec(maxNodes=1), [node("n1"), node("n2")], [pod("n1"), pod("n2", phase="Succeeded", terminating=True)],
               stable("n1", "n2"))
    assert left.phase == "Running" and left.status["nodes"] == 1


def test_cli_says_what_is_missing_in_one_line(capsys, monkeypatch, tmp_path):
    from tenplex.cli import main
    assert main(["operator", "run"]) == 2
    assert capsys.readouterr().err.strip() == ("tenplex operator: error: say which TenplexJobs to watch: "
                                               "--all-namespaces, or --namespace NAME")
    kube_config = pytest.importorskip("kubernetes.config.kube_config")
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "missing"))  # read at import
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main(["operator", "run", "--all-namespaces"]) == 2
    assert "no Kubernetes credentials" in capsys.readouterr().err


# -- stores, taints, unschedulable workers, dropped scale-ups ---------------------------------------------------------
def test_only_nodes_with_a_store_and_tolerated_taints_qualify():
    gpu_taint = Taint(GPU, "present", "NoSchedule")
    nodes = [node("n1"), NodeState("n2", True, True, 8, store=False),  # no store DaemonSet pod: no worker
             NodeState("n3", True, True, 8, taints=(gpu_taint,)),  # the GPU taint: the worker tolerates it
             NodeState("n4", True, True, 8, taints=(Taint("node-role.kubernetes.io/control-plane"),)),
             NodeState("n5", True, True, 8, taints=(Taint("team", "a", "PreferNoSchedule"),))]  # steers only
    d = run(spec(maxNodes=5), nodes, [])
    assert d.target == ("n1", "n3", "n5")
    s = spec(minNodes=4, maxNodes=5)
    msg = next(c for c in run(s, nodes, []).status["conditions"] if c["type"] == "NodesAvailable")["message"]
    assert msg.endswith("n2: no tenplex store (not labelled tenplex.io/gpu-node=true); "
                        "n4: taint node-role.kubernetes.io/control-plane=:NoSchedule not tolerated")
    # a toleration in the template lets the worker there (and goes into the pod: tests/test_k8s_manifests.py)
    tolerant = spec(maxNodes=5, template={"spec": {"tolerations": [
        {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists", "effect": "NoSchedule"}]}})
    assert run(tolerant, nodes, []).target == ("n1", "n3", "n4", "n5")


def test_a_new_noschedule_taint_keeps_the_running_worker_but_noexecute_evicts_it():
    old = stable("n1", "n2")
    pods = [pod("n1"), pod("n2")]
    tainted = [node("n1"), NodeState("n2", True, True, 8, taints=(Taint("maintenance"),))]
    assert run(spec(), tainted, pods, old).delete == ()
    evicting = [node("n1"), NodeState("n2", True, True, 8, taints=(Taint("maintenance", "", "NoExecute"),))]
    d = run(spec(), evicting, pods, old)
    assert [x.pod for x in d.delete] == ["j-n2"] and d.target == ("n1",)


def test_worker_unschedulable_past_the_grace_period_is_replaced_elsewhere_and_reported():
    nodes = [node("n1"), node("n2"), node("n3")]
    why = "0/3 nodes are available: 1 node(s) had untolerated taint {dedicated: infra}"
    stuck = pod("n2", phase="Pending", unschedulable_since=T0, unschedulable_message=why)
    s = spec(maxNodes=2)
    first = run(s, nodes, [pod("n1"), stuck], now=T0)  # just noticed: within the grace period (60 s)
    assert first.delete == () and first.status["unschedulable"] is None
    d = run(s, nodes, [pod("n1"), stuck], first.status, now=T1)  # 60 s later
    assert d.delete == (Deletion("j-n2", 0, f"worker j-n2 could not be scheduled on n2 for 60s: {why}"),)
    assert d.target == ("n1", "n3") and d.create == ("n3",) and d.status["unschedulable"] == {"n2": why}
    cond = next(c for c in d.status["conditions"] if c["type"] == "WorkersScheduled")
    assert (cond["status"], cond["reason"]) == ("False", "Unschedulable") and f"n2: {why}" in cond["message"]
    assert [(e.type, e.reason, e.message) for e in d.events] == [("Warning", "WorkerUnschedulable",
                                                                  f"node n2 left out: {why}")]
    st = merge_patch(first.status, d.status)
    d2 = run(s, nodes, [pod("n1"), pod("n3")], st, now=T2)
    assert d2.status["unschedulable"] == {"n2": why} and "n2" not in d2.target and fresh(d2, d) == ["Started"]
    # an edit of the spec (a toleration, say) gives the node another chance
    d3 = decide(s, nodes, [pod("n1"), pod("n3")], used_by_others={}, status=merge_patch(st, d2.status),
                generation=2, now=T2, resource=GPU)
    assert "unschedulable" not in merge_patch(st, d3.status)
    assert next(c for c in d3.status["conditions"] if c["type"] == "WorkersScheduled")["status"] == "True"


def test_joining_node_lost_before_its_worker_ran_closes_the_record_as_abandoned():
    old = stable("n1", "n2")
    nodes = [node("n1"), node("n2"), node("n3")]
    first = run(spec(), nodes, [pod("n1"), pod("n2")], old)
    assert first.phase == "Rescaling"
    st = merge_patch(old, first.status)
    gone = [node("n1"), node("n2"), node("n3", ready=False)]
    d = run(spec(), gone, [pod("n1"), pod("n2"), pod("n3", phase="Pending")], st, now=T2)
    assert d.phase == "Running" and d.target == ("n1", "n2")
    rec = merge_patch(st, d.status)["lastRescale"]
    assert (rec["startedAt"], rec["finishedAt"], rec["abandoned"]) == (T1, T2, "n3: node n3 is NotReady")
    assert fresh(d, first) == ["RescaleAbandoned"]
    ev = next(e for e in d.events if e.reason == "RescaleAbandoned")
    assert ev.type == "Warning" and ev.message == ("2 -> 3 nodes, world 16 -> 24 (dp=2,tp=8,pp=1 -> dp=3,tp=8,pp=1): "
                                                   "node n3 added: dropped, n3: node n3 is NotReady")
    # the next scale-up is a new record again (`abandoned` removed by the merge patch)
    d2 = run(spec(), nodes, [pod("n1"), pod("n2")], merge_patch(st, d.status), now=T2)
    assert "abandoned" not in merge_patch(merge_patch(st, d.status), d2.status)["lastRescale"]


# -- a node with fewer healthy GPUs (minGpusPerNode) -----------------------------------------------------------------
def test_node_that_lost_a_gpu_keeps_its_worker_in_place_with_the_gpus_left():
    """The device plugin took an unhealthy GPU out of n2's allocatable: with minGpusPerNode=6 the node stays and its
    worker too (its tenplex run drops the failed device itself), a Resize in place; the world is 8+7."""
    s = spec(minGpusPerNode=6, maxNodes=2, parallel={"maxTp": 1})
    old = stable("n1", "n2")
    nodes = [node("n1"), node("n2", gpus=7)]
    full = [pod("n1", gpus=8), pod("n2", gpus=8)]
    d = run(s, nodes, full, old)
    assert (d.phase, d.target, d.create, d.delete) == ("Running", ("n1", "n2"), (), ())
    assert d.status["resizedInPlace"] == {"n2": {"pod": "uid-n2", "gpus": 7}}
    rec = d.status["lastRescale"]
    assert (rec["type"], rec["reason"], rec["finishedAt"]) == ("Resize", "node n2: 8 -> 7 nvidia.com/gpu, in place", T1)
    # golden: 8+7 ranks, tp=1 (maxTp=1): every GPU trains
    assert (rec["from"]["nodeGpus"], rec["from"]["worldSize"]) == ({"n1": 8, "n2": 8}, 16)
    assert (rec["to"]["nodeGpus"], rec["to"]["worldSize"], rec["to"]["parallel"]) == \
        ({"n1": 8, "n2": 7}, 15, "dp=15,tp=1,pp=1")
    assert reasons(d) == ["ResizeStarted", "Resized"] and d.events[0].message.startswith("2 -> 2 nodes, world 16 -> 15")
    assert (d.status["nodeGpus"], d.status["worldSize"], d.status["parallel"]) == \
        ({"n1": 8, "n2": 7}, 15, "dp=15,tp=1,pp=1")
    settled = merge_patch(old, d.status)
    d2 = run(s, nodes, full, settled, now=T2)  # settled: nothing to do, no new event
    assert (d2.phase, d2.delete, d2.create, fresh(d2, d)) == ("Running", (), (), [])
    assert merge_patch(settled, d2.status)["resizedInPlace"] == {"n2": {"pod": "uid-n2", "gpus": 7}}
    # one more GPU lost there: still in place, 6
    d3 = run(s, [node("n1"), node("n2", gpus=6)], full, settled, now=T2)
    assert (d3.delete, d3.status["resizedInPlace"]["n2"]["gpus"], d3.status["lastRescale"]["reason"]) == \
        ((), 6, "node n2: 7 -> 6 nvidia.com/gpu, in place")
    # the GPU is healthy again: a pod's request cannot grow, so the worker is recreated requesting 8 (it saves)
    d4 = run(s, [node("n1"), node("n2")], full, settled, now=T2)
    assert d4.phase == "Resizing" and d4.delete == (Deletion("j-n2", 120, "resize: node n2: 7 -> 8 nvidia.com/gpu"),)
    mid = merge_patch(settled, d4.status)
    # while it terminates, its node still comes first: a free node that sorts before it does not take its place
    terminating = run(s, [node("a3"), node("n1"), node("n2")], [full[0], pod("n2", gpus=8, terminating=True)], mid,
                      now=T2)
    assert (terminating.target, terminating.create) == (("n1", "n2"), ())
    d5 = run(s, [node("n1"), node("n2")], [full[0]], mid, now=T2)  # gone: recreated with 8
    assert (d5.phase, d5.create, d5.gpus) == ("Resizing", ("n2",), {"n1": 8, "n2": 8})
    d6 = run(s, [node("n1"), node("n2")], [full[0], pod("n2", gen="b", gpus=8)], merge_patch(mid, d5.status), now=T2)
    after = merge_patch(merge_patch(mid, d5.status), d6.status)
    assert d6.phase == "Running" and "resizedInPlace" not in after and after["nodeGpus"] == {"n1": 8, "n2": 8}


def test_node_that_lost_every_gpu_or_too_many_loses_its_worker():
    """A worker stays in place only while its node qualifies: below minGpusPerNode (0 when every GPU is lost) it is
    deleted (a scale-down), and a worker that failed is replaced requesting what the node has now."""
    s = spec(minGpusPerNode=6, parallel={"maxTp": 1})
    full = [pod("n1", gpus=8), pod("n2", gpus=8)]
    for left in (0, 5):
        d = run(s, [node("n1"), node("n2", gpus=left)], full, stable("n1", "n2"))
        assert (d.phase, d.target) == ("Rescaling", ("n1",))
        assert d.delete == (Deletion("j-n2", 120, f"scale down: {left} free nvidia.com/gpu"),)
        assert merge_patch(stable("n1", "n2"), d.status)["lastRescale"]["to"]["nodeGpus"] == {"n1": 8}
    nodes = [node("n1"), node("n2", gpus=7)]
    settled = merge_patch(stable("n1", "n2"), run(s, nodes, full, stable("n1", "n2")).status)
    d = run(s, nodes, [full[0], pod("n2", phase="Failed", gpus=8)], settled, now=T2)
    d2 = run(s, nodes, [full[0]], merge_patch(settled, d.status), now=T2)
    assert (d2.create, d2.gpus["n2"]) == (("n2",), 7)


def test_worker_not_running_yet_on_a_node_that_lost_a_gpu_is_recreated_with_the_gpus_left():
    """Only a running pod holds its GPUs: one still Pending asks for 8 that the scheduler can no longer find."""
    s = spec(minGpusPerNode=6)
    d = run(s, [node("n1"), node("n2", gpus=7)], [pod("n1", gpus=8), pod("n2", phase="Pending", gpus=8)])
    assert (d.delete, d.create) == ((Deletion("j-n2", 120, "resize: node n2: 8 -> 7 nvidia.com/gpu"),), ())
    assert "resizedInPlace" not in merge_patch({}, d.status)


def test_records_started_in_the_same_second_have_their_own_events():
    """A scale-down that finished in second T and a resize in place that opens and closes in T: the Resized event
    is not taken for the Rescaled one (event keys name the record, not only its start)."""
    s = spec(minGpusPerNode=6)
    three = merge_patch(stable("n1", "n2"), run(s, [node(n) for n in ("n1", "n2", "n3")],
                                                [pod(n) for n in ("n1", "n2", "n3")], stable("n1", "n2")).status)
    down = run(s, [node("n1"), node("n2")], [pod("n1", gpus=8), pod("n2", gpus=8)], three, now=T2)
    resize = run(s, [node("n1"), node("n2", gpus=7)], [pod("n1", gpus=8), pod("n2", gpus=8)],
                 merge_patch(three, down.status), now=T2)
    assert reasons(down) == ["RescaleStarted", "Rescaled"] and fresh(resize, down) == ["ResizeStarted", "Resized"]


def test_status_forgets_a_node_that_left():
    """nodeGpus and the rescale record are written whole: a node that left is not kept by the merge patch."""
    s = spec()
    three = merge_patch(stable("n1", "n2"), run(s, [node(n) for n in ("n1", "n2", "n3")],
                                                [pod(n) for n in ("n1", "n2", "n3")], stable("n1", "n2")).status)
    assert three["nodeGpus"] == {"n1": 8, "n2": 8, "n3": 8}
    d = run(s, [node("n1"), node("n2")], [pod("n1"), pod("n2")], three, now=T2)
    two = merge_patch(three, d.status)
    assert (two["nodeNames"], two["nodeGpus"]) == (["n1", "n2"], {"n1": 8, "n2": 8})
    assert two["lastRescale"]["to"]["nodeGpus"] == {"n1": 8, "n2": 8}


def test_default_min_gpus_per_node_leaves_a_node_that_lost_a_gpu_out():
    """minGpusPerNode defaults to gpusPerNode: a node with 7 of 8 is scaled down (its worker saves on SIGTERM)."""
    d = run(spec(), [node("n1"), node("n2", gpus=7)], [pod("n1", gpus=8), pod("n2", gpus=8)], stable("n1", "n2"))
    assert (d.phase, d.target) == ("Rescaling", ("n1",))
    assert d.delete == (Deletion("j-n2", 120, "scale down: 7 free nvidia.com/gpu"),)
    assert d.status["lastRescale"]["type"] == "Rescale"


def test_min_gpus_per_node_qualifies_new_nodes_with_what_they_have_fuller_nodes_first():
    s = spec(minGpusPerNode=4, maxNodes=2, parallel={"maxTp": 4})
    # n1: 3 free (another job holds 5), n2: 6, n3: 8 -> n1 is out, n3 then n2
    d = run(s, [node("n1"), node("n2", gpus=6), node("n3")], [], used={"n1": 5})
    assert (d.target, d.create, d.gpus) == (("n2", "n3"), ("n2", "n3"), {"n2": 6, "n3": 8})
    d = run(s, [node("n1"), node("n2", gpus=6), node("n3")], [pod("n2", gpus=6), pod("n3", gpus=8)],
            used={"n1": 5})
    assert (d.phase, d.status["nodeGpus"], d.status["worldSize"]) == ("Running", {"n2": 6, "n3": 8}, 14)
    assert d.status["parallel"] == "dp=3,tp=4,pp=1 (2 idle)"  # golden: n2 trains on 4 of its 6 (tp=4)
    d = run(spec(minGpusPerNode=7, minNodes=2), [node("n1", gpus=6), node("n2")], [])
    assert d.phase == "Pending"
    assert "needs minNodes=2 nodes with 7 free nvidia.com/gpu each; 1 qualify (n2); n1: 6 free" in \
        next(c["message"] for c in d.status["conditions"] if c["type"] == "NodesAvailable")


def test_a_pin_that_does_not_fit_uneven_nodes_is_pending_not_a_crash():
    s = spec(minGpusPerNode=7, parallel={"pinned": {"15": "tp=8,dp=2"}})
    d = run(s, [node("n1"), node("n2", gpus=7)], [])
    assert (d.phase, d.create, reasons(d)) == ("Pending", (), ["NoConfiguration"])
    cond = next(c for c in d.status["conditions"] if c["type"] == "NodesAvailable")
    assert cond["message"].startswith("no parallel configuration for the 2 nodes that qualify (n1: 8, n2: 7): "
                                      "pinned for world size 15")


@pytest.mark.parametrize("over, field, text", [
    ({"minGpusPerNode": 9}, "spec.minGpusPerNode", "minGpusPerNode=9 is greater than gpusPerNode=8"),
    ({"minGpusPerNode": 0}, "spec.minGpusPerNode", "must be an integer >= 1"),
    ({"minGpusPerNode": 1, "minNodes": 1, "parallel": {"pp": 2}}, "spec.parallel",
     "no parallel configuration for 1 nodes with 1 GPUs (1 ranks)"),
])
def test_min_gpus_per_node_spec_errors(over, field, text):
    with pytest.raises(SpecError) as e:
        spec(**over)
    assert e.value.field == field and text in str(e.value)


def test_min_gpus_per_node_defaults_to_gpus_per_node_and_the_pod_requests_what_the_node_has():
    from tenplex.operator.pods import worker_pod
    from tenplex.operator.settings import WorkerSettings

    assert spec().min_gpus_per_node == 8 and spec(minGpusPerNode=6).min_gpus_per_node == 6
    # golden (README): tp groups stay within a node, so under the default maxTp a node of 7 next to one of 8 idles
    assert spec(minGpusPerNode=7).parallel([8, 7]) == "dp=1,tp=8,pp=1 (7 idle)"
    job = {"apiVersion": "tenplex.io/v1alpha1", "kind": "TenplexJob",
           "metadata": {"name": "j", "namespace": "default", "uid": "u"}}
    raw = worker_pod(job, spec(minGpusPerNode=6), "n2", WorkerSettings(), 7)
    container = raw["spec"]["containers"][0]
    assert container["resources"] == {"limits": {GPU: "7"}, "requests": {GPU: "7"}}
    command = container["command"]
    assert command[command.index("--nproc-per-node") + 1] == "7"
    assert pod_state(raw, GPU).gpus == 7 and pod_state(raw).gpus is None
