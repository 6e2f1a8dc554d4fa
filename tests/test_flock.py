"""Bounded waits for the host's file locks (``tenplex.flock``): a holder that is stopped, not dead, is named, not
waited on for good (issue 39). The kernel frees a dead holder's ``flock``, never a stopped one's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tenplex.elastic import dataview, launcher
from tenplex.flock import LockTimeout, held

_HOLDER = textwrap.dedent("""
    import os, signal, sys
    from tenplex.flock import held
    with held(sys.argv[1], 60, "a"), held(sys.argv[2], 60, "b"):
        print("held", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
""")


@pytest.fixture
def stopped_holder(tmp_path):
    """A process stopped while it holds the node store's lock and a dataset view's lock."""
    store_lock, view_lock = tmp_path / ".tenplex-store.lock", tmp_path / "view.lock"
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(store_lock), str(view_lock)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline() == "held\n"
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
        yield proc, view_lock
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_a_stopped_holder_is_named_and_not_waited_on_for_good(tmp_path, stopped_holder):
    proc, view_lock = stopped_holder
    with pytest.raises(LockTimeout, match=rf"the node store of {tmp_path}: gave up after 0.3 s waiting for the lock "
                                          rf"{tmp_path}/.tenplex-store.lock, held by pid {proc.pid} \(stopped\)"):
        with launcher._store_lock(tmp_path, wait=0.3):
            pass
    with pytest.raises(dataview.DataViewError, match=rf"dataset view: gave up .* held by pid {proc.pid} \(stopped\)"):
        with dataview._lock(view_lock, 0.3):
            pass
    os.kill(proc.pid, signal.SIGKILL)  # dead, its locks are free at once
    proc.wait()
    with held(view_lock, 60, "after the holder died"):
        assert view_lock.read_text() == f"{os.getpid()}\n"  # the holder's pid, for whoever waits next
