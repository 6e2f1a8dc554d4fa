"""The emulated cluster (tenplex.cluster): namespaces, rate-limited links, kernel counters, cut and heal,
and that nothing is left behind, not even after SIGTERM or SIGKILL of the process that made it."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tenplex.cluster import emulated
from tenplex.cluster import EmulatedCluster

REASON = emulated.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"emulated cluster unavailable: {REASON}")

# Sends argv[2] bytes to argv[1]:5555 (or, with argv[2] == "probe", only tries to connect within 1.5 s).
CLIENT = textwrap.dedent("""
    import socket, sys
    try:
        s = socket.create_connection((sys.argv[1], 5555), timeout=1.5)
    except OSError as e:
        print("unreachable", e); sys.exit(3)
    if sys.argv[2] != "probe":
        s.sendall(bytes(int(sys.argv[2])))
        s.shutdown(socket.SHUT_WR); s.recv(1)
    s.close()
""")
# Accepts connections on argv[1]:5555 forever and reads each to its end.
SERVER = textwrap.dedent("""
    import socket, sys
    srv = socket.create_server((sys.argv[1], 5555))
    print("ready", flush=True)
    while True:
        c, _ = srv.accept()
        while c.recv(1 << 20):
            pass
        c.close()
""")


def _ours(prefix: str) -> list[str]:
    return [n for n in emulated._namespaces() if n.startswith(prefix)]


def _wait_gone(prefix: str) -> list[str]:
    deadline = time.monotonic() + 120
    while _ours(prefix) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _ours(prefix)


def test_links_count_what_crosses_them_and_cut_heal_work():
    with EmulatedCluster(["h0", "h1", "h2"], mbit=400) as cluster:
        assert set(emulated._namespaces()) >= {cluster.prefix + h for h in ("br", "ctl", "h0", "h1", "h2")}
        shown = subprocess.run(["tc", "-n", cluster.namespace("h1"), "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True, check=True).stdout
        assert "tbf" in shown and "400Mbit" in shown
        server = cluster.popen("h0", [sys.executable, "-c", SERVER, cluster.address("h0")], stdout=subprocess.PIPE)
        assert server.stdout.readline().strip() == b"ready"
        before = cluster.counters()
        nbytes = 20 << 20
        cluster.run("h1", [sys.executable, "-c", CLIENT, cluster.address("h0"), str(nbytes)], check=True)
        moved = cluster.counters() - before
        # Payload plus TCP/IP headers (large frames: well under 1%); nothing of it crossed h2's link.
        assert nbytes <= moved["h1"].out <= nbytes * 1.01
        assert nbytes <= moved["h0"].in_ <= nbytes * 1.01
        assert moved["h2"].out < 10_000 and moved["h2"].in_ < 10_000

        cluster.cut("h0")
        probe = cluster.run("h1", [sys.executable, "-c", CLIENT, cluster.address("h0"), "probe"],
                            capture_output=True, text=True)
        assert probe.returncode == 3, probe.stdout  # silently dropped: the connect times out
        cluster.heal("h0")
        cluster.run("h1", [sys.executable, "-c", CLIENT, cluster.address("h0"), "probe"], check=True)

        cluster.set_rate("h2", 40)
        shown = subprocess.run(["tc", "-n", cluster.namespace("h2"), "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True, check=True).stdout
        assert "40Mbit" in shown
        prefix = cluster.prefix
    assert _ours(prefix) == []
    assert server.poll() is not None, "a process started in the cluster outlived it"


def test_bad_host_names_are_refused():
    with pytest.raises(emulated.ClusterError, match="host names"):
        EmulatedCluster(["h0", "ctl"])


# Makes a cluster with a process inside, prints the prefix, then waits to be killed.
HOLDER = textwrap.dedent("""
    import sys, time
    from tenplex.cluster import EmulatedCluster
    with EmulatedCluster(["h0", "h1"], mbit=100) as cluster:
        cluster.popen("h0", ["sleep", "600"])
        print(cluster.prefix, flush=True)
        time.sleep(600)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_nothing_is_left_behind_when_the_owner_is_killed(sig):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    try:
        prefix = holder.stdout.readline().strip()
        assert prefix.startswith(emulated.PREFIX + "-") and len(_ours(prefix)) == 4
        holder.send_signal(sig)
        holder.wait(120)
        assert _wait_gone(prefix) == []
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_leftovers_of_crashed_runs_are_swept():
    gone = subprocess.Popen(["true"])
    gone.wait()  # a PID that no longer runs: the "crashed run"
    # Another test process starting a cluster meanwhile sweeps it too (make test runs files at once): then the
    # leftover is gone all the same, and a new one is left for this sweep to find.
    for suffix in ("abcd", "abce", "abcf", "abd0", "abd1"):
        stale = f"{emulated.PREFIX}-{gone.pid}-{suffix}-h0"
        subprocess.run(["ip", "netns", "add", stale], check=True)
        try:
            swept = stale in emulated.sweep_stale()
            assert stale not in emulated._namespaces()
        finally:
            subprocess.run(["ip", "netns", "del", stale], capture_output=True)
        if swept:
            return
    pytest.fail("sweep_stale never swept the leftover itself: each time it was gone before")
