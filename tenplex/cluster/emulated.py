"""An emulated cluster on one machine: simulated hosts, each with a network link of its own.

May import: ``tenplex.errors`` and the standard library.

Every simulated host is a Linux network namespace with one veth into a bridge
that lives in a namespace of its own. A token-bucket filter (``tc … tbf``) on
each end of a host's veth limits what the host sends and what it receives,
so every host has a link of its own and loopback's unlimited speed no longer
hides the network. A control namespace (``ctl``) joins the same bridge with an
unlimited link: the coordinator runs there.

    with EmulatedCluster(["h0", "h1"], mbit=800) as cluster:
        proc = cluster.popen("h0", ["tenplex", "store", "serve", "--bind", cluster.address("h0"), ...])
        before = cluster.counters()
        ...
        cluster.cut("h0"); cluster.heal("h0"); cluster.set_rate("h1", 80)
        moved = cluster.counters() - before  # bytes out of / into each host's link

The bytes per host come from the kernel's interface counters of the bridge
ports (a port receives what its host sends). A cut takes the host's bridge
port down: its packets vanish without a reset, as in a partition. A
connection with unacknowledged data to a cut-off peer breaks only when its
host stops retransmitting: ``tcp_retries`` sets that
(``net.ipv4.tcp_retries2`` in every namespace of the cluster; Linux's default
of 15 takes about 15 minutes, 4 about 6 s), as a cluster's administrator
would for software such as gloo that sets no timeout on its sockets.

Safety: it needs root and iproute2 (``ip``, ``tc``); :func:`unavailable`
says why not in one line, and callers skip or refuse; nothing falls back to
loopback. Traffic stays inside one private /24 of namespaces this run made.
Every namespace name carries the run's prefix (``tpx-PID-RANDOM-``).
Leftovers of crashed runs (their PID is gone) are swept at start. The
cluster cleans up on ``close``, on exceptions and on SIGTERM/SIGHUP inside
``with``; a reaper process cleans up when this process dies even by SIGKILL.
"""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..errors import TenplexError

PREFIX = "tpx"
_NAME = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]{{4}}-")
_HOST = re.compile(r"^[a-z][a-z0-9]{0,11}$")
CONTROL = "ctl"
HOST_DEVICE = "eth0"  # each host's end of its veth: its one link
MTU = 65000  # large frames: few headers on the wire and little CPU per byte
_STOP_GRACE_S = 5.0


class ClusterUnavailable(TenplexError, RuntimeError):
    """Network namespaces cannot be used here (not root, no iproute2, or the kernel refuses)."""


class ClusterError(TenplexError, RuntimeError):
    """Setting up or changing the emulated cluster failed."""


def unavailable() -> str | None:
    """Why the emulated cluster cannot run here (one line), or None when it can."""
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces, veth and tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the emulated cluster needs iproute2 ({', '.join(missing)} missing; scripts/setup.sh installs it)"
    probe = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(2)}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"the kernel refused a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass(frozen=True)
class LinkBytes:
    """Bytes a host sent (``out``) and received (``in_``) through its link."""

    out: int
    in_: int

    def __sub__(self, other: "LinkBytes") -> "LinkBytes":
        return LinkBytes(self.out - other.out, self.in_ - other.in_)


class Counters(dict):
    """host -> LinkBytes; subtracting two readings gives what crossed each link in between."""

    def __sub__(self, other: "Counters") -> "Counters":
        return Counters({h: v - other[h] for h, v in self.items() if h in other})


