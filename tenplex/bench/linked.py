"""Store servers on the hosts of an emulated cluster, and transformations coordinated from its control host.

May import: every tenplex layer and the standard library.

Each host's ``tenplex store serve`` runs inside the host's network namespace
and binds the host's address on the cluster's private network, so it needs a
token (a fresh random one per run, in a file only root can read). The
coordinator is ``tenplex store transform`` run inside the control host, whose
link is unlimited; its report (JSON) is parsed back.

Wire bytes between hosts, from the kernel counters: every byte a store host
sends goes either to another store host or to the coordinator, so
``inter_host_wire_bytes`` = the store hosts' bytes out - the control host's
bytes in. TCP/IP headers and acknowledgements are included: that is the wire.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from pathlib import Path

from ..errors import TransformError
from ..cluster import CONTROL, Counters, EmulatedCluster

_STORE = [sys.executable, "-m", "tenplex.cli.store"]


class LinkedStores:
    """One store server per cluster host (``roots``: host -> store directory); ``work`` holds logs and files."""

    def __init__(self, cluster: EmulatedCluster, roots: dict[str, Path], work: Path,
                 env: dict[str, dict[str, str]] | None = None):
        self.cluster, self.roots, self.work = cluster, {h: Path(r) for h, r in roots.items()}, Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.token_file = self.work / "token"
        self.token_file.touch(mode=0o600)
        self.token_file.write_text(secrets.token_hex(16))
        self._calls = 0
        self.procs = {host: self._serve(host, (env or {}).get(host)) for host in roots}  # all start at once
        self.addresses = {host: self._address(host, proc) for host, proc in self.procs.items()}

    def _serve(self, host: str, env: dict[str, str] | None):
        (self.work / f"{host}.port").unlink(missing_ok=True)
        log = open(self.work / f"{host}.log", "ab")
        proc = self.cluster.popen(host, [*_STORE, "serve", "--root", str(self.roots[host]), "--host", host,
                                         "--bind", self.cluster.address(host), "--port", "0", "--port-file",
                                         str(self.work / f"{host}.port"), "--token-file", str(self.token_file)],
                                  env={**os.environ, **(env or {})}, stdout=log, stderr=log)
        log.close()
        return proc

    def _address(self, host: str, proc) -> str:
        port_file = self.work / f"{host}.port"
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.work / f"{host}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"store of host {host} did not start in the emulated cluster: {tail}")
            time.sleep(0.05)
        return f"{self.cluster.address(host)}:{int(port_file.read_text())}"

    def transform(self, plan, old, new, old_version: int, new_version: int, streams: int | None = None) -> dict:
        """Run ``plan`` from the control host (``tenplex store transform``); returns its report, or raises
        :class:`TransformError` with the failed hosts."""
        from ..files import save_layout, save_plan

        self._calls += 1
        files = [self.work / f"{name}-{self._calls}.json" for name in ("plan", "old", "new")]
        save_plan(plan, files[0])
        save_layout(old, files[1])
        save_layout(new, files[2])
        stores = ",".join(f"{h}={a}" for h, a in sorted(self.addresses.items()))
        done = self.cluster.run(CONTROL, [*_STORE, "transform", *map(str, files), "--stores", stores,
                                          "--old-version", str(old_version), "--new-version", str(new_version),
                                          *(["--streams", str(streams)] if streams else []),
                                          "--token-file", str(self.token_file)],
                                capture_output=True, text=True)
        if done.returncode != 0:
            marker = "tenplex store: error: "  # after the progress bars
            message = done.stderr[done.stderr.rfind(marker):].removeprefix(marker).strip() if marker in done.stderr \
                else done.stderr[-2000:].strip()
            causes = dict(line.strip().split(": ", 1) for line in message.splitlines()[1:] if ": " in line)
            raise TransformError(message, {host: TransformError(cause) for host, cause in causes.items()})
        return json.loads(done.stdout.strip().splitlines()[-1])


def inter_host_wire_bytes(moved: Counters) -> int:
    """Bytes that crossed links from one store host to another (see the module docstring). Broadcasts (ARP)
    reach the control host as well, so with no traffic at all the difference can dip below zero: floor 0."""
    return max(0, sum(v.out for h, v in moved.items() if h != CONTROL) - moved[CONTROL].in_)


def link_fields(moved: Counters, seconds: float, mbit: dict[str, float | None], lower_bound: int) -> dict:
    """What the links carried during one transformation of ``seconds``, against the plan's lower bound.

    ``link_bound_seconds`` is the largest, over the store hosts with a rate limit (``mbit``), of the
    host's bytes out or in over its link rate: no schedule can finish sooner. ``link_efficiency`` is that
    over the measured seconds (1.0: the busiest link never idled)."""
    hosts = {h: v for h, v in moved.items() if h != CONTROL}
    limited = [h for h in hosts if mbit.get(h)]
    if not limited:
        raise ValueError("link_fields needs at least one store host with a rate limit")

    def busy_seconds(host: str) -> float:
        return max(hosts[host].out, hosts[host].in_) / (float(mbit[host] or 0) * 1e6 / 8)  # limited: set

    busiest = max(limited, key=busy_seconds)
    wire = inter_host_wire_bytes(moved)
    bound_seconds = busy_seconds(busiest)
    return {"link_mbit": mbit[busiest], "inter_host_wire_bytes": wire,
            "wire_vs_lower_bound": round(wire / lower_bound, 4) if lower_bound else None,
            "busiest_link_host": busiest, "busiest_link_bytes": max(hosts[busiest].out, hosts[busiest].in_),
            "link_bound_seconds": round(bound_seconds, 3),
            "link_efficiency": round(bound_seconds / seconds, 3) if seconds > 0 else None,
            "host_bytes_out": {h: v.out for h, v in sorted(hosts.items())},
            "host_bytes_in": {h: v.in_ for h, v in sorted(hosts.items())}}


def measured_transform(stores: LinkedStores, plan, old, new, old_version: int, new_version: int,
                       streams: int | None = None) -> tuple[dict, dict]:
    """Run a transformation on the links; returns (its report, :func:`link_fields`)."""
    before = stores.cluster.counters()
    report = stores.transform(plan, old, new, old_version, new_version, streams=streams)
    moved = stores.cluster.counters() - before
    return report, link_fields(moved, report["seconds"], stores.cluster.mbit, plan.stats.inter_host_lower_bound)
