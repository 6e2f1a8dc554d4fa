"""``tenplex run``'s command line, its torchrun defaults, the node store it starts or reuses, the worker entry
shim, and ``tenplex rendezvous serve`` (real processes, real TCPStore)."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tenplex.elastic import launcher
from tenplex.elastic.launcher import alive
from tenplex.elastic.entry import command
from tenplex.elastic.launcher import RunSpec, parse, torchrun_argv
from tenplex.errors import ConfigError

ENTRY = ["--no-python", sys.executable, "-u", "-m", "tenplex.elastic.entry"]
CONF = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=2,is_host=false"


def test_parse_removes_our_options_and_keeps_the_rest_in_order():
    spec = parse(["--host", "h1", "--nnodes=1:3", "--store-root=/s", "--nproc-per-node", "2", "--token-file", "t",
                  "--rdzv-endpoint", "10.0.0.1:29400", "--store-bind", "0.0.0.0", "--store-advertise", "n1",
                  "train.py", "--host", "x", "--lr=1"])
    assert spec == RunSpec("h1", Path("/s"), "0.0.0.0", "n1", Path("t"),
                           ["--nnodes=1:3", "--nproc-per-node", "2", "--rdzv-endpoint", "10.0.0.1:29400"],
                           "script", "train.py", ["--host", "x", "--lr=1"])


@pytest.mark.parametrize("flag,mode", [("-m", "module"), ("--module", "module"), ("--no-python", "exec"),
                                       ("--no_python", "exec"), ("--run-path", "script")])
def test_parse_turns_torchrun_program_modes_into_an_entry_mode(flag, mode):
    spec = parse(["--host", "h0", "--store-root", "/s", flag, "prog", "a"])
    assert (spec.mode, spec.target, spec.args, spec.torchrun) == (mode, "prog", ["a"], [])


def test_torchrun_argv_adds_the_measured_defaults():
    spec = parse(["--host", "h0", "--store-root", "/s", "--nnodes", "1:3", "--rdzv-endpoint", "127.0.0.1:5", "t.py"])
    assert torchrun_argv(spec) == ["--nnodes", "1:3", "--rdzv-endpoint", "127.0.0.1:5", "--rdzv-backend", "c10d",
                                   "--rdzv-conf", CONF, "--max-restarts", "10", *ENTRY, "script", "t.py"]


def test_torchrun_argv_keeps_what_the_user_set():
    spec = parse(["--host", "h0", "--store-root", "/s", "--rdzv_backend=c10d", "--rdzv-endpoint=e:1",
                  "--rdzv-conf", "last_call_timeout=9,is_host=true,join_timeout=7", "--max-restarts=3", "t.py"])
    assert torchrun_argv(spec) == [
        "--rdzv_backend=c10d", "--rdzv-endpoint=e:1", "--max-restarts=3", "--rdzv-conf",
        "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=9,is_host=true,join_timeout=7",
        *ENTRY, "script", "t.py"]
    etcd = parse(["--host", "h0", "--store-root", "/s", "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "e:2379",
                  "t.py"])
    assert "--rdzv-conf" not in torchrun_argv(etcd)  # c10d settings only for c10d
    standalone = parse(["--host", "h0", "--store-root", "/s", "--standalone", "t.py"])
    assert torchrun_argv(standalone) == ["--standalone", "--max-restarts", "10", *ENTRY, "script", "t.py"]


def test_in_place_runs_a_torchrun_of_this_node_alone_and_gives_the_rendezvous_to_the_workers():
    from tenplex.elastic.inplace_launch import local_argv
    from tenplex.elastic.launcher import _given, _without

    argv = ["--host", "h0", "--store-root", "/s", "--in-place", "--nnodes", "2:4", "--nproc-per-node", "3",
            "--rdzv-endpoint", "127.0.0.1:5", "--rdzv-id=job7", "--rdzv-conf", "x=1", "t.py", "--in-place"]
    spec = parse(argv)
    assert spec.in_place and spec.args == ["--in-place"]        # the script's own argument stays the script's
    assert torchrun_argv(spec) == ["--nproc-per-node", "3", "--standalone", "--max-restarts", "10", *ENTRY,
                                   "script", "t.py", "--in-place"]
    assert local_argv(spec.torchrun, _given, _without)[1] == {
        "TENPLEX_IN_PLACE": "1", "TENPLEX_RDZV_ENDPOINT": "127.0.0.1:5", "TENPLEX_RDZV_ID": "job7",
        "TENPLEX_MIN_WORKERS": "6",                                 # 2 nodes of 3 workers start the first world
        "TENPLEX_MAX_WORKERS": "12", "TENPLEX_LAST_CALL": "2"}      # which waits 2 s for more, up to 4 nodes
    fixed = parse(["--host", "h0", "--store-root", "/s", "--in-place", "--nnodes", "2", "--rdzv-endpoint", "e:1",
                   "--rdzv-conf", "last_call_timeout=0.5,x=1", "t.py"])
    assert {k: v for k, v in local_argv(fixed.torchrun, _given, _without)[1].items() if "WORKERS" in k or
            "CALL" in k} == {"TENPLEX_MIN_WORKERS": "2", "TENPLEX_MAX_WORKERS": "2", "TENPLEX_LAST_CALL": "0.5"}
    assert not parse(argv[:4] + ["--rdzv-endpoint", "e:1", "t.py"]).in_place
    with pytest.raises(ConfigError, match="--in-place needs --rdzv-endpoint"):
        torchrun_argv(parse(["--host", "h0", "--store-root", "/s", "--in-place", "t.py"]))


def test_torchrun_argv_needs_a_rendezvous_endpoint():
    with pytest.raises(ConfigError, match="needs --rdzv-endpoint .* `tenplex rendezvous serve`"):
        torchrun_argv(parse(["--host", "h0", "--store-root", "/s", "--nnodes", "2", "t.py"]))


def test_worker_env_exports_the_store_and_the_rendezvous_fix(tmp_path):
    spec = RunSpec("h3", tmp_path)
    env = launcher.worker_env(spec, "127.0.0.1:7", "secret")
    assert env == {"TENPLEX_HOST": "h3", "TENPLEX_STORE_ROOT": str(tmp_path.resolve()),
                   "TENPLEX_STORE_ADDRESS": "127.0.0.1:7", "TENPLEX_AGENT_PID": str(os.getpid()),
                   "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TENPLEX_TOKEN": "secret"}
    assert "TENPLEX_TOKEN" not in launcher.worker_env(spec, "a:1", None)


def test_entry_commands():
    assert command("script", "t.py", ["a"]) == [sys.executable, "-u", "t.py", "a"]
    assert command("module", "p.t", []) == [sys.executable, "-u", "-m", "p.t"]
    assert command("exec", "/bin/x", ["-v"]) == ["/bin/x", "-v"]


def test_a_worker_dies_with_its_agent(tmp_path):
    """The entry shim's worker is SIGKILLed by the kernel when its parent (the agent) is SIGKILLed."""
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", f"""
import os, subprocess, sys, time
env = dict(os.environ, TENPLEX_AGENT_PID=str(os.getpid()))
child = subprocess.Popen([sys.executable, "-m", "tenplex.elastic.entry", "exec", "sh", "-c",
                          "echo $$ > {pid_file}; exec sleep 120"], env=env, start_new_session=True)
