"""Standard gRPC health (``grpc.health.v1``) and server reflection for the store server.

May import: grpc, grpc_health, grpc_reflection and the standard library.

The health service reports SERVING for the overall server ("") and for ``tenplex.v1.Store`` while the
store's root is usable (a directory in which a file can be created and removed), NOT_SERVING when it is not
(removed, replaced, read-only, full of inodes) and, for good, once :meth:`StoreHealth.drain` was called (the
server is about to stop). On the store's port both services need the token like every other call. A kubelet
``grpc`` probe sends no token: :meth:`StoreHealth.serve_probes` answers it on a port of its own, which serves
``grpc.health.v1`` alone and reads requests of at most :data:`PROBE_MAX_BYTES` (the store's port accepts the
1 GiB its Transform requests need, and a caller without the token must not make it read anything).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)
CHECK_INTERVAL_S = 1.0  # a stat, a create and an unlink per second: negligible, and a probe sees changes soon
PROBE_MAX_BYTES = 1024  # a HealthCheckRequest names one service: a few bytes
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def root_problem(root: Path) -> str | None:
    """Why the store root cannot serve (None: it can): it must be a directory where files can be made."""
    if not root.is_dir():
        return f"store root {root} is not a directory"
    probe = root / f".tenplex-health.{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600))
        os.unlink(probe)
    except OSError as e:
        return f"store root {root} is not writable ({e.strerror})"
    return None


class StoreHealth:
    """Health and reflection services on ``server`` (call before it starts), kept up to date by a thread."""

    def __init__(self, server: grpc.Server, root: Path, service: str, interval_s: float = CHECK_INTERVAL_S):
        self.root, self.service, self.interval_s = Path(root), service, interval_s
        self.servicer = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        reflection.enable_server_reflection((service, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        self._draining = threading.Event()
        self._problem: str | None = "not checked yet"
        self._probe_server: grpc.Server | None = None
        self.check()
        threading.Thread(target=self._watch, name="store-health", daemon=True).start()

    def serve_probes(self, address: str) -> int:
        """Answer ``grpc.health.v1`` without a token on ``address`` (``HOST:PORT``, port 0: any free one), with
        requests of at most :data:`PROBE_MAX_BYTES` and two threads; return the port bound (0: could not bind)."""
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="store-probe"),
                             options=[("grpc.max_receive_message_length", PROBE_MAX_BYTES),
                                      ("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        try:
            port = server.add_insecure_port(address)
        except RuntimeError:  # grpc's "Failed to bind to address"
            port = 0
        if port:
            server.start()
            self._probe_server = server
        return port

    def close(self) -> None:
        """Stop the probe port (the store's own server is stopped by its owner)."""
        if self._probe_server is not None:
            self._probe_server.stop(grace=None)
            self._probe_server = None

    def check(self) -> None:
        """Look at the root now and publish the status (a change is logged once)."""
        if self._draining.is_set():
            return
        problem = root_problem(self.root)
        if problem != self._problem:
            if problem:
                log.warning("health: NOT_SERVING: %s", problem)
            else:
                log.info("health: SERVING (store root %s)", self.root)
        self._problem = problem
        self._publish(NOT_SERVING if problem else SERVING)

    def drain(self) -> None:
        """NOT_SERVING from now on: the server is stopping (probes and load balancers stop sending calls)."""
        self._draining.set()
        self._publish(NOT_SERVING)

    def _publish(self, status) -> None:
        for name in ("", self.service):
            self.servicer.set(name, status)

    def _watch(self) -> None:
        while not self._draining.wait(self.interval_s):
            try:
                self.check()
            except Exception as e:  # noqa: BLE001 - the watcher must go on; an unexpected error is a problem
                log.warning("health check failed: %s", e)
                self._publish(NOT_SERVING)
