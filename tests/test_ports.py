"""tenplex.ports: a port handed to a child process is outside the kernel's ephemeral range, free, and unique."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tenplex import ports


@pytest.mark.parametrize("ephemeral, expected", [
    ("32768\t60999\n", (15000, 32768)),   # Linux's default: everything from LOWEST to the range's start
    ("15500 60999", (61000, 65536)),      # too little room below: above the range
    ("1024 65535", (1024, 65536)),        # no room anywhere: the whole space (bind check and record only)
])
def test_ports_are_drawn_outside_the_ephemeral_range(tmp_path, monkeypatch, ephemeral, expected):
    (tmp_path / "range").write_text(ephemeral)
    monkeypatch.setattr(ports, "_PORT_RANGE", tmp_path / "range")
    assert ports.candidate_range() == expected


def test_this_machines_ports_never_fall_in_its_ephemeral_range(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(ports.tempfile, "tempdir", None)
    first, last = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    for _ in range(50):
        assert not first <= ports.free_port() <= last


def test_a_port_held_by_a_listener_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(ports.tempfile, "tempdir", None)
    low, high = ports.candidate_range()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([taken, taken, low + 7])

        class Scripted:
            def randrange(self, a, b):
                return next(picks)

        monkeypatch.setattr(ports.random, "SystemRandom", Scripted)
        assert not ports.bindable(taken)
        assert ports.free_port() == low + 7


_TAKE = "from tenplex.ports import free_port; import json; print(json.dumps([free_port() for _ in range(100)]))"


def test_concurrent_processes_are_never_handed_the_same_port(tmp_path):
    # 300 draws from ~17,000 ports collide with near certainty by chance alone (birthday bound ~2.5 expected
    # pairs): only the machine-wide record keeps them apart.
    env = dict(os.environ, TMPDIR=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", _TAKE], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    got = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    every = [port for batch in got for port in batch]
    assert len(every) == 300 and len(set(every)) == 300
    record = json.loads((tmp_path / f"tenplex-ports-{os.getuid()}.json").read_text())
    assert set(map(int, record)) == set(every)


_HOLD = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(600)")


def test_a_record_locked_by_a_stuck_process_does_not_stop_anyone(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(ports.tempfile, "tempdir", None)
    monkeypatch.setattr(ports, "LOCK_WAIT_S", 0.2)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path / f"tenplex-ports-{os.getuid()}.lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        port = ports.free_port()
        assert ports.bindable(port)
    finally:
        holder.kill()
        holder.wait()