class EmulatedCluster:
    """N simulated hosts with rate-limited links (``mbit`` per direction; None: unlimited) plus a control host."""

    def __init__(self, hosts: list[str] | int, mbit: float | None = None, burst_bytes: int = 256 << 10,
                 queue_ms: int = 50, tcp_retries: int | None = None):
        names = [f"h{i}" for i in range(hosts)] if isinstance(hosts, int) else list(hosts)
        bad = [h for h in names if not _HOST.match(h) or h == CONTROL]
        if bad or len(set(names)) != len(names) or not names or len(names) > 200:
            raise ClusterError(f"host names must be 1 to 200 distinct lower-case names like h0 (not {CONTROL!r}); "
                               f"got {names}")
        reason = unavailable()
        if reason:
            raise ClusterUnavailable(reason)
        sweep_stale()
        self.hosts = names
        self.mbit = {h: mbit for h in names}
        self._burst, self._queue_ms = max(burst_bytes, 2 * MTU), queue_ms
        if tcp_retries is not None and not 1 <= tcp_retries <= 15:
            raise ClusterError(f"tcp_retries must be within 1..15 (net.ipv4.tcp_retries2), got {tcp_retries}")
        self._tcp_retries = tcp_retries
        self.prefix = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(2)}-"
        subnet = f"10.{random.randint(200, 249)}.{random.randint(0, 255)}"  # private, inside our namespaces only
        self._address = {h: f"{subnet}.{i + 1}" for i, h in enumerate(names)}
        self._address[CONTROL] = f"{subnet}.250"
        self._port = {h: f"p{i}" for i, h in enumerate([*names, CONTROL])}
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        self._old_handlers: dict[int, Any] = {}  # what signal.signal returned: a handler, SIG_DFL or None
        # The reaper removes our namespaces when this process dies, SIGKILL included (its stdin closes).
        self._reaper = subprocess.Popen([sys.executable, "-c", _REAPER, self.prefix], stdin=subprocess.PIPE,
                                        start_new_session=True)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # ---- names -----------------------------------------------------------
    def namespace(self, host: str) -> str:
        """The network namespace of ``host`` (or of the control host ``ctl``)."""
        if host != CONTROL and host not in self.mbit:
            raise ClusterError(f"no host {host!r} in this cluster (hosts: {self.hosts}, control: {CONTROL})")
        return self.prefix + host

    def address(self, host: str) -> str:
        """The IPv4 address of ``host`` on the cluster's private /24."""
        self.namespace(host)
        return self._address[host]

    # ---- processes -------------------------------------------------------
    def command(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def popen(self, host: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside ``host``; it is stopped at ``close`` if still running."""
        proc = subprocess.Popen(self.command(host, argv), **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, host: str, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``host`` to completion (``subprocess.run`` keywords)."""
        return subprocess.run(self.command(host, argv), **kwargs)

    # ---- links -----------------------------------------------------------
    def counters(self) -> Counters:
        """Bytes each host (and ``ctl``) has sent and received through its link so far (kernel counters)."""
        out = subprocess.run(["ip", "-n", self._bridge, "-j", "-s", "link", "show"], capture_output=True, text=True,
                             check=True).stdout
        by_port = {link["ifname"]: link["stats64"] for link in json.loads(out)}
        return Counters({h: LinkBytes(by_port[p]["rx"]["bytes"], by_port[p]["tx"]["bytes"])
                         for h, p in self._port.items()})

    def cut(self, host: str) -> None:
        """Take ``host``'s link down: its packets are dropped silently (no reset), like a partition."""
        self._ip(["-n", self._bridge, "link", "set", self._port[self._host(host)], "down"])

    def heal(self, host: str) -> None:
        """Bring ``host``'s link back up.

        Address resolution that failed during the cut leaves FAILED neighbour
        entries behind, and the kernel answers "No route to host" from them until
        they expire; a healed link must carry traffic at once, so every host's
        neighbour cache is flushed."""
        self._ip(["-n", self._bridge, "link", "set", self._port[self._host(host)], "up"])
        for name in (*self.hosts, CONTROL):
            self._ip(["-n", self.namespace(name), "neigh", "flush", "all"])

    def set_rate(self, host: str, mbit: float | None) -> None:
        """Change ``host``'s link rate in both directions (None: unlimited)."""
        host = self._host(host)
        for namespace, device in ((self.namespace(host), HOST_DEVICE), (self._bridge, self._port[host])):
            self._shape(namespace, device, mbit, replace=True)
        self.mbit[host] = mbit

    # ---- life cycle --------------------------------------------------------
    def __enter__(self) -> "EmulatedCluster":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._old_handlers[sig] = signal.signal(sig, _raise_exit)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop every process started in the cluster and delete its namespaces (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + _STOP_GRACE_S
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        remove_namespaces(self.prefix)
        if self._reaper.stdin is not None:
            self._reaper.stdin.close()
        self._reaper.wait()

    # ---- internals -------------------------------------------------------
    @property
    def _bridge(self) -> str:
        return self.prefix + "br"

    def _host(self, host: str) -> str:
        if host not in self.mbit:
            raise ClusterError(f"no host {host!r} in this cluster (hosts: {self.hosts})")
        return host

    def _ip(self, args: list[str], tool: str = "ip") -> None:
        done = subprocess.run([tool, *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise ClusterError(f"`{tool} {' '.join(args)}` failed: {done.stderr.strip()}")

    def _shape(self, namespace: str, device: str, mbit: float | None, replace: bool = False) -> None:
        if replace:  # no qdisc yet (unlimited) is fine
            subprocess.run(["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"], capture_output=True)
        if mbit is not None:
            if mbit <= 0:
                raise ClusterError(f"link rate must be positive, got {mbit} Mbit/s")
            self._ip(["-n", namespace, "qdisc", "add", "dev", device, "root", "tbf", "rate", f"{int(mbit * 1000)}kbit",
                      "burst", str(self._burst), "latency", f"{self._queue_ms}ms"], tool="tc")

    def _build(self) -> None:
        bridge = self._bridge
        self._ip(["netns", "add", bridge])
        self._ip(["-n", bridge, "link", "add", "br0", "type", "bridge"])
        self._ip(["-n", bridge, "link", "set", "br0", "mtu", str(MTU), "up"])
        for host, port in self._port.items():
            namespace = self.prefix + host
            self._ip(["netns", "add", namespace])
            # Both ends are created inside our namespaces: nothing appears in the caller's namespace.
            self._ip(["link", "add", HOST_DEVICE, "netns", namespace, "mtu", str(MTU), "type", "veth",
                      "peer", "name", port, "netns", bridge, "mtu", str(MTU)])
            self._ip(["-n", bridge, "link", "set", port, "master", "br0", "up"])
            self._ip(["-n", namespace, "link", "set", "lo", "up"])
            self._ip(["-n", namespace, "addr", "add", f"{self._address[host]}/24", "dev", HOST_DEVICE])
            self._ip(["-n", namespace, "link", "set", HOST_DEVICE, "up"])
            if self._tcp_retries is not None:  # a per-namespace setting: the caller's own is untouched
                self._ip(["netns", "exec", namespace, "sysctl", "-qw", f"net.ipv4.tcp_retries2={self._tcp_retries}"])
            if host != CONTROL:
                self._shape(namespace, HOST_DEVICE, self.mbit[host])  # what the host sends
                self._shape(bridge, port, self.mbit[host])       # what it receives


def _raise_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def remove_namespaces(prefix: str) -> list[str]:
    """Kill the processes inside, then delete, every namespace whose name starts with ``prefix``."""
    removed = []
    for namespace in _namespaces():
        if not namespace.startswith(prefix):
            continue
        pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
        for pid in pids:  # started inside a namespace of ours: ours to stop
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        removed.append(namespace)
    return removed


def sweep_stale() -> list[str]:
    """Delete namespaces of earlier runs whose process is gone (crashed runs); returns their names."""
    removed = []
    for namespace in _namespaces():
        match = _NAME.match(namespace)
        if match is None or _alive(int(match.group(1))):
            continue
        removed += remove_namespaces(namespace)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# Waits for its parent to close our stdin (or die), then removes the parent's namespaces.
_REAPER = """
import signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
sys.stdin.buffer.read()
from tenplex.cluster.emulated import remove_namespaces
remove_namespaces(sys.argv[1])
"""
