"""``python -m tenplex.elastic.entry MODE TARGET [ARGS…]``: how ``tenplex run`` starts each worker.

Why: torchrun starts every worker in a session of its own, so killing the
agent, or its process group, leaves the workers running (measured here: a
SIGKILLed agent orphans its workers). A node that dies takes everything on it,
so each worker asks the kernel to SIGKILL it when its agent dies
(``PR_SET_PDEATHSIG``, which survives ``exec``), then runs the user's
program. MODE is ``script`` (``python -u TARGET``), ``module`` (``python -u -m
TARGET``) or ``exec`` (torchrun's ``--no-python``: run TARGET itself).

A Python program (``script``, ``module``) runs in this process (``runpy``),
so that an exception that ends it is classified here
(:func:`tenplex.elastic.faults.classify`): a device fault exits with
:data:`~tenplex.elastic.faults.EXIT_DEVICE_FAULT`, a lost peer (gloo's
"Connection reset by peer" from the user's ``backward()``, NCCL's remote
errors) with :data:`~tenplex.elastic.faults.EXIT_PEER_LOST`, after the
traceback; anything else exits as Python would (1), a crash. ``exec``
programs are not Python: their exit code is theirs.

May import: the standard library and :mod:`tenplex.elastic.faults` (it runs before the user's program).
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys
import traceback

from .faults import CRASH, classify, exit_code

PR_SET_PDEATHSIG = 1


def die_with_parent(agent_pid: int | None) -> None:
    """SIGKILL this process when its parent (the agent) dies; exit now if that already happened."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # The agent may have died between our fork and the prctl: then nobody would kill us.
    if agent_pid is not None and os.getppid() != agent_pid:
        os._exit(1)


def command(mode: str, target: str, args: list[str]) -> list[str]:
    if mode == "script":
        return [sys.executable, "-u", target, *args]
    if mode == "module":
        return [sys.executable, "-u", "-m", target, *args]
    if mode == "exec":
        return [target, *args]
    raise SystemExit(f"tenplex.elastic.entry: unknown mode {mode!r}; expected script, module or exec")


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: python -m tenplex.elastic.entry {script,module,exec} TARGET [ARGS...]")
    agent = os.environ.get("TENPLEX_AGENT_PID")
    die_with_parent(int(agent) if agent else None)
    mode, target, args = argv[0], argv[1], argv[2:]
    if mode == "exec":
        argv = command(mode, target, args)
        os.execvp(argv[0], argv)
    command(mode, target, args)  # refuses an unknown mode
    run_python(mode, target, args)


def run_python(mode: str, target: str, args: list[str]) -> None:
    """Run a Python script or module as ``python -u`` would; exit with the code of a classified failure."""
    sys.argv = [target, *args]
    if mode == "script":
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python TARGET` puts it first
    try:
        if mode == "script":
            runpy.run_path(target, run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 -- classified once, here; a crash is re-raised unchanged
        kind = classify(e)
        if kind == CRASH:
            raise
        traceback.print_exc()
        print(f"tenplex.elastic.entry: worker {os.environ.get('TENPLEX_HOST', '?')}/"
              f"{os.environ.get('LOCAL_RANK', '?')} stopped: {kind} ({type(e).__name__})", file=sys.stderr,
              flush=True)
        sys.stdout.flush()
        os._exit(exit_code(kind))  # type: ignore[arg-type]  # a peer may be gone: no interpreter teardown


if __name__ == "__main__":
    main(sys.argv[1:])
