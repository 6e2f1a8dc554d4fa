"""Prometheus metrics of the store server, ``tenplex run``'s workers (``Job``) and the operator.

May import: grpc, prometheus_client, ``tenplex.devices`` and the standard library.

Each component keeps its metrics in a registry of its own (several components may share a process in
tests) and :func:`serve` exposes one on ``--metrics-port``. Names follow Prometheus' conventions: the unit
in the name (``_bytes``, ``_seconds``), ``_total`` on counters (prometheus_client adds it). Labels never
carry a step, a version or a tensor: only bounded sets (peer host, gRPC method and code, outcome, a job's
parallel configuration).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Mapping

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ..devices import host_of

log = logging.getLogger(__name__)
# From a 10 ms control call to a multi-minute transformation.
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
UNKNOWN_PEER = "unknown"  # the peer_host of bytes sent to a reader that declared no host (one that predates it)
PORT_ENV = "TENPLEX_METRICS_PORT"   # tenplex run -> its workers: the first worker's port (+ LOCAL_RANK)
BIND_ENV = "TENPLEX_METRICS_BIND"
PORT_WAIT_ENV = "TENPLEX_METRICS_PORT_WAIT"  # seconds a worker waits for a port in use (default PORT_WAIT_S)
# A worker of the previous world may still serve the port: torchrun SIGKILLs one 30 s after its SIGTERM, so a
# lingering worker is gone well within this. SO_REUSEADDR (which the HTTP server sets) only covers TIME_WAIT;
# SO_REUSEPORT would let the old and the new worker answer scrapes in turn, so the new one waits instead.
PORT_WAIT_S = 60.0
_PORT_RETRY_S = 0.25
ENDPOINTS_DIR = ".tenplex-metrics"  # under the store root: each worker endpoint's state, for tenplex status


def serve(registry: CollectorRegistry, port: int, bind: str = "127.0.0.1") -> int:
    """Serve ``registry`` over HTTP at ``bind:port`` (``/metrics``) from a daemon thread; return the port."""
    server, _ = start_http_server(port, addr=bind, registry=registry)
    return int(server.server_port)


def serve_worker(registry: CollectorRegistry, port: int, bind: str, wait_s: float, states: Path | None) -> None:
    """Serve a worker's ``registry`` on ``port``; when the port is in use, wait for it in the background for up
    to ``wait_s`` seconds (training goes on meanwhile). Each state (serving, waiting, unserved) is logged and
    recorded in ``states`` (a directory; None: not recorded): metrics never stop training."""
    try:
        serve(registry, port, bind)
    except OSError as e:
        if e.errno != errno.EADDRINUSE or wait_s <= 0:
            log.warning("no metrics endpoint on port %d: %s", port, e)
            _record_endpoint(states, port, "unserved", error=str(e))
            return
        log.warning("metrics port %d is in use (a worker of the previous world may still serve it): serving it "
                    "once it is free, waiting up to %.0f s", port, wait_s)
        _record_endpoint(states, port, "waiting", wait_s=wait_s)
        threading.Thread(target=_serve_when_free, args=(registry, port, bind, wait_s, states),
                         name="tenplex-metrics-port", daemon=True).start()
        return
    _record_endpoint(states, port, "serving")


def _serve_when_free(registry: CollectorRegistry, port: int, bind: str, wait_s: float, states: Path | None) -> None:
    begin = time.monotonic()
    while True:
        time.sleep(_PORT_RETRY_S)
        try:
            serve(registry, port, bind)
        except OSError as e:
            if time.monotonic() - begin < wait_s:
                continue
            log.warning("no metrics endpoint on port %d: still in use after %g s (%s)", port, wait_s, e)
            _record_endpoint(states, port, "unserved", error=str(e))
            return
        waited = time.monotonic() - begin
        log.warning("metrics port %d is free after %.1f s: serving", port, waited)
        _record_endpoint(states, port, "serving", waited_s=round(waited, 1))
        return


def _record_endpoint(states: Path | None, port: int, state: str, **details) -> None:
    if states is None:
        return
    doc = {"port": port, "state": state, "pid": os.getpid(), "since": time.time(), **details}
    try:
        states.mkdir(parents=True, exist_ok=True)
        partial = states / f".{port}.json.{os.getpid()}"
        partial.write_text(json.dumps(doc))
        partial.replace(states / f"{port}.json")  # a reader sees the old state or the new one, never half
    except OSError as e:  # a read-only root: the log still says it
        log.warning("cannot record the metrics endpoint's state in %s: %s", states, e)


def endpoint_states(store_root: str | os.PathLike) -> list[dict]:
    """The recorded state of each worker metrics endpoint of the store root ``store_root``, by port (the newest
    worker's on each port); ``alive``: whether its process still runs (the root is on this machine)."""
    found = []
    for path in sorted(Path(store_root, ENDPOINTS_DIR).glob("[0-9]*.json"), key=lambda p: int(p.stem)):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        found.append(dict(doc, alive=_alive(doc.get("pid"))))
    return found


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, TypeError, ValueError):
        return False
    return True


