"""No process can block another's commit, delete or gc of a shared store by hanging inside one (issues 39 and 36).

Real processes on one store root (``store_processes.py``). A process stops itself (SIGSTOP) at a chosen point
inside a commit or a gc, as a hung worker would; another process must still commit, delete and gc (each such
call runs in a process of its own with a generous deadline, so a wait on the stopped one fails the test instead
of hanging it). Then the stopped one resumes or is killed, and the store must be whole: no half-published
version, the stopped operation either done wholly or not at all, and after gc no leftovers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tenplex.errors import StoreError
from tenplex.store import Store, local

from store_processes import stage

HELPER = str(Path(__file__).with_name("store_processes.py"))
DEADLINE_S = 120  # for a process that should not wait on anyone: generous on a loaded machine


_spawned: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_helper_outlives_its_test():
    yield
    while _spawned:
        proc = _spawned.pop()
        if proc.poll() is None:  # a test that failed early: its stopped helper would wait for good
            proc.kill()
            proc.wait()
        proc.stdout.close()


def _spawn(*args) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, HELPER, *map(str, args)], stdout=subprocess.PIPE, text=True)
    _spawned.append(proc)
    return proc


def _run(*args) -> list[dict]:
    try:
        proc = subprocess.run([sys.executable, HELPER, *map(str, args)], capture_output=True, text=True,
                              timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{args[0]} waited {DEADLINE_S} s: it is blocked by the stopped process")
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def _await_stop(proc: subprocess.Popen) -> None:
    """Wait until ``proc`` stopped itself inside the operation (it says so, then stops)."""
    assert json.loads(proc.stdout.readline()) == {"stopping": proc.pid}
    _, status = os.waitpid(proc.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), f"the helper ended instead of stopping (status {status})"


def _resume(proc: subprocess.Popen) -> list[dict]:
    os.kill(proc.pid, signal.SIGCONT)
    out, _ = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 0
    return [json.loads(line) for line in out.splitlines()]


def _assert_whole(root: Path, writers: dict[int, str]) -> None:
    """Exactly ``writers``' versions are committed, each whole and written by its writer; gc leaves nothing else."""
    store = Store(root, "h0")
    assert store.versions() == sorted(writers)
    for version, writer in writers.items():
        reader = store.open(version)
        assert reader.verify() == [], f"version {version} is damaged"
        assert reader.get_json("who") == {"writer": writer, "version": version}
        reader.close()
    newest = max(writers)
    store.gc(keep=1)
    assert store.versions() == [newest]
    assert [list((root / sub).iterdir()) for sub in ("staging", "publishing", "trash")] == [[], [], []]


@pytest.mark.parametrize("point, ending", [("link", "resume"), ("publish", "resume"), ("publish", "kill")])
def test_a_process_stopped_inside_a_commit_blocks_no_other_process(tmp_path, point, ending):
    """Stopped in the middle of putting version 2 together, or with it complete just before publishing it:
    another process commits that very version and a newer one meanwhile; resumed, the stopped one finds
    version 2 committed (AlreadyCommitted) and publishes nothing; killed, it leaves only what gc removes."""
    root = tmp_path / "s"
    _run("commit", root, "first", 1)
    stopped = _spawn("stop-in-commit", root, 2, point)
    _await_stop(stopped)
    assert _run("commit", root, "other", 2, 3) == [{"version": 2, "outcome": "committed"},
                                                   {"version": 3, "outcome": "committed"}]
    if ending == "resume":
        assert _resume(stopped) == [{"version": 2, "outcome": "already"}]
    else:
        stopped.kill()
        stopped.communicate()
        assert list((root / "publishing").iterdir()), "the killed commit left its tree (the test proves gc drops it)"
    _assert_whole(root, {1: "first", 2: "other", 3: "other"})


def test_a_process_stopped_inside_gc_blocks_no_other_process(tmp_path):
    """A gc stopped with version 1 in the trash: another process commits, deletes and gcs; resumed, the first
    gc finishes; nothing it had not yet removed comes back."""
    root = tmp_path / "s"
    _run("commit", root, "first", 1, 2)
    stopped = _spawn("stop-in-gc", root)
    _await_stop(stopped)
    assert not (root / "versions" / "1").exists()
    assert _run("commit", root, "other", 3, 4) == [{"version": 3, "outcome": "committed"},
                                                   {"version": 4, "outcome": "committed"}]
    assert _run("delete", root, 3) == [{"deleted": 3, "existed": True}]
    assert _run("gc", root) == [{"gc": [2]}]
    assert _resume(stopped) == [{"gc": [1]}]
    _assert_whole(root, {4: "other"})


