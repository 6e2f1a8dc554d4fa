"""The operator's metrics, counted by real reconciliations against the KMock API server: a decision that
creates workers, a conflicting edit (409, decided again), an unreachable API; and their exposition names."""

from __future__ import annotations

import asyncio
import logging

import pytest

pytest.importorskip("kmock")  # Python 3.11+ (setup.cfg installs it there)

import kopf  # noqa: E402
import kubernetes  # noqa: E402
from k8s_harness import NS, Cluster, api_server  # noqa: E402
from prometheus_client import generate_latest  # noqa: E402

from tenplex.operator.handlers import Operator  # noqa: E402
from tenplex.operator.settings import WorkerSettings  # noqa: E402
from tenplex.ops.metrics import OperatorMetrics  # noqa: E402


def _value(metrics: OperatorMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_reconciliations_conflicts_and_decisions_are_counted(monkeypatch):
    with api_server() as url:
        c = Cluster(url)
        c.add_node("n1")
        c.create_job("j", minNodes=1, maxNodes=2, gpusPerNode=8)
        op = Operator(kubernetes.client.ApiClient(kubernetes.client.Configuration(host=url)), WorkerSettings())
        monkeypatch.setattr(kopf, "event", lambda obj, **kw: None)  # kopf posts events only in a running operator
        real_get, edited = op._get, []

        def racing_get(call, *args, **kwargs):
            out = real_get(call, *args, **kwargs)
            if call == op.custom.get_namespaced_custom_object and not edited:
                edited.append(True)
                c.patch_spec("j", maxNodes=1)  # an edit right after the read: the status write gets 409
            return out

        monkeypatch.setattr(op, "_get", racing_get)
        asyncio.run(op.reconcile(NS, "j", {}, logging.getLogger("test")))
        assert sorted(c.pods_by_node("j")) == ["n1"]
    m = op.metrics
    assert _value(m, "tenplex_operator_reconciliations_total", outcome="conflict") == 1
    assert _value(m, "tenplex_operator_reconciliations_total", outcome="ok") == 1
    assert _value(m, "tenplex_operator_api_errors_total", status="409") == 1
    assert _value(m, "tenplex_operator_decision_duration_seconds_count") == 1  # the decision that was written


def test_an_unreachable_api_is_an_api_error():
    config = kubernetes.client.Configuration(host="http://127.0.0.1:9")  # discard port: nothing listens
    config.retries = 0
    op = Operator(kubernetes.client.ApiClient(config), WorkerSettings())
    with pytest.raises(kopf.TemporaryError):
        asyncio.run(op.reconcile(NS, "j", {}, logging.getLogger("test")))
    assert _value(op.metrics, "tenplex_operator_api_errors_total", status="0") == 1
    assert _value(op.metrics, "tenplex_operator_reconciliations_total", outcome="error") == 1


def test_rescales_and_recoveries_come_from_the_decisions_events():
    m = OperatorMetrics()
    m.observe_events(["Started", "RescaleStarted", "Rescaled", "RecoveryStarted", "RescaleStarted", "Recovered"])
    assert (_value(m, "tenplex_operator_rescales_total"), _value(m, "tenplex_operator_recoveries_total")) == (2, 1)
    names = {line.split("{")[0].split(" ")[0] for line in generate_latest(m.registry).decode().splitlines()
             if not line.startswith("#")}
    assert {"tenplex_operator_rescales_total", "tenplex_operator_recoveries_total",
            "tenplex_operator_decision_duration_seconds_bucket"} <= names