def _port_wait(environ: Mapping[str, str]) -> float:
    try:
        return float(environ.get(PORT_WAIT_ENV, PORT_WAIT_S))
    except ValueError:
        log.warning("%s=%r is not a number of seconds: waiting %g s", PORT_WAIT_ENV, environ[PORT_WAIT_ENV],
                    PORT_WAIT_S)
        return PORT_WAIT_S


# ------------------------------------------------------------------ store --
class StoreMetrics:
    """The store server's metrics. ``versions``, ``free_bytes`` and ``copies`` (origin host -> versions of
    its state this store holds copies of) are read when Prometheus scrapes."""

    def __init__(self, versions: Callable[[], list[int]], free_bytes: Callable[[], int],
                 copies: Callable[[], Mapping[str, list[int]]], registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.received = Counter("tenplex_store_received_bytes", "Bytes this host's transformations pulled from "
                                "another host's store (the plan's cross-host transfers of each finished part)",
                                ["peer_host"], registry=r)
        self.sent = Counter("tenplex_store_sent_bytes", "Box data bytes this store sent to readers (ReadBox, "
                            "ReadBoxes, the data plane), counted as they go out, by the host each reader declared "
                            f"({UNKNOWN_PEER}: none declared)", ["peer_host"], registry=r)
        self.refetched = Counter("tenplex_store_refetched_bytes", "Bytes pulled again from another replica after "
                                 "a failed or corrupted read (verification failures on the pulling side)",
                                 registry=r)
        self.transformations = Counter("tenplex_store_transformations", "This host's parts of transformations, by "
                                       "outcome (ok, failed)", ["outcome"], registry=r)
        self.transformation_seconds = Histogram("tenplex_store_transformation_duration_seconds", "Duration of this "
                                                "host's part of a transformation", buckets=SECONDS, registry=r)
        self.rpcs = Counter("tenplex_store_rpcs", "gRPC calls served, by method and status code (Commit: commits; "
                            "DATA_LOSS: a stored shard failed verification)", ["method", "code"], registry=r)
        self.rpc_seconds = Histogram("tenplex_store_rpc_duration_seconds", "Duration of served gRPC calls, by method",
                                     ["method"], buckets=SECONDS, registry=r)
        r.register(_StoreState(versions, free_bytes, copies))

    def count_sent(self, peer_host: str, nbytes: int) -> None:
        """``serve(on_sent=)``: ``nbytes`` of box data went out to a reader of ``peer_host`` ("": undeclared)."""
        self.sent.labels(peer_host or UNKNOWN_PEER).inc(nbytes)

    def interceptor(self) -> grpc.ServerInterceptor:
        """Counts and times every ``tenplex.*`` call (health and reflection calls are not counted)."""
        return _RpcMetrics(self)

    def observed(self, transformer: Callable) -> Callable:
        """``transformer`` (a ``tenplex.store.transformer.Transformer``), counted and timed."""
        def run(store, request, progress, **kwargs):
            begin = time.monotonic()
            try:
                result = transformer(store, request, progress, **kwargs)
            except BaseException:
                self.transformations.labels("failed").inc()
                raise
            finally:
                self.transformation_seconds.observe(time.monotonic() - begin)
            self.transformations.labels("ok").inc()
            for peer, nbytes in received_by_peer(request).items():
                self.received.labels(peer).inc(nbytes)
            self.refetched.inc(result.refetched_bytes)
            return result

        return run


def received_by_peer(request) -> dict[str, int]:
    """Bytes the plan of a transform request pulls into ``request.host`` from each other host."""
    itemsizes = {name: spec.itemsize for name, spec in request.new_layout.tensors.items()}
    out: dict[str, int] = {}
    for t in request.plan.transfers:
        src = host_of(t.src)
        if src != request.host and host_of(t.dst) == request.host:
            out[src] = out.get(src, 0) + t.box.volume * itemsizes[t.tensor]
    return out


class _StoreState(Collector):
    def __init__(self, versions, free_bytes, copies):
        self.versions, self.free_bytes, self.copies = versions, free_bytes, copies

    def collect(self) -> Iterator[GaugeMetricFamily]:
        versions = self.versions()
        newest = max(versions, default=-1)
        yield GaugeMetricFamily("tenplex_store_versions", "Committed versions this store holds", value=len(versions))
        yield GaugeMetricFamily("tenplex_store_newest_version", "The newest committed version (-1: none)",
                                value=newest)
        yield GaugeMetricFamily("tenplex_store_free_bytes", "Free bytes in the store's file system",
                                value=self.free_bytes())
        held = GaugeMetricFamily("tenplex_store_replica_versions", "Versions of another host's state of which this "
                                 "store holds committed copies, by origin host", labels=["origin_host"])
        lag = GaugeMetricFamily("tenplex_store_replica_lag_versions", "Versions between this store's newest and "
                                "the newest copy it holds of the origin host's state", labels=["origin_host"])
        for origin, copied in sorted(self.copies().items()):
            held.add_metric([origin], len(copied))
            lag.add_metric([origin], max(0, newest - max(copied)))
        yield held
        yield lag


class _RpcMetrics(grpc.ServerInterceptor):
    def __init__(self, metrics: StoreMetrics):
        self.metrics = metrics

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or not details.method.startswith("/tenplex."):
            return handler
        method = details.method.rsplit("/", 1)[-1]
        if handler.unary_unary:
            return handler._replace(unary_unary=self._unary(handler.unary_unary, method))
        if handler.unary_stream:
            return handler._replace(unary_stream=self._streaming(handler.unary_stream, method))
        if handler.stream_unary:
            return handler._replace(stream_unary=self._unary(handler.stream_unary, method))
        return handler._replace(stream_stream=self._streaming(handler.stream_stream, method))

    def _observe(self, method: str, context, begin: float, failed: bool) -> None:
        code = context.code() or (grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK)
        self.metrics.rpcs.labels(method, code.name).inc()
        self.metrics.rpc_seconds.labels(method).observe(time.monotonic() - begin)

    def _unary(self, behavior, method):
        def call(request, context):
            begin, failed = time.monotonic(), True
            try:
                reply = behavior(request, context)
                failed = False
                return reply
            finally:
                self._observe(method, context, begin, failed)
        return call

    def _streaming(self, behavior, method):
        def call(request, context):
            begin, failed = time.monotonic(), True
            try:
                yield from behavior(request, context)
                failed = False
            finally:
                self._observe(method, context, begin, failed)
        return call


# -------------------------------------------------------------------- job --
def run_registry(host: str | None) -> CollectorRegistry:
    """``tenplex run``'s own metrics: which node it is; the training numbers come from its workers."""
    registry = CollectorRegistry()
    Gauge("tenplex_run_info", "This node's tenplex run (value 1); its workers serve tenplex_job_* on the next "
          "ports, one per LOCAL_RANK", ["host"], registry=registry).labels(host or "").set(1)
    return registry


class JobMetrics:
    """A training worker's metrics (``tenplex.elastic.Job``): steps, saves, the world it runs in.

    ``tenplex run --metrics-port P`` serves its own on P and sets ``TENPLEX_METRICS_PORT=P+1`` for the
    workers, each of which serves on that port plus its ``LOCAL_RANK`` (:meth:`from_environment`)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.step_seconds = Histogram("tenplex_job_step_duration_seconds", "Duration of a training step (the max "
                                      "over the ranks, without saving)", buckets=SECONDS, registry=r)
        self.save_blocking = Histogram("tenplex_job_save_blocking_seconds", "Seconds a save stopped training",
                                       buckets=SECONDS, registry=r)
        self.save_background = Histogram("tenplex_job_save_background_seconds", "Seconds a save kept working after "
                                         "training went on (copies to other hosts)", buckets=SECONDS, registry=r)
        self.save_step_wait = Counter("tenplex_job_save_step_wait_seconds", "Seconds optimizer.step() waited for "
                                      "a snapshot's copies made in the background (also time a save stopped "
                                      "training)", registry=r)
        self.saves = Counter("tenplex_job_saves", "Saves made, by reason (snapshot: staged at the boundary and "
                             "committed in the background; periodic: blocking, with snapshots off; stopping; final)",
                             ["reason"], registry=r)
        self.step = Gauge("tenplex_job_step", "The step this worker is at", registry=r)
        self.committed_step = Gauge("tenplex_job_last_committed_step", "The step of the newest committed save "
                                    "(-1: none yet)", registry=r)
        self.committed_step.set(-1)
        self.protected_step = Gauge("tenplex_job_protected_step", "The newest committed step that survives the loss "
                                    "of any one host (-1: none)", registry=r)
        self.protected_step.set(-1)
        self.restored_step = Gauge("tenplex_job_restored_step", "The step this world restored (0: a fresh job)",
                                   registry=r)
        self.lost_steps = Counter("tenplex_job_lost_steps", "Steps an earlier world finished beyond the step this "
                                  "worker restored (the work a failure lost; each worker process counts its own "
                                  "restore: increase() over restarts sums a rank's)", registry=r)
        self.last_lost_steps = Gauge("tenplex_job_last_lost_steps", "Steps the last restore lost (0: a fresh job, "
                                     "or the furthest step was saved)", registry=r)
        self.restarts = Gauge("tenplex_job_restarts", "Worker restarts by this node's agent "
                              "(TORCHELASTIC_RESTART_COUNT): one per world change or failure it saw", registry=r)
        self.world_size = Gauge("tenplex_job_world_size", "Processes in this world", registry=r)
        self.configuration = Gauge("tenplex_job_configuration_info", "The parallel configuration of this world "
                                   "(value 1)", ["config", "dp", "tp", "pp"], registry=r)
        self.pause = Histogram("tenplex_job_pause_seconds", "A world change's pause in place: the old world's last "
                               "step finished to the new world's first one", buckets=SECONDS, registry=r)
        self.restore_bytes = Counter("tenplex_job_restore_bytes", "Tensor bytes this worker's restores took, by "
                                     "source: memory (what a survivor in place kept), this_host (its host's store), "
                                     "other_hosts (other hosts' stores)", ["source"], registry=r)
        self.reconfigurations = Counter("tenplex_job_reconfigurations", "World changes this worker lived through, "
                                        "by kind (join, leave, lost; combined with +) and mode (in_place)",
                                        ["kind", "mode"], registry=r)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> "JobMetrics":
        """Metrics served on ``TENPLEX_METRICS_PORT + LOCAL_RANK`` when that variable is set, else unserved. A
        port still in use (the previous world's worker lingers) is waited for (:func:`serve_worker`), and the
        endpoint's state is recorded under ``TENPLEX_STORE_ROOT``."""
        metrics = cls()
        if environ.get(PORT_ENV):
            port = int(environ[PORT_ENV]) + int(environ.get("LOCAL_RANK", "0"))
            root = environ.get("TENPLEX_STORE_ROOT")
            serve_worker(metrics.registry, port, environ.get(BIND_ENV, "127.0.0.1"), _port_wait(environ),
                         Path(root, ENDPOINTS_DIR) if root else None)
        metrics.restarts.set(int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
        return metrics

    def observe_world(self, world_size: int, config) -> None:
        self.world_size.set(world_size)
        self.configuration.clear()
        name = f"dp={config.dp},tp={config.tp},pp={config.pp},sharding={config.sharding}"  # no devices: bounded
        self.configuration.labels(name, str(config.dp), str(config.tp), str(config.pp)).set(1)

    def observe_reconfiguration(self, kind: str, mode: str, pause_s: float) -> None:
        self.reconfigurations.labels(kind or "reform", mode).inc()
        self.pause.observe(pause_s)

    def observe_restore(self, step: int, committed: Callable[[], int | None], lost: int = 0,
                        protected: Callable[[], int | None] | None = None) -> None:
        """``committed()``: the step of the newest committed save, read when Prometheus scrapes (a snapshot
        commits in the background, after the boundary that staged it); ``lost``: the steps this restore lost."""
        self.step.set(step)
        self.restored_step.set(step)
        self.lost_steps.inc(lost)
        self.last_lost_steps.set(lost)
        self.committed_step.set_function(lambda: -1 if (last := committed()) is None else last)
        if protected is not None:
            self.protected_step.set_function(lambda: -1 if (safe := protected()) is None else safe)

    def observe_restore_bytes(self, by_source: Mapping[str, int]) -> None:
        for source, nbytes in by_source.items():
            self.restore_bytes.labels(source).inc(nbytes)

    def observe_step(self, seconds: float, step: int) -> None:
        self.step_seconds.observe(seconds)
        self.step.set(step)

    def observe_save(self, blocking: float, background: float, reason: str) -> None:
        self.save_blocking.observe(blocking)
        if background:
            self.save_background.observe(background)
        self.saves.labels(reason).inc()


# --------------------------------------------------------------- operator --
class OperatorMetrics:
    """The operator's metrics: reconciliations, their decisions, the rescales and recoveries they start."""

    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.reconciliations = Counter("tenplex_operator_reconciliations", "Reconciliations of a TenplexJob, by "
                                       "outcome (ok; conflict: decided again; gone: deleted meanwhile; error: the "
                                       "API failed)",
                                       ["outcome"], registry=r)
        self.decision_seconds = Histogram("tenplex_operator_decision_duration_seconds", "Seconds from reading a "
                                          "TenplexJob to its decision written", buckets=SECONDS, registry=r)
        self.rescales = Counter("tenplex_operator_rescales", "Rescales started (the job's nodes changed)",
                                registry=r)
        self.recoveries = Counter("tenplex_operator_recoveries", "Recoveries started (a worker or node failed)",
                                  registry=r)
        self.api_errors = Counter("tenplex_operator_api_errors", "Failed Kubernetes API calls, by HTTP status "
                                  "(0: unreachable)", ["status"], registry=r)

    def observe_api_error(self, status: int | None) -> None:
        status = int(status or 0)
        self.api_errors.labels(str(status)).inc()
        self.reconciliations.labels({409: "conflict", 404: "gone"}.get(status, "error")).inc()

    def observe_events(self, reasons) -> None:
        for reason in reasons:
            if reason == "RescaleStarted":
                self.rescales.inc()
            elif reason == "RecoveryStarted":
                self.recoveries.inc()
