"""Mount, switch and unmount from Python; the server always runs in its own process.

May import: ``fuse_vfs`` (preflight, errors, binding), ``tenplex.dataset``, ``tenplex.files`` and the standard library.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tenplex.dataset.state import DatasetState
from tenplex.dataset.statefile import write_state_file
from tenplex.dataset.view import STATE_NAME as ROOT_STATE

from . import binding
from .errors import VfsError
from .preflight import check_fuse, check_mountpoint, fusermount


def read_root(mountpoint: str | os.PathLike) -> dict[str, Any]:
    """The mount's ``/state.json``: generation, dp, state, state file, errors."""
    try:
        return json.loads((Path(mountpoint) / ROOT_STATE).read_bytes())
    except FileNotFoundError:
        raise VfsError(f"{mountpoint} is not a tenplex mount (no {ROOT_STATE})") from None
    except OSError as e:
        raise VfsError(f"{mountpoint}: cannot read {ROOT_STATE}: {e}") from None


class MountHandle:
    """A running mount. ``unmount()`` is safe to call more than once; use it in ``finally``/teardown."""

    def __init__(self, mountpoint: Path, process: subprocess.Popen | None, log_path: Path | None):
        self.mountpoint, self.process, self.log_path = mountpoint, process, log_path

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def log(self) -> str:
        try:
            return self.log_path.read_text() if self.log_path else ""
        except FileNotFoundError:
            return ""

    def switch(self, **kwargs) -> dict[str, Any]:
        return switch(self.mountpoint, **kwargs)

    def unmount(self, lazy: bool = False, timeout: float = 30) -> None:
        try:
            if os.path.ismount(self.mountpoint) or _is_dead_mount(self.mountpoint):
                unmount(self.mountpoint, lazy=lazy)
        finally:
            if self.process is not None and self.process.poll() is None:
                try:
                    self.process.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    self.process.send_signal(signal.SIGKILL)
                    self.process.wait()

    def __enter__(self) -> "MountHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.unmount(lazy=True)


def _is_dead_mount(path: Path) -> bool:
    try:
        os.stat(path)
    except OSError as e:
        return e.errno == errno.ENOTCONN  # the server is gone but the kernel mount remains
    return False


def mount(dataset: str | os.PathLike, mountpoint: str | os.PathLike, state_file: str | os.PathLike, *,
          log_path: str | os.PathLike | None = None, timeout: float = 60, store: str | None = None,
          cache_dir: str | None = None, allow_other: bool = False, libfuse: str | None = None) -> MountHandle:
    """Start ``python -m fuse_vfs.server`` in a new session and return once the mount serves its view.

    ``libfuse``: "auto" (libfuse3 when installed, else libfuse2), "3" or "2"; None: ``$TENPLEX_LIBFUSE``
    or auto. ``read_root(mountpoint)["libfuse"]`` says which one the server runs on.
    """
    env = binding.server_env(libfuse)
    check_fuse()
    check_mountpoint(mountpoint)
    mountpoint = Path(mountpoint).resolve()
    own_log = log_path is None  # a log of our own making: removed again if the mount fails (its text is in the error)
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="tenplex-vfs-", suffix=".log")
        os.close(fd)
        log_path = name
    log_path = Path(log_path)
    cmd = [sys.executable, "-m", "fuse_vfs.server", os.fspath(dataset), str(mountpoint), "--state",
           os.fspath(state_file)]
    if store:
        cmd += ["--store", store] + (["--cache-dir", cache_dir] if cache_dir else [])
    if allow_other:
        cmd.append("--allow-other")
    with open(log_path, "ab") as log:
        # A new session: the server outlives the caller (the CLI returns) and ignores its Ctrl-C.
        process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                                   env=env)
    handle = MountHandle(mountpoint, process, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise VfsError(f"the FUSE server exited with code {process.returncode}: {_last_words(handle, own_log)}")
        if os.path.ismount(mountpoint):
            try:
                read_root(mountpoint)
                return handle
            except VfsError:
                pass
        time.sleep(0.02)
    handle.unmount(lazy=True, timeout=5)
    raise VfsError(f"{mountpoint} was not mounted within {timeout} s; server log: {_last_words(handle, own_log)}")


def _last_words(handle: MountHandle, remove: bool) -> str:
    """The failed server's log, for the error message; the log file itself is removed when ``remove``."""
    text = handle.log().strip()
    if remove and handle.log_path is not None:
        handle.log_path.unlink(missing_ok=True)
    return text


def unmount(mountpoint: str | os.PathLike, lazy: bool = False) -> None:
    """``fusermount3 -u`` (``-z`` with ``lazy``); a busy mount gives an error saying how to proceed."""
    tool = fusermount()
    if tool is None:
        raise VfsError("cannot unmount: neither fusermount3 nor fusermount is installed")
    cmd = [tool, "-u"] + (["-z"] if lazy else []) + [os.fspath(mountpoint)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        msg = result.stderr.strip() or f"{tool} exited with {result.returncode}"
        if "busy" in msg.lower():
            raise VfsError(f"{mountpoint} is busy: a process still has files open under it; stop it, or "
                           f"detach now with `tenplex vfs unmount --lazy {mountpoint}` ({msg})")
        raise VfsError(f"cannot unmount {mountpoint}: {msg}")


def switch(mountpoint: str | os.PathLike, *, dp: int | None = None, position: int | None = None,
           state: DatasetState | None = None, world: str | None = None, timeout: float = 60) -> dict[str, Any]:
    """Switch a mount to a new dp degree and/or position; returns the new ``/state.json`` once it serves it.

    ``world`` names the elastic job's world that switches (``tenplex run``); the view then carries it.

    Raises VfsError, leaving the old view in place, when the server refuses the new state.
    """
    root = read_root(mountpoint)
    current = DatasetState.from_dict(root["state"])
    new_state = state or (current if position is None else dataclasses.replace(current, position=position))
    write_state_file(root["state_file"], new_state, dp or root["dp"], world)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = read_root(mountpoint)
        if now["loads"] > root["loads"]:
            if now["state_error"]:
                raise VfsError(f"{mountpoint} kept generation {now['generation']}: {now['state_error']}")
            return now
        time.sleep(0.02)
    raise VfsError(f"{mountpoint} did not pick up the new state within {timeout} s (is its server running? "
                   f"pid {root.get('pid')})")