time.sleep(120)
"""])
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text().strip()):
            assert time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        os.kill(child, 0)  # alive
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 120
        while alive(child):
            assert time.monotonic() < deadline, "the worker outlived its agent"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()
        if pid_file.exists() and alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_ensure_store_starts_a_detached_store_then_reuses_it(tmp_path):
    spec = RunSpec("h0", tmp_path / "h0")
    address = launcher.ensure_store(spec, None)
    pid = int((tmp_path / "h0" / ".tenplex-store.pid").read_text())
    try:
        assert os.getsid(pid) == pid  # a session of its own: it outlives the agent's process group
        assert launcher.ensure_store(spec, None) == address
        assert int((tmp_path / "h0" / ".tenplex-store.pid").read_text()) == pid  # reused, not restarted
        with pytest.raises(ConfigError, match="serves .* as host h0, not .* as host h9"):
            launcher.ensure_store(RunSpec("h9", tmp_path / "h0"), None)
    finally:
        os.kill(pid, signal.SIGTERM)
        _wait_gone(pid)
    # A stale port file (the store is gone) starts a new store.
    address = launcher.ensure_store(spec, None)
    new_pid = int((tmp_path / "h0" / ".tenplex-store.pid").read_text())
    os.kill(new_pid, signal.SIGTERM)
    _wait_gone(new_pid)
    assert new_pid != pid


def _serving(root: Path) -> list[int]:
    """Every store process serving ``root`` (found by its command line, not by the files that name one)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and str(root).encode() in argv and alive(int(cmdline.parent.name)):
            pids.append(int(cmdline.parent.name))
    return pids


def test_two_runs_starting_at_once_on_one_root_start_one_store(tmp_path):
    root = tmp_path / "h0"
    # Both wait at a barrier (the other's ready file) after importing, then check-and-start at the same moment.
    script = """
import sys, time
from pathlib import Path
from tenplex.elastic.launcher import RunSpec, ensure_store
me, other = Path(sys.argv[1]), Path(sys.argv[2])
me.touch()
while not other.exists():
    time.sleep(0.001)
print(ensure_store(RunSpec("h0", Path(sys.argv[3])), None))
"""
    a, b = tmp_path / "a", tmp_path / "b"
    runs = [subprocess.Popen([sys.executable, "-c", script, str(x), str(y), str(root)], stdout=subprocess.PIPE,
                             text=True) for x, y in ((a, b), (b, a))]
    try:
        addresses = [run.communicate(timeout=180)[0].strip() for run in runs]
        serving = _serving(root.resolve())
        assert [run.returncode for run in runs] == [0, 0]
        assert addresses[0] == addresses[1] != ""
        assert serving == [int((root / ".tenplex-store.pid").read_text())]
        assert addresses[0].endswith(f":{int((root / '.tenplex-store.port').read_text())}")
    finally:
        for pid in _serving(root.resolve()):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("pid_text", ["", "12a", "\0\0"])