def test_the_locked_fallback_names_its_stopped_holder_and_gives_up(tmp_path, monkeypatch):
    """Without renameat2 the publishing rename runs under ``.lock``: a commit waiting on a stopped holder raises
    past ``lock_timeout``, naming the file and the holder, and leaves nothing behind; the lock-free path ignores
    the lock; resumed, the holder's commit completes."""
    root = tmp_path / "s"
    _run("commit", root, "first", 1)
    stopped = _spawn("stop-in-commit", root, 2, "locked")
    _await_stop(stopped)
    store = Store(root, "h0", lock_timeout=1.0)
    stage(store, 3, "waiter")
    monkeypatch.setattr(local, "rename_noreplace", lambda src, dst: False)
    lock = root / ".lock"
    with pytest.raises(StoreError, match=rf"committing version 3: gave up after 1 s waiting for the lock {lock}, "
                                         rf"held by pid {stopped.pid} \(stopped\)"):
        store.commit(3, parts=["waiter"])
    assert list((root / "publishing").iterdir()) == [p for p in (root / "publishing").iterdir()
                                                     if p.name.startswith("2-")], "the failed commit left its tree"
    assert store.versions() == [1]
    monkeypatch.undo()
    store.commit(3, parts=["waiter"])  # renameat2: no lock, though its holder is still stopped
    assert _resume(stopped) == [{"version": 2, "outcome": "committed"}]
    _assert_whole(root, {1: "first", 2: "stopped", 3: "waiter"})


def test_processes_committing_at_once_win_each_version_exactly_once(tmp_path):
    """Four processes stage the same five versions (and one of their own each), then commit at once: each
    shared version is won by exactly one of them, whole, with only the winner's part; the rest get
    AlreadyCommitted."""
    root, go = tmp_path / "s", tmp_path / "go"
    Store(root, "h0")
    shared = [1, 2, 3, 4, 5]
    procs = {f"w{i}": _spawn("race", root, f"w{i}", go, *shared, 10 + i) for i in range(4)}
    for name, proc in procs.items():
        assert json.loads(proc.stdout.readline()) == {"staged": name}
    go.touch()
    outcomes = {}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=DEADLINE_S)
        assert proc.returncode == 0
        outcomes[name] = {d["version"]: d["outcome"] for d in map(json.loads, out.splitlines())}
    winners = {}
    for v in shared:
        results = sorted(outcomes[name][v] for name in procs)
        assert results == ["already", "already", "already", "committed"], (v, results)
        winners[v] = next(name for name in procs if outcomes[name][v] == "committed")
    assert all(outcomes[f"w{i}"][10 + i] == "committed" for i in range(4))
    store = Store(root, "h0")
    for v, winner in winners.items():
        reader = store.open(v)
        assert {entry.file.split("/")[0] for entry in reader.entries} == {winner}
        reader.close()
    _assert_whole(root, {**winners, **{10 + i: f"w{i}" for i in range(4)}})


def test_gc_alongside_commits_keeps_the_newest_version_and_damages_nothing(tmp_path):
    """Two processes gc(keep=1) in a loop while a third commits 25 versions in order: every version is whole
    and readable right after its commit (gc never removes the newest), and no gc ever sees a damaged one."""
    root, stop = tmp_path / "s", tmp_path / "stop"
    Store(root, "h0")
    loops = [_spawn("gc-loop", root, stop) for _ in range(2)]
    for proc in loops:
        assert json.loads(proc.stdout.readline()) == {"looping": proc.pid}
    assert _run("climb", root, 25) == [{"climbed": 25, "lost": []}]
    stop.touch()
    for proc in loops:
        out, _ = proc.communicate(timeout=DEADLINE_S)
        result = json.loads(out)
        assert result["damaged"] == [] and result["rounds"] >= 1
    _assert_whole(root, {25: "climber"})


def test_a_file_system_without_hard_links_commits_by_copying(tmp_path, monkeypatch):
    """Where ``link`` fails (EPERM: no hard links on this file system), commit copies the staged files into its
    tree instead: the version is the same, whole, and its files are its own."""
    root = tmp_path / "s"
    store = Store(root, "h0")
    stage(store, 1, "copied")

    def no_link(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(os, "link", no_link)
    store.commit(1, parts=["copied"])
    monkeypatch.undo()
    assert all(f.stat().st_nlink == 1 for f in (root / "versions" / "1").rglob("*") if f.is_file())
    _assert_whole(root, {1: "copied"})