def test_an_unreadable_pid_file_is_stale(tmp_path, pid_text):
    """What a crash during a non-atomic write leaves: the run starts a store instead of failing on int()."""
    root = tmp_path / "h0"
    root.mkdir()
    (root / ".tenplex-store.pid").write_text(pid_text)
    launcher.ensure_store(RunSpec("h0", root), None)
    pid = int((root / ".tenplex-store.pid").read_text())
    os.kill(pid, signal.SIGTERM)
    _wait_gone(pid)


def test_an_unreadable_port_file_of_a_live_store_starts_another(tmp_path):
    root = tmp_path / "h0"
    spec = RunSpec("h0", root)
    launcher.ensure_store(spec, None)
    old = int((root / ".tenplex-store.pid").read_text())
    (root / ".tenplex-store.port").write_text("garbled")
    try:
        address = launcher.ensure_store(spec, None)
        new = int((root / ".tenplex-store.pid").read_text())
        assert new != old and address.endswith(f":{int((root / '.tenplex-store.port').read_text())}")
    finally:
        for pid in _serving(root.resolve()):
            os.kill(pid, signal.SIGTERM)
            _wait_gone(pid)


def _store_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tenplex.cli", "store", *argv], capture_output=True, text=True,
                          timeout=120)


def test_store_stop_stops_the_store_tenplex_run_left(tmp_path):
    root = tmp_path / "h0"
    launcher.ensure_store(RunSpec("h0", root), None)
    pid = int((root / ".tenplex-store.pid").read_text())
    done = _store_cli("stop", "--store-root", str(root))
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"stopped the store of {root} (pid {pid})\n"
    assert not alive(pid) and _serving(root.resolve()) == []
    assert not (root / ".tenplex-store.pid").exists() and not (root / ".tenplex-store.port").exists()
    again = _store_cli("stop", "--store-root", str(root))
    assert (again.returncode, again.stdout) == (0, f"no store is running for {root}\n")


def test_store_stop_leaves_a_process_that_reused_the_pid_alone(tmp_path):
    root = tmp_path / "h0"
    root.mkdir()
    other = subprocess.Popen(["sleep", "60"])
    try:
        (root / ".tenplex-store.pid").write_text(f"{other.pid}\n")
        done = _store_cli("stop", "--store-root", str(root))
        assert (done.returncode, done.stdout) == (0, f"no store is running for {root}\n")
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_stop_store_kills_a_store_that_ignores_sigterm(tmp_path):
    root = (tmp_path / "h0").resolve()
    root.mkdir()
    # Its command line is a store's for this root; it ignores SIGTERM (a store stuck in a slow commit).
    stuck = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); print(flush=True); time.sleep(120)", "serve", "--root", str(root)],
                             stdout=subprocess.PIPE)
    try:
        stuck.stdout.readline()  # SIGTERM is ignored from now on
        (root / ".tenplex-store.pid").write_text(f"{stuck.pid}\n")
        assert launcher.stop_store(root, timeout=0.5) == stuck.pid
        assert stuck.wait(timeout=120) == -signal.SIGKILL
        assert not (root / ".tenplex-store.pid").exists()
    finally:
        stuck.kill()
        stuck.wait()


def test_store_stop_of_a_missing_directory_is_a_usage_error(tmp_path):
    done = _store_cli("stop", "--store-root", str(tmp_path / "nope"))
    assert done.returncode == 2
    assert done.stderr == f"tenplex store: error: --store-root {tmp_path / 'nope'} is not a directory\n"


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 120
    while alive(pid):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_rendezvous_store_serves_clients_on_loopback_only_by_default(tmp_path):
    import torch.distributed as dist

    from tenplex.elastic.rendezvous import serve

    with pytest.raises(ConfigError, match="no authentication"):
        serve("0.0.0.0")
    stop, ports = threading.Event(), []
    thread = threading.Thread(target=serve, kwargs=dict(port=0, port_file=tmp_path / "p", stop=stop,
                                                        ready=ports.append))
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not ports:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.02)
        assert int((tmp_path / "p").read_text()) == ports[0]
        a = dist.TCPStore("127.0.0.1", ports[0], is_master=False, timeout=datetime.timedelta(seconds=10))
        b = dist.TCPStore("127.0.0.1", ports[0], is_master=False, timeout=datetime.timedelta(seconds=10))
        a.set("job1/x", "1")
        assert b.get("job1/x") == b"1"
    finally:
        stop.set()
        thread.join(30)
